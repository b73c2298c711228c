// Row norms on the GPU (RMSNorm, LayerNorm, L2 normalisation, Kimi's sigmoid-gated RMSNorm): a
// warp or a block per row, fp32 sums, the row read once for the sums and once more (from cache)
// for the output.
#include <type_traits>

#include "ops/nn/cuda/nn_common.cuh"

namespace kda::ops::cuda {
namespace {

using namespace nn_detail;

template <int kTeam, int V, class OutT>
__global__ void rms_norm_kernel(const float* x, int64_t rows, int64_t D, int64_t x_stride,
                                const float* weight, float eps, OutT* y, int64_t y_stride) {
  __shared__ float scratch[32];
  int64_t row;
  int lane;
  team_position<kTeam>(row, lane);
  if (row >= rows) return;  // a whole warp (warp teams) or never (block teams)
  const float* xr = x + row * x_stride;
  float ss = 0.0f;
  for (int64_t i = int64_t(lane) * V; i < D; i += int64_t(kTeam) * V) {
    const Vec<V> a = load_vec<V>(xr + i);
#pragma unroll
    for (int k = 0; k < V; ++k) ss += a.v[k] * a.v[k];
  }
  ss = team_sum<kTeam>(ss, scratch);
  const float inv = rsqrtf(ss / float(D) + eps);
  OutT* yr = y + row * y_stride;
  for (int64_t i = int64_t(lane) * V; i < D; i += int64_t(kTeam) * V) {
    const Vec<V> a = load_vec<V>(xr + i);
    const Vec<V> w = load_or<V>(weight ? weight + i : nullptr, 1.0f);
    Vec<V> o;
#pragma unroll
    for (int k = 0; k < V; ++k) o.v[k] = a.v[k] * inv * w.v[k];
    store_vec<V>(yr + i, o);
  }
}

template <int kTeam, int V, class OutT>
__global__ void layer_norm_kernel(const float* x, int64_t rows, int64_t D, const float* weight,
                                  const float* bias, float eps, OutT* y, int64_t y_stride) {
  __shared__ float scratch[32];
  int64_t row;
  int lane;
  team_position<kTeam>(row, lane);
  if (row >= rows) return;
  const float* xr = x + row * D;
  float sum = 0.0f;
  for (int64_t i = int64_t(lane) * V; i < D; i += int64_t(kTeam) * V) {
    const Vec<V> a = load_vec<V>(xr + i);
#pragma unroll
    for (int k = 0; k < V; ++k) sum += a.v[k];
  }
  const float mean = team_sum<kTeam>(sum, scratch) / float(D);
  // Two passes (as the CPU): the variance of x - mean, not E[x^2] - mean^2.
  float var = 0.0f;
  for (int64_t i = int64_t(lane) * V; i < D; i += int64_t(kTeam) * V) {
    const Vec<V> a = load_vec<V>(xr + i);
#pragma unroll
    for (int k = 0; k < V; ++k) var += (a.v[k] - mean) * (a.v[k] - mean);
  }
  var = team_sum<kTeam>(var, scratch) / float(D);
  const float inv = rsqrtf(var + eps);
  OutT* yr = y + row * y_stride;
  for (int64_t i = int64_t(lane) * V; i < D; i += int64_t(kTeam) * V) {
    const Vec<V> a = load_vec<V>(xr + i);
    const Vec<V> w = load_or<V>(weight ? weight + i : nullptr, 1.0f);
    const Vec<V> b = load_or<V>(bias ? bias + i : nullptr, 0.0f);
    Vec<V> o;
#pragma unroll
    for (int k = 0; k < V; ++k) o.v[k] = (a.v[k] - mean) * inv * w.v[k] + b.v[k];
    store_vec<V>(yr + i, o);
  }
}

template <int kTeam, int V, class OutT>
__global__ void l2_normalize_kernel(const float* x, int64_t rows, int64_t D, float eps, OutT* y,
                                    int64_t y_stride) {
  __shared__ float scratch[32];
  int64_t row;
  int lane;
  team_position<kTeam>(row, lane);
  if (row >= rows) return;
  const float* xr = x + row * D;
  float ss = 0.0f;
  for (int64_t i = int64_t(lane) * V; i < D; i += int64_t(kTeam) * V) {
    const Vec<V> a = load_vec<V>(xr + i);
#pragma unroll
    for (int k = 0; k < V; ++k) ss += a.v[k] * a.v[k];
  }
  const float inv = rsqrtf(team_sum<kTeam>(ss, scratch) + eps);
  OutT* yr = y + row * y_stride;
  for (int64_t i = int64_t(lane) * V; i < D; i += int64_t(kTeam) * V) {
    Vec<V> a = load_vec<V>(xr + i);
#pragma unroll
    for (int k = 0; k < V; ++k) a.v[k] *= inv;
    store_vec<V>(yr + i, a);
  }
}

template <int kTeam, int V, class InT, class OutT>
__global__ void gated_rms_norm_kernel(const InT* x, const float* gate, int64_t rows, int64_t D,
                                      const float* weight, float eps, OutT* y, int64_t y_stride) {
  __shared__ float scratch[32];
  int64_t row;
  int lane;
  team_position<kTeam>(row, lane);
  if (row >= rows) return;
  const InT* xr = x + row * D;
  const float* gr = gate + row * D;
  float ss = 0.0f;
  for (int64_t i = int64_t(lane) * V; i < D; i += int64_t(kTeam) * V) {
    const Vec<V> a = load_vec<V>(xr + i);
#pragma unroll
    for (int k = 0; k < V; ++k) ss += a.v[k] * a.v[k];
  }
  ss = team_sum<kTeam>(ss, scratch);
  const float inv = rsqrtf(ss / float(D) + eps);
  OutT* yr = y + row * y_stride;
  for (int64_t i = int64_t(lane) * V; i < D; i += int64_t(kTeam) * V) {
    const Vec<V> a = load_vec<V>(xr + i);
    const Vec<V> g = load_vec<V>(gr + i);
    const Vec<V> w = load_vec<V>(weight + i);
    Vec<V> o;
#pragma unroll
    for (int k = 0; k < V; ++k) o.v[k] = w.v[k] * (a.v[k] * inv) * sigmoid_f(g.v[k]);
    store_vec<V>(yr + i, o);
  }
}

template <class T>
using Elem = std::remove_pointer_t<T>;

}  // namespace

void rms_norm(const float* x, int64_t rows, int64_t D, int64_t x_stride, const float* weight,
              float eps, OutRows y, cudaStream_t stream) {
  require(rows >= 0 && D >= 1, "cuda::rms_norm: sizes must be positive");
  const int64_t xs = x_stride > 0 ? x_stride : D;
  require(xs >= D, "cuda::rms_norm: x_stride smaller than D");
  check_out(y, D, "cuda::rms_norm");
  if (rows == 0) return;
  require(x && y.data, "cuda::rms_norm: null pointer");
  const int64_t ys = out_stride(y, D);
  const size_t ob = element_bytes(y.type);
  const bool vec4 = D % 4 == 0 && xs % 4 == 0 && ys % 4 == 0 && aligned_for(x, 4, 4) &&
                    (!weight || aligned_for(weight, 4, 4)) && aligned_for(y.data, 4, ob);
  dispatch_type(y.type, [&](auto* tag) {
    using OutT = Elem<decltype(tag)>;
    for_rows(rows, D, vec4, [&](auto team, auto v, dim3 grid, dim3 block) {
      rms_norm_kernel<decltype(team)::value, decltype(v)::value, OutT>
          <<<grid, block, 0, stream>>>(x, rows, D, xs, weight, eps, static_cast<OutT*>(y.data), ys);
    });
  });
  check_launch("cuda::rms_norm");
}

void layer_norm(const float* x, int64_t rows, int64_t D, const float* weight, const float* bias,
                float eps, OutRows y, cudaStream_t stream) {
  require(rows >= 0 && D >= 1, "cuda::layer_norm: sizes must be positive");
  check_out(y, D, "cuda::layer_norm");
  if (rows == 0) return;
  require(x && y.data, "cuda::layer_norm: null pointer");
  const int64_t ys = out_stride(y, D);
  const size_t ob = element_bytes(y.type);
  const bool vec4 = D % 4 == 0 && ys % 4 == 0 && aligned_for(x, 4, 4) &&
                    (!weight || aligned_for(weight, 4, 4)) && (!bias || aligned_for(bias, 4, 4)) &&
                    aligned_for(y.data, 4, ob);
  dispatch_type(y.type, [&](auto* tag) {
    using OutT = Elem<decltype(tag)>;
    for_rows(rows, D, vec4, [&](auto team, auto v, dim3 grid, dim3 block) {
      layer_norm_kernel<decltype(team)::value, decltype(v)::value, OutT>
          <<<grid, block, 0, stream>>>(x, rows, D, weight, bias, eps, static_cast<OutT*>(y.data),
                                       ys);
    });
  });
  check_launch("cuda::layer_norm");
}

void l2_normalize_rows(const float* x, int64_t rows, int64_t D, float eps, OutRows y,
                       cudaStream_t stream) {
  require(rows >= 0 && D >= 1, "cuda::l2_normalize_rows: sizes must be positive");
  check_out(y, D, "cuda::l2_normalize_rows");
  if (rows == 0) return;
  require(x && y.data, "cuda::l2_normalize_rows: null pointer");
  const int64_t ys = out_stride(y, D);
  const size_t ob = element_bytes(y.type);
  const bool vec4 = D % 4 == 0 && ys % 4 == 0 && aligned_for(x, 4, 4) && aligned_for(y.data, 4, ob);
  dispatch_type(y.type, [&](auto* tag) {
    using OutT = Elem<decltype(tag)>;
    for_rows(rows, D, vec4, [&](auto team, auto v, dim3 grid, dim3 block) {
      l2_normalize_kernel<decltype(team)::value, decltype(v)::value, OutT>
          <<<grid, block, 0, stream>>>(x, rows, D, eps, static_cast<OutT*>(y.data), ys);
    });
  });
  check_launch("cuda::l2_normalize_rows");
}

void gated_rms_norm_sigmoid(const void* x, ElementType x_type, const float* gate, int64_t rows,
                            int64_t D, const float* weight, float eps, OutRows y,
                            cudaStream_t stream) {
  require(rows >= 0 && D >= 1, "cuda::gated_rms_norm_sigmoid: sizes must be positive");
  check_out(y, D, "cuda::gated_rms_norm_sigmoid");
  if (rows == 0) return;
  require(x && gate && weight && y.data, "cuda::gated_rms_norm_sigmoid: null pointer");
  const int64_t ys = out_stride(y, D);
  const bool vec4 = D % 4 == 0 && ys % 4 == 0 && aligned_for(x, 4, element_bytes(x_type)) &&
                    aligned_for(gate, 4, 4) && aligned_for(weight, 4, 4) &&
                    aligned_for(y.data, 4, element_bytes(y.type));
  dispatch_type(x_type, [&](auto* in_tag) {
    using InT = Elem<decltype(in_tag)>;
    dispatch_type(y.type, [&](auto* out_tag) {
      using OutT = Elem<decltype(out_tag)>;
      for_rows(rows, D, vec4, [&](auto team, auto v, dim3 grid, dim3 block) {
        gated_rms_norm_kernel<decltype(team)::value, decltype(v)::value, InT, OutT>
            <<<grid, block, 0, stream>>>(static_cast<const InT*>(x), gate, rows, D, weight, eps,
                                         static_cast<OutT*>(y.data), ys);
      });
    });
  });
  check_launch("cuda::gated_rms_norm_sigmoid");
}

}  // namespace kda::ops::cuda
