// Training norms on the GPU: RMSNorm forward (keeping inv_rms) and backward, LayerNorm backward.
// dx: a warp or a block per row (nn_common.cuh's row teams). The weight gradients are sums over
// rows, done without atomics so they are the same bits every run: the rows are cut into fixed
// chunks, a thread per column sums its chunk in row order into partials [chunks, D], and a
// second kernel adds the chunks in chunk order into dw.
#include <string>
#include <type_traits>

#include "ops/nn/cuda/nn_common.cuh"
#include "ops/nn/cuda/train_cuda.h"

namespace kda::ops::cuda {
namespace {

using namespace nn_detail;

template <class T>
using Elem = std::remove_pointer_t<T>;

// ---- dx: row teams ----

template <int kTeam, int V, class OutT>
__global__ void rms_norm_train_kernel(const float* x, int64_t rows, int64_t D, const float* w,
                                      float eps, OutT* y, int64_t y_stride, float* inv_rms) {
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
  ss = team_sum<kTeam>(ss, scratch);
  // 1 / sqrt (both correctly rounded), as the CPU's float(1 / sqrt(.)), rather than rsqrtf.
  const float inv = 1.0f / sqrtf(ss / float(D) + eps);
  if (lane == 0) inv_rms[row] = inv;
  OutT* yr = y + row * y_stride;
  for (int64_t i = int64_t(lane) * V; i < D; i += int64_t(kTeam) * V) {
    const Vec<V> a = load_vec<V>(xr + i);
    const Vec<V> g = load_vec<V>(w + i);
    Vec<V> o;
#pragma unroll
    for (int k = 0; k < V; ++k) o.v[k] = a.v[k] * inv * g.v[k];
    store_vec<V>(yr + i, o);
  }
}

template <int kTeam, int V>
__global__ void rms_norm_dx_kernel(const float* x, const float* dy, int64_t rows, int64_t D,
                                   const float* w, const float* inv_rms, float* dx,
                                   bool accumulate) {
  __shared__ float scratch[32];
  int64_t row;
  int lane;
  team_position<kTeam>(row, lane);
  if (row >= rows) return;
  const float* xr = x + row * D;
  const float* dyr = dy + row * D;
  float dot = 0.0f;  // sum_i dy_i w_i x_i
  for (int64_t i = int64_t(lane) * V; i < D; i += int64_t(kTeam) * V) {
    const Vec<V> a = load_vec<V>(xr + i);
    const Vec<V> d = load_vec<V>(dyr + i);
    const Vec<V> g = load_vec<V>(w + i);
#pragma unroll
    for (int k = 0; k < V; ++k) dot += d.v[k] * g.v[k] * a.v[k];
  }
  dot = team_sum<kTeam>(dot, scratch);
  const float inv = inv_rms[row];
  const float c = dot / float(D) * inv * inv * inv;
  float* dxr = dx + row * D;
  for (int64_t i = int64_t(lane) * V; i < D; i += int64_t(kTeam) * V) {
    const Vec<V> a = load_vec<V>(xr + i);
    const Vec<V> d = load_vec<V>(dyr + i);
    const Vec<V> g = load_vec<V>(w + i);
    Vec<V> o;
#pragma unroll
    for (int k = 0; k < V; ++k) o.v[k] = d.v[k] * g.v[k] * inv - a.v[k] * c;
    if (accumulate) {  // the residual stream's add, fused
      const Vec<V> old = load_vec<V>(dxr + i);
#pragma unroll
      for (int k = 0; k < V; ++k) o.v[k] += old.v[k];
    }
    store_vec<V>(dxr + i, o);
  }
}

// Also keeps each row's mean and rstd ([rows] each) for the weight-gradient pass.
template <int kTeam, int V>
__global__ void layer_norm_dx_kernel(const float* x, const float* dy, int64_t rows, int64_t D,
                                     const float* w, float eps, float* dx, bool accumulate,
                                     float* mean_out, float* rstd_out) {
  __shared__ float scratch[32];
  int64_t row;
  int lane;
  team_position<kTeam>(row, lane);
  if (row >= rows) return;
  const float* xr = x + row * D;
  const float* dyr = dy + row * D;
  float sum = 0.0f;
  for (int64_t i = int64_t(lane) * V; i < D; i += int64_t(kTeam) * V) {
    const Vec<V> a = load_vec<V>(xr + i);
#pragma unroll
    for (int k = 0; k < V; ++k) sum += a.v[k];
  }
  const float mean = team_sum<kTeam>(sum, scratch) / float(D);
  float var = 0.0f;  // two passes, as the forward
  for (int64_t i = int64_t(lane) * V; i < D; i += int64_t(kTeam) * V) {
    const Vec<V> a = load_vec<V>(xr + i);
#pragma unroll
    for (int k = 0; k < V; ++k) var += (a.v[k] - mean) * (a.v[k] - mean);
  }
  var = team_sum<kTeam>(var, scratch) / float(D);
  const float rstd = 1.0f / sqrtf(var + eps);
  float sum_g = 0.0f, sum_gx = 0.0f;
  for (int64_t i = int64_t(lane) * V; i < D; i += int64_t(kTeam) * V) {
    const Vec<V> a = load_vec<V>(xr + i);
    const Vec<V> d = load_vec<V>(dyr + i);
    const Vec<V> g = load_vec<V>(w + i);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float gk = d.v[k] * g.v[k];
      sum_g += gk;
      sum_gx += gk * (a.v[k] - mean) * rstd;
    }
  }
  const float mg = team_sum<kTeam>(sum_g, scratch) / float(D);
  const float mgx = team_sum<kTeam>(sum_gx, scratch) / float(D);
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
  float* dxr = dx + row * D;
  for (int64_t i = int64_t(lane) * V; i < D; i += int64_t(kTeam) * V) {
    const Vec<V> a = load_vec<V>(xr + i);
    const Vec<V> d = load_vec<V>(dyr + i);
    const Vec<V> g = load_vec<V>(w + i);
    Vec<V> o = accumulate ? load_vec<V>(dxr + i) : Vec<V>{};
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float xhat = (a.v[k] - mean) * rstd;
      const float grad = rstd * (d.v[k] * g.v[k] - mg - xhat * mgx);
      o.v[k] = accumulate ? o.v[k] + grad : grad;
    }
    store_vec<V>(dxr + i, o);
  }
}

// ---- weight gradients: column sums over rows, in a fixed order ----

constexpr int kColumnThreads = 256;

// How the rows are cut: `chunks` chunks of `rows_per_chunk` rows (the last one shorter); a
// function of (rows, D) only, so the summation order never changes between runs.
struct ColumnPlan {
  int64_t chunks = 1, rows_per_chunk = 1, column_blocks = 1;
};

ColumnPlan column_plan(int64_t rows, int64_t D) {
  ColumnPlan p;
  p.column_blocks = ceil_div(D, kColumnThreads);
  // Aim at ~1024 blocks in all (several waves on 132 SMs), chunks of at least 16 rows.
  const int64_t want = std::clamp<int64_t>(ceil_div(1024, p.column_blocks), 1, 4096);
  p.rows_per_chunk = std::max<int64_t>(16, ceil_div(rows, want));
  p.chunks = ceil_div(rows, p.rows_per_chunk);
  return p;
}

// partials[chunk, k * D + col] = sum over the chunk's rows (in order) of term k of op(row, col).
template <int kOuts, class Op>
__global__ void column_partials_kernel(int64_t rows, int64_t D, int64_t rows_per_chunk, Op op,
                                       float* partials) {
  const int64_t col = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= D) return;
  const int64_t chunk = blockIdx.y;
  const int64_t first = chunk * rows_per_chunk;
  const int64_t end = std::min(rows, first + rows_per_chunk);
  float acc[kOuts] = {};
  for (int64_t r = first; r < end; ++r) op(r, col, acc);
  float* out = partials + chunk * kOuts * D;
#pragma unroll
  for (int k = 0; k < kOuts; ++k) out[k * D + col] = acc[k];
}

// out[col] += sum over chunks (in order) of partials[chunk * stride + col].
__global__ void reduce_partials_kernel(const float* partials, int64_t stride, int64_t chunks,
                                       int64_t D, float* out) {
  const int64_t col = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= D) return;
  float s = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) s += partials[c * stride + col];
  out[col] += s;
}

struct RmsDwTerm {
  const float *x, *dy, *inv_rms;
  int64_t D;
  __device__ void operator()(int64_t r, int64_t col, float* acc) const {
    acc[0] += dy[r * D + col] * x[r * D + col] * inv_rms[r];
  }
};

struct LayerNormDwDbTerms {
  const float *x, *dy, *mean, *rstd;
  int64_t D;
  __device__ void operator()(int64_t r, int64_t col, float* acc) const {
    const float d = dy[r * D + col];
    acc[0] += d * (x[r * D + col] - mean[r]) * rstd[r];
    acc[1] += d;
  }
};

// Sums the kOuts terms of op over rows into outs[k] (accumulated), deterministically.
template <int kOuts, class Op>
void column_sums(int64_t rows, int64_t D, const Op& op, float* const (&outs)[kOuts],
                 TrainScratch& scratch, cudaStream_t stream, const char* what) {
  const ColumnPlan p = column_plan(rows, D);
  require(p.chunks < 65536, std::string(what) + ": too many rows");
  scratch.partials.reserve(size_t(p.chunks * kOuts * D) * sizeof(float));
  float* partials = scratch.partials.as<float>();
  const dim3 grid(unsigned(p.column_blocks), unsigned(p.chunks));
  column_partials_kernel<kOuts>
      <<<grid, kColumnThreads, 0, stream>>>(rows, D, p.rows_per_chunk, op, partials);
  check_launch(what);
  for (int k = 0; k < kOuts; ++k) {
    reduce_partials_kernel<<<unsigned(p.column_blocks), kColumnThreads, 0, stream>>>(
        partials + k * D, kOuts * D, p.chunks, D, outs[k]);
    check_launch(what);
  }
}

void require_rows(int64_t rows, int64_t D, const char* what) {
  require(rows >= 0 && D >= 1, std::string(what) + ": sizes must be positive");
  require(rows < (int64_t(1) << 31), std::string(what) + ": too many rows");
}

}  // namespace

void rms_norm_forward_train(const float* x, int64_t rows, int64_t D, const float* w, float eps,
                            OutRows y, float* inv_rms, cudaStream_t stream) {
  require_rows(rows, D, "cuda::rms_norm_forward_train");
  check_out(y, D, "cuda::rms_norm_forward_train");
  if (rows == 0) return;
  require(x && w && y.data && inv_rms, "cuda::rms_norm_forward_train: null pointer");
  const int64_t ys = out_stride(y, D);
  const bool vec4 = D % 4 == 0 && ys % 4 == 0 && aligned_for(x, 4, 4) && aligned_for(w, 4, 4) &&
                    aligned_for(y.data, 4, element_bytes(y.type));
  dispatch_type(y.type, [&](auto* tag) {
    using OutT = Elem<decltype(tag)>;
    for_rows(rows, D, vec4, [&](auto team, auto vec, dim3 grid, dim3 block) {
      rms_norm_train_kernel<decltype(team)::value, decltype(vec)::value>
          <<<grid, block, 0, stream>>>(x, rows, D, w, eps, static_cast<OutT*>(y.data), ys, inv_rms);
    });
  });
  check_launch("cuda::rms_norm_forward_train");
}

void rms_norm_backward(const float* x, const float* dy, int64_t rows, int64_t D, const float* w,
                       const float* inv_rms, float* dx, float* dw, TrainScratch& scratch,
                       cudaStream_t stream, bool accumulate_dx) {
  require_rows(rows, D, "cuda::rms_norm_backward");
  if (rows == 0) return;
  require(x && dy && w && inv_rms && dx && dw, "cuda::rms_norm_backward: null pointer");
  require(!accumulate_dx || dx != dy,
          "cuda::rms_norm_backward: dx may not alias dy when accumulating");
  // dw reads dy: it runs first, so dx may overwrite dy.
  column_sums<1>(rows, D, RmsDwTerm{x, dy, inv_rms, D}, {dw}, scratch, stream,
                 "cuda::rms_norm_backward (dw)");
  const bool vec4 = D % 4 == 0 && aligned_for(x, 4, 4) && aligned_for(dy, 4, 4) &&
                    aligned_for(w, 4, 4) && aligned_for(dx, 4, 4);
  for_rows(rows, D, vec4, [&](auto team, auto vec, dim3 grid, dim3 block) {
    rms_norm_dx_kernel<decltype(team)::value, decltype(vec)::value>
        <<<grid, block, 0, stream>>>(x, dy, rows, D, w, inv_rms, dx, accumulate_dx);
  });
  check_launch("cuda::rms_norm_backward (dx)");
}

void layer_norm_backward(const float* x, const float* dy, int64_t rows, int64_t D, const float* w,
                         float eps, float* dx, float* dw, float* db, bool accumulate_dx,
                         TrainScratch& scratch, cudaStream_t stream) {
  require_rows(rows, D, "cuda::layer_norm_backward");
  if (rows == 0) return;
  require(x && dy && w && dx && dw && db, "cuda::layer_norm_backward: null pointer");
  require(!accumulate_dx || dx != dy,
          "cuda::layer_norm_backward: dx may not alias dy when accumulating");
  scratch.rows.reserve(size_t(2 * rows) * sizeof(float));
  float* mean = scratch.rows.as<float>();
  float* rstd = mean + rows;
  // The weight gradients read dy after the dx pass: when dx aliases dy, dx goes to scratch
  // first and is copied over dy last.
  const bool vec4 = D % 4 == 0 && aligned_for(x, 4, 4) && aligned_for(dy, 4, 4) &&
                    aligned_for(w, 4, 4) && aligned_for(dx, 4, 4);
  auto run_dx = [&](float* out, bool accumulate) {
    for_rows(rows, D, vec4, [&](auto team, auto vec, dim3 grid, dim3 block) {
      layer_norm_dx_kernel<decltype(team)::value, decltype(vec)::value>
          <<<grid, block, 0, stream>>>(x, dy, rows, D, w, eps, out, accumulate, mean, rstd);
    });
    check_launch("cuda::layer_norm_backward (dx)");
  };
  const bool aliased = dx == dy;
  if (aliased) {
    scratch.sort.reserve(size_t(rows * D) * sizeof(float));
    run_dx(scratch.sort.as<float>(), false);
  } else {
    run_dx(dx, accumulate_dx);
  }
  column_sums<2>(rows, D, LayerNormDwDbTerms{x, dy, mean, rstd, D}, {dw, db}, scratch, stream,
                 "cuda::layer_norm_backward (dw, db)");
  if (aliased) {
    check_cuda(cudaMemcpyAsync(dx, scratch.sort.data(), size_t(rows * D) * sizeof(float),
                               cudaMemcpyDeviceToDevice, stream),
               "cuda::layer_norm_backward (dx copy)");
  }
}

}  // namespace kda::ops::cuda
