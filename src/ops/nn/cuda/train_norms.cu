// Training norms on the GPU: RMSNorm forward (keeping inv_rms) and backward, LayerNorm backward.
// dx: a warp or a block per row (nn_common.cuh's row teams). The weight gradients are sums over
// rows, done without atomics so they are the same bits every run: the rows are cut into fixed
// chunks, each chunk's column sums (in a fixed order) go to partials [chunks, D], and a second
// kernel adds the chunks in a fixed order into dw. The RMSNorm backward of rows up to 1024 wide
// (4-aligned) does dx and its chunk's dw partials in one pass over x and dy (a block per chunk,
// a warp per row, the row held in registers), the memory-bound floor: x and dy read once, dx
// written (and read when accumulated), its optional bf16 copy written.
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
                                   const float* w, const float* inv_rms, float* dx, bool accumulate,
                                   __nv_bfloat16* dx_bf16) {
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
    if (dx_bf16) store_vec<V>(dx_bf16 + row * D + i, o);
  }
}

// ---- the fused RMSNorm backward: dx and the dw partials in one pass ----

constexpr int kFusedWarps = 8;  // rows in flight per block (a warp per row)

// Rows per chunk of the fused kernel: a multiple of kFusedWarps, ~256 chunks for many rows (one
// wave of blocks on an H100/H200); a function of rows only, so the dw order never changes.
int64_t fused_rows_per_chunk(int64_t rows) {
  return std::max<int64_t>(kFusedWarps, ceil_div(ceil_div(rows, 256), kFusedWarps) * kFusedWarps);
}

// Block b: rows [b * rows_per_chunk, +rows_per_chunk); warp w takes rows w, w + kFusedWarps, ...
// of the chunk. Lane l holds columns 4 (32 k + l) .. +3 for k < NV (D <= 128 NV, D % 4 == 0) of
// its row in registers: the dot product (summed in the generic kernel's order), then dx (and
// its bf16 copy) is written and dy x inv_rms is added to the lane's column sums.
// The block's warps then add their column sums in warp order into partials[b, :]. The old dx of
// an accumulated row is loaded with x and dy where the registers allow it (NV <= 6; 128 a
// thread, two blocks an SM), else just before it is needed.
template <int NV>
__global__ void __launch_bounds__(kFusedWarps * 32, 2)
    rms_norm_backward_fused_kernel(const float* x, const float* dy, int64_t rows, int64_t D,
                                   const float* w, const float* inv_rms, float* dx, bool accumulate,
                                   __nv_bfloat16* dx_bf16, int64_t rows_per_chunk,
                                   float* partials) {
  __shared__ float4 warp_sums[kFusedWarps][NV * 32];
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int64_t first = int64_t(blockIdx.x) * rows_per_chunk;
  const int64_t end = std::min(rows, first + rows_per_chunk);
  constexpr bool kOldEarly = NV <= 6;
  Vec<4> acc[NV];
#pragma unroll
  for (int k = 0; k < NV; ++k) acc[k] = Vec<4>{{0.0f, 0.0f, 0.0f, 0.0f}};
  for (int64_t row = first + warp; row < end; row += kFusedWarps) {
    const float* xr = x + row * D;
    const float* dyr = dy + row * D;
    float* dxr = dx + row * D;
    Vec<4> a[NV], d[NV], old[NV];
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int64_t col = int64_t(k * 32 + lane) * 4;
      if (col < D) {
        a[k] = load_vec<4>(xr + col);
        d[k] = load_vec<4>(dyr + col);
        if (kOldEarly && accumulate) old[k] = load_vec<4>(dxr + col);
      }
    }
    const float inv = inv_rms[row];
    float dot = 0.0f;  // sum_i dy_i w_i x_i
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int64_t col = int64_t(k * 32 + lane) * 4;
      if (col < D) {
        const Vec<4> g = load_vec<4>(w + col);
#pragma unroll
        for (int i = 0; i < 4; ++i) dot += d[k].v[i] * g.v[i] * a[k].v[i];
      }
    }
    dot = warp_sum(dot);
    const float c = dot / float(D) * inv * inv * inv;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int64_t col = int64_t(k * 32 + lane) * 4;
      if (col < D) {
        const Vec<4> g = load_vec<4>(w + col);
        if (!kOldEarly && accumulate) old[k] = load_vec<4>(dxr + col);
        Vec<4> o;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          o.v[i] = d[k].v[i] * g.v[i] * inv - a[k].v[i] * c;
          if (accumulate) o.v[i] += old[k].v[i];  // the residual stream's add, fused
          acc[k].v[i] += d[k].v[i] * a[k].v[i] * inv;
        }
        store_vec<4>(dxr + col, o);
        if (dx_bf16) store_vec<4>(dx_bf16 + row * D + col, o);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < NV; ++k)
    warp_sums[warp][k * 32 + lane] =
        make_float4(acc[k].v[0], acc[k].v[1], acc[k].v[2], acc[k].v[3]);
  __syncthreads();
  float* out = partials + int64_t(blockIdx.x) * D;
  for (int64_t j = threadIdx.x; j * 4 < D; j += blockDim.x) {
    float4 s = warp_sums[0][j];
#pragma unroll
    for (int v = 1; v < kFusedWarps; ++v) {
      const float4 t = warp_sums[v][j];
      s.x += t.x, s.y += t.y, s.z += t.z, s.w += t.w;
    }
    *reinterpret_cast<float4*>(out + j * 4) = s;
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

// Calls fn(Int<NV>{}) with NV = nv for nv in 1..8 (the fused kernel's float4s per lane).
template <int NV = 1, class Fn>
void with_vectors_per_lane(int64_t nv, Fn&& fn) {
  if constexpr (NV < 8) {
    if (nv > NV) return with_vectors_per_lane<NV + 1>(nv, fn);
  }
  fn(Int<NV>{});
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

// out[col] += sum over chunks of partials[chunk * stride + col], in a fixed order: a block per
// 32 columns (a lane per column), warp w sums chunks w, w + kReduceWarps, ... in order, then the
// warps' sums are added in warp order. (Many warps per column keep enough loads in flight.)
constexpr int kReduceWarps = 16;

__global__ void __launch_bounds__(kReduceWarps * 32)
    reduce_partials_kernel(const float* partials, int64_t stride, int64_t chunks, int64_t D,
                           float* out) {
  __shared__ float sums[kReduceWarps][32];
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  const int64_t col = int64_t(blockIdx.x) * 32 + lane;
  float s = 0.0f;
  if (col < D) {
#pragma unroll 4
    for (int64_t c = warp; c < chunks; c += kReduceWarps) s += partials[c * stride + col];
  }
  sums[warp][lane] = s;
  __syncthreads();
  if (warp == 0 && col < D) {
    float total = sums[0][lane];
#pragma unroll
    for (int v = 1; v < kReduceWarps; ++v) total += sums[v][lane];
    out[col] += total;
  }
}

// Adds the chunks of partials (chunk stride `stride`) into out[D].
void reduce_partials(const float* partials, int64_t stride, int64_t chunks, int64_t D, float* out,
                     cudaStream_t stream, const char* what) {
  reduce_partials_kernel<<<unsigned(ceil_div(D, 32)), kReduceWarps * 32, 0, stream>>>(
      partials, stride, chunks, D, out);
  check_launch(what);
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
  for (int k = 0; k < kOuts; ++k)
    reduce_partials(partials + k * D, kOuts * D, p.chunks, D, outs[k], stream, what);
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
                       cudaStream_t stream, bool accumulate_dx, void* dx_bf16) {
  require_rows(rows, D, "cuda::rms_norm_backward");
  if (rows == 0) return;
  require(x && dy && w && inv_rms && dx && dw, "cuda::rms_norm_backward: null pointer");
  require(!accumulate_dx || dx != dy,
          "cuda::rms_norm_backward: dx may not alias dy when accumulating");
  auto* copy = static_cast<__nv_bfloat16*>(dx_bf16);
  const bool vec4 = D % 4 == 0 && aligned_for(x, 4, 4) && aligned_for(dy, 4, 4) &&
                    aligned_for(w, 4, 4) && aligned_for(dx, 4, 4) && aligned_for(copy, 4, 2);
  if (vec4 && D <= 1024) {
    // one pass: each row is read into registers before its dx overwrites it (dx may alias dy)
    const int64_t rows_per_chunk = fused_rows_per_chunk(rows);
    const int64_t chunks = ceil_div(rows, rows_per_chunk);
    scratch.partials.reserve(size_t(chunks * D) * sizeof(float));
    float* partials = scratch.partials.as<float>();
    const auto launch = [&](auto nv) {  // nv: float4s per lane
      rms_norm_backward_fused_kernel<decltype(nv)::value>
          <<<unsigned(chunks), kFusedWarps * 32, 0, stream>>>(
              x, dy, rows, D, w, inv_rms, dx, accumulate_dx, copy, rows_per_chunk, partials);
    };
    with_vectors_per_lane(ceil_div(D, 128), launch);
    check_launch("cuda::rms_norm_backward (dx, dw partials)");
    reduce_partials(partials, D, chunks, D, dw, stream, "cuda::rms_norm_backward (dw)");
    return;
  }
  // dw reads dy: it runs first, so dx may overwrite dy.
  column_sums<1>(rows, D, RmsDwTerm{x, dy, inv_rms, D}, {dw}, scratch, stream,
                 "cuda::rms_norm_backward (dw)");
  for_rows(rows, D, vec4, [&](auto team, auto vec, dim3 grid, dim3 block) {
    rms_norm_dx_kernel<decltype(team)::value, decltype(vec)::value>
        <<<grid, block, 0, stream>>>(x, dy, rows, D, w, inv_rms, dx, accumulate_dx, copy);
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
