// The lineage mixers' small training kernels (train_mixer_cuda.h). Elementwise work is a
// grid-stride loop over elements (channels or pairs fastest, so warps read consecutive
// addresses); the L2 norm uses the row teams of nn_common.cuh. The weight gradients (dweight,
// dA_log, ddt_bias) are column sums over rows done without atomics: the rows are cut into fixed
// chunks (a function of the sizes only), a thread per column sums its chunk in row order in fp64
// into partials [chunks, columns, K], and a second kernel adds the chunks in a fixed order. The
// short convolution's backward does its whole chunk (dx, the dweight partials) in one kernel.
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "ops/nn/cuda/nn_common.cuh"
#include "ops/nn/cuda/train_mixer_cuda.h"

namespace kda::ops::cuda {
namespace {

using namespace nn_detail;

template <class T>
using Elem = std::remove_pointer_t<T>;

constexpr int kThreads = 256;
constexpr int kMaxConvWidth = 4;
constexpr float kL2NormEps = 1e-6f;  // torch.nn.functional.normalize's default, as the CPU

__device__ __forceinline__ float load_one(const float* p) {
  return *p;
}
__device__ __forceinline__ float load_one(const __nv_bfloat16* p) {
  return __bfloat162float(*p);
}
__device__ __forceinline__ void store_one(float* p, float v) {
  *p = v;
}
__device__ __forceinline__ void store_one(__nv_bfloat16* p, float v) {
  *p = __float2bfloat16_rn(v);
}

// torch's softplus (beta 1, threshold 20), as ops::detail::softplus in fp32
__device__ __forceinline__ float softplus_f(float x) {
  return x > 20.0f ? x : log1pf(expf(x));
}

// ---- fixed-order column sums over rows ----

// Where the K sums of a column go: interleaved (out[0][col * K + k], dweight's [C, W]) or one
// array per term (out[k][col]).
struct ColumnOuts {
  float* out[kMaxConvWidth] = {};
  bool interleaved = false;
};

struct ChunkPlan {
  int64_t chunks = 1, rows_per_chunk = 1, column_blocks = 1;
  int threads = kThreads;
};

// ~1024 blocks in all, chunks of at least 16 rows; a function of (rows, cols) only, so the
// summation order never changes between runs.
ChunkPlan chunk_plan(int64_t rows, int64_t cols) {
  ChunkPlan p;
  p.threads = int(std::min<int64_t>(kThreads, ceil_div(cols, 32) * 32));
  p.column_blocks = ceil_div(cols, p.threads);
  const int64_t want = std::clamp<int64_t>(ceil_div(1024, p.column_blocks), 1, 4096);
  p.rows_per_chunk = std::max<int64_t>(16, ceil_div(rows, want));
  p.chunks = ceil_div(rows, p.rows_per_chunk);
  return p;
}

// partials[chunk, col, k] = sum over the chunk's rows (in order) of term k of op(row, col, acc).
template <int K, class Op>
__global__ void chunk_partials_kernel(int64_t rows, int64_t cols, int64_t rows_per_chunk, Op op,
                                      double* partials) {
  const int64_t col = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= cols) return;
  const int64_t chunk = blockIdx.y;
  const int64_t first = chunk * rows_per_chunk;
  const int64_t end = first + rows_per_chunk < rows ? first + rows_per_chunk : rows;
  double acc[K];
#pragma unroll
  for (int k = 0; k < K; ++k) acc[k] = 0.0;
  for (int64_t r = first; r < end; ++r) op(r, col, acc);
  double* out = partials + (chunk * cols + col) * K;
#pragma unroll
  for (int k = 0; k < K; ++k) out[k] = acc[k];
}

// outs (col, k) += sum over chunks of partials[chunk, col, k]: a block per 32 consecutive (col, k)
// entries (coalesced reads), its kReduceGroups rows of threads each summing every kReduceGroups-th
// chunk in order, then the groups added in order (a fixed order: deterministic). Many blocks and
// short serial loops, so the sum is not a few threads walking hundreds of chunks.
constexpr int kReduceGroups = 8;

template <int K>
__global__ void chunk_reduce_kernel(const double* partials, int64_t chunks, int64_t cols,
                                    ColumnOuts outs) {
  __shared__ double group_sums[kReduceGroups][32];
  const int64_t n = cols * K;
  const int64_t i = int64_t(blockIdx.x) * 32 + threadIdx.x;
  double s = 0.0;
  if (i < n)
    for (int64_t c = threadIdx.y; c < chunks; c += kReduceGroups) s += partials[c * n + i];
  group_sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || i >= n) return;
  double total = 0.0;
#pragma unroll
  for (int g = 0; g < kReduceGroups; ++g) total += group_sums[g][threadIdx.x];
  const int64_t col = i / K, k = i - col * K;
  float* o = outs.interleaved ? outs.out[0] + i : outs.out[k] + col;
  *o = float(double(*o) + total);
}

template <int K>
void reduce_chunks(const double* partials, const ChunkPlan& p, int64_t cols, const ColumnOuts& outs,
                   cudaStream_t stream, const char* what) {
  chunk_reduce_kernel<K><<<unsigned(ceil_div(cols * K, 32)), dim3(32, kReduceGroups), 0, stream>>>(
      partials, p.chunks, cols, outs);
  check_launch(what);
}

template <int K, class Op>
void column_sums(int64_t rows, int64_t cols, const Op& op, const ColumnOuts& outs, double* partials,
                 const ChunkPlan& p, cudaStream_t stream, const char* what) {
  const dim3 grid(unsigned(p.column_blocks), unsigned(p.chunks));
  chunk_partials_kernel<K>
      <<<grid, p.threads, 0, stream>>>(rows, cols, p.rows_per_chunk, op, partials);
  check_launch(what);
  reduce_chunks<K>(partials, p, cols, outs, stream, what);
}

// Reserves the partials of a column sum (before any kernel is queued: growing reallocates).
double* reserve_partials(TrainScratch& scratch, const ChunkPlan& p, int64_t cols, int K,
                         const char* what) {
  require(p.chunks < 65536 && p.column_blocks < (int64_t(1) << 31),
          std::string(what) + ": too many rows or columns");
  scratch.partials.reserve(size_t(p.chunks * cols * K) * sizeof(double));
  return scratch.partials.as<double>();
}

// ---- short convolution over packed sequences ----

// A row's position within its sequence capped at the row index t, so that no window reaches
// before row 0 (positions never exceed t; the cap only matters for malformed ones).
template <int W>
__device__ __forceinline__ int32_t conv_position(int32_t position, int64_t t) {
  return t < W - 1 ? min(position, int32_t(t)) : position;
}

// The pre-activation of a row from the window xw (rows t - P .. t, P = W - 1) and its capped
// position (conv_position): a = sum_j w[j] xw[j] with inputs before the sequence's start
// (P - j > position) as 0, in the CPU's order without contraction.
template <int W>
__device__ __forceinline__ float conv_preactivation(const float (&w)[W], const float (&xw)[W],
                                                    int32_t position) {
  float a = 0.0f;
#pragma unroll
  for (int j = 0; j < W; ++j) {
    const float v = W - 1 - j <= position ? xw[j] : 0.0f;
    a = __fadd_rn(a, __fmul_rn(w[j], v));
  }
  return a;
}

// One (row chunk, column) a thread, walking the chunk's rows in order with the last W inputs in
// registers: each input is read once (coalesced across the warp's columns), kAhead rows at a
// time so each thread keeps several loads in flight.
template <int W, class OutT>
__global__ void __launch_bounds__(kThreads)
    conv_train_forward_kernel(const float* x, const int32_t* positions, int64_t rows, int64_t C,
                              int64_t xs, const float* weight, OutT* y, int64_t ys,
                              int64_t rows_per_chunk) {
  constexpr int P = W - 1;
  constexpr int kAhead = 8;
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t first = int64_t(blockIdx.y) * rows_per_chunk;
  const int64_t end = first + rows_per_chunk < rows ? first + rows_per_chunk : rows;
  float w[W];
#pragma unroll
  for (int j = 0; j < W; ++j) w[j] = weight[c * W + j];
  // xw[j] holds row t - P + j (0 before row 0); index P is filled with row t each step
  float xw[W];
#pragma unroll
  for (int j = 0; j < W; ++j) {
    const int64_t r = first - W + j;
    xw[j] = j > 0 && r >= 0 ? x[r * xs + c] : 0.0f;
  }
  for (int64_t t0 = first; t0 < end; t0 += kAhead) {
    float xa[kAhead];
    int32_t pa[kAhead];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const int64_t t = t0 + u;
      xa[u] = t < end ? x[t * xs + c] : 0.0f;
      pa[u] = t < end ? positions[t] : 0;
    }
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const int64_t t = t0 + u;
      if (t >= end) break;
#pragma unroll
      for (int j = 0; j < P; ++j) xw[j] = xw[j + 1];
      xw[P] = xa[u];
      const float a = conv_preactivation<W>(w, xw, conv_position<W>(pa[u], t));
      store_one(y + t * ys + c, a / (1.0f + expf(-a)));
    }
  }
}

// The whole backward of one (row chunk, column) in one thread, walking the chunk's rows in order
// with the last W inputs, pre-activation gradients and positions in registers: da[t, c] = dy[t, c]
// silu'(a[t, c]) (the CPU's s (1 + a (1 - s))) for t in [first, end + P); dx[s, c] = sum_j w[c, j]
// da[s + P - j, c] over the outputs t = s + P - j that see input s (t < rows, positions[t] >= P -
// j; j in the CPU's order), written as soon as da[s + P] is known; and the chunk's dweight terms
// da[t, c] x[t - P + j, c] (inputs in t's sequence) summed in row order (fp32 within the chunk,
// then fp64 across chunks) into partials [chunk, c, W]. The chunk re-reads the P rows before it
// and the P after it; da never goes to memory. Rows are loaded kAhead at a time so each thread
// keeps several loads in flight; row indices inside the chunk are 32-bit and the row pointers
// advance by their strides (ncu: the 64-bit index arithmetic and fp64 terms made the kernel
// issue-bound at 0.78 TB/s).
template <int W, class DyT, class OutT>
__global__ void __launch_bounds__(kThreads, 3)
    conv_train_backward_kernel(const float* x, const int32_t* positions, int64_t rows, int64_t C,
                               int64_t xs, const float* weight, const DyT* dy, OutT* dx,
                               int64_t dxs, int64_t rows_per_chunk, double* partials) {
  constexpr int P = W - 1;
  constexpr int kAhead = 8;
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  const int64_t chunk = blockIdx.y;
  const int64_t first = chunk * rows_per_chunk;
  const int64_t end = first + rows_per_chunk < rows ? first + rows_per_chunk : rows;
  // chunk-relative counts: rows [first, first + n_out) get dweight terms, [first, first + n_in)
  // exist, [first, first + n) are walked (the P past `end` complete the last rows' dx)
  const int n_out = int(end - first);
  const int n = n_out + P;
  const int n_in = int(min(rows, end + P) - first);
  float w[W];
#pragma unroll
  for (int j = 0; j < W; ++j) w[j] = weight[c * W + j];
  // windows over rows t - P .. t (index j holds row t - P + j; before the first step t = first -
  // 1, index 0 is shifted out unread): inputs (0 before row 0), pre-activation gradients (0 past
  // the last row) and positions (-1 past the last row: no output there sees any input), the
  // positions capped at t so that no window reaches before row 0. Rows before `first` only ever
  // feed the chunk's first pre-activations through xw.
  float xw[W], daw[W];
  int32_t pw[W];
#pragma unroll
  for (int j = 0; j < W; ++j) {
    const int64_t r = first - W + j;
    xw[j] = j > 0 && r >= 0 ? x[r * xs + c] : 0.0f;
    daw[j] = 0.0f;
    pw[j] = -1;
  }
  float acc[W];
#pragma unroll
  for (int j = 0; j < W; ++j) acc[j] = 0.0f;
  const float* xp = x + first * xs + c;
  const DyT* dyp = dy + first * C + c;
  const int32_t* pp = positions + first;
  OutT* dxp = dx + (first - P) * dxs + c;  // row s = t - P
  for (int i0 = 0; i0 < n; i0 += kAhead) {
    float xa[kAhead], dya[kAhead];
    int32_t pa[kAhead];
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const bool in = i0 + u < n_in;
      xa[u] = in ? *xp : 0.0f;
      dya[u] = in ? load_one(dyp) : 0.0f;
      pa[u] = in ? *pp : -1;
      xp += xs;
      dyp += C;
      ++pp;
    }
#pragma unroll
    for (int u = 0; u < kAhead; ++u) {
      const int i = i0 + u;
      if (i >= n) break;
#pragma unroll
      for (int j = 0; j < P; ++j) {
        xw[j] = xw[j + 1];
        daw[j] = daw[j + 1];
        pw[j] = pw[j + 1];
      }
      xw[P] = xa[u];
      const int32_t position = conv_position<W>(pa[u], first + i);
      pw[P] = position;
      float da = 0.0f;
      if (i < n_in) {
        const float a = conv_preactivation<W>(w, xw, position);
        const float s = 1.0f / (1.0f + expf(-a));
        da = dya[u] * s * (1.0f + a * (1.0f - s));
        if (i < n_out) {
#pragma unroll
          for (int j = 0; j < W; ++j)
            if (P - j <= position) acc[j] = fmaf(da, xw[j], acc[j]);
        }
      }
      daw[P] = da;
      // input row s = t - P now has all its outputs s .. s + P
      if (i >= P) {
        float g = 0.0f;
#pragma unroll
        for (int j = 0; j < W; ++j) {
          const int ahead = P - j;  // output s + ahead sits at window index ahead
          if (pw[ahead] >= ahead) g = __fadd_rn(g, __fmul_rn(w[j], daw[ahead]));
        }
        store_one(dxp, g);
      }
      dxp += dxs;
    }
  }
  double* out = partials + (chunk * C + c) * W;
#pragma unroll
  for (int j = 0; j < W; ++j) out[j] = double(acc[j]);
}

template <class Fn>
void with_width(int64_t W, Fn&& fn) {
  switch (W) {
    case 1:
      fn(Int<1>{});
      break;
    case 2:
      fn(Int<2>{});
      break;
    case 3:
      fn(Int<3>{});
      break;
    default:
      fn(Int<4>{});
      break;
  }
}

void check_conv_sizes(int64_t rows, int64_t C, int64_t W, int64_t xs, const char* what) {
  require(rows >= 0 && C >= 1, std::string(what) + ": sizes must be positive (rows " +
                                   std::to_string(rows) + ", C " + std::to_string(C) + ")");
  require(W >= 1 && W <= kMaxConvWidth, std::string(what) + ": kernel width W must be in [1, " +
                                            std::to_string(kMaxConvWidth) + "], got " +
                                            std::to_string(W));
  require(xs >= C, std::string(what) + ": x_stride smaller than C");
}

// ---- rotary ----

template <class T>
__global__ void rotary_kernel(T* x, const int32_t* positions, int64_t rows, int64_t H, int64_t D,
                              int64_t xs, float sign) {
  const int64_t half = D / 2;
  const int64_t n = rows * half;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const int64_t r = i / half, k = i - r * half;
    // The CPU's expression in fp64, rounded to fp32 after cos/sin.
    const double angle = double(positions[r]) * pow(10000.0, -2.0 * double(k) / double(D));
    double sin_d, cos_d;
    sincos(angle, &sin_d, &cos_d);
    const float c = float(cos_d), s = sign * float(sin_d);
    T* row = x + r * xs;
    for (int64_t h = 0; h < H; ++h) {
      T* head = row + h * D;
      const float x0 = load_one(head + k), x1 = load_one(head + k + half);
      store_one(head + k, __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)));
      store_one(head + k + half, __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c)));
    }
  }
}

// The same rotation, a thread per row and run of 8 pairs (k0 .. k0 + 7): 16-byte loads and
// stores (the scalar kernel was bound by its 2-byte memory instructions; 8-byte ones left half
// of each 16 bytes to a second instruction), the 8 angles computed once for all H heads. Needs
// D / 2 % 8 == 0 and 16-byte alignment of x and x_stride.
template <class T>
__global__ void rotary_vec_kernel(T* x, const int32_t* positions, int64_t rows, int64_t H,
                                  int64_t D, int64_t xs, float sign) {
  constexpr int kPairs = 8;
  constexpr int kChunk = sizeof(T) == 2 ? 8 : 4;  // elements of one 16-byte access
  const int64_t half = D / 2, runs = half / kPairs;
  const int64_t n = rows * runs;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const int64_t r = i / runs, k0 = (i - r * runs) * kPairs;
    float c[kPairs], s[kPairs];
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {  // the scalar kernel's expression
      const double angle = double(positions[r]) * pow(10000.0, -2.0 * double(k0 + j) / double(D));
      double sin_d, cos_d;
      sincos(angle, &sin_d, &cos_d);
      c[j] = float(cos_d);
      s[j] = sign * float(sin_d);
    }
    T* row = x + r * xs;
    for (int64_t h = 0; h < H; ++h) {
      T* head = row + h * D + k0;
#pragma unroll
      for (int q = 0; q < kPairs / kChunk; ++q) {
        const Vec<kChunk> a = load_vec<kChunk>(head + kChunk * q);
        const Vec<kChunk> b = load_vec<kChunk>(head + half + kChunk * q);
        Vec<kChunk> oa, ob;
#pragma unroll
        for (int e = 0; e < kChunk; ++e) {
          const float ce = c[kChunk * q + e], se = s[kChunk * q + e];
          oa.v[e] = __fsub_rn(__fmul_rn(a.v[e], ce), __fmul_rn(b.v[e], se));
          ob.v[e] = __fadd_rn(__fmul_rn(a.v[e], se), __fmul_rn(b.v[e], ce));
        }
        store_vec<kChunk>(head + kChunk * q, oa);
        store_vec<kChunk>(head + half + kChunk * q, ob);
      }
    }
  }
}

// ---- L2 row norm ----

template <int kTeam, int V, class OutT>
__global__ void l2norm_forward_kernel(const float* x, int64_t rows, int64_t D, OutT* y,
                                      int64_t ys) {
  __shared__ float scratch[32];
  int64_t row;
  int lane;
  team_position<kTeam>(row, lane);
  if (row >= rows) return;
  const float* xr = x + row * D;
  float n2 = 0.0f;
  for (int64_t i = int64_t(lane) * V; i < D; i += int64_t(kTeam) * V) {
    const Vec<V> a = load_vec<V>(xr + i);
#pragma unroll
    for (int k = 0; k < V; ++k) n2 += a.v[k] * a.v[k];
  }
  n2 = team_sum<kTeam>(n2, scratch);
  const float inv = 1.0f / fmaxf(sqrtf(n2), kL2NormEps);
  OutT* yr = y + row * ys;
  for (int64_t i = int64_t(lane) * V; i < D; i += int64_t(kTeam) * V) {
    Vec<V> a = load_vec<V>(xr + i);
#pragma unroll
    for (int k = 0; k < V; ++k) a.v[k] *= inv;
    store_vec<V>(yr + i, a);
  }
}

// (dy - x (x . dy) / |x|^2) / |x| above eps, dy / eps at or below, as the CPU.
template <int kTeam, int V, class DyT>
__global__ void l2norm_backward_kernel(const float* x, const DyT* dy, int64_t rows, int64_t D,
                                       float* dx) {
  __shared__ float scratch[32];
  int64_t row;
  int lane;
  team_position<kTeam>(row, lane);
  if (row >= rows) return;
  const float* xr = x + row * D;
  const DyT* dyr = dy + row * D;
  float n2 = 0.0f, dot = 0.0f;
  for (int64_t i = int64_t(lane) * V; i < D; i += int64_t(kTeam) * V) {
    const Vec<V> a = load_vec<V>(xr + i);
    const Vec<V> g = load_vec<V>(dyr + i);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      n2 += a.v[k] * a.v[k];
      dot += a.v[k] * g.v[k];
    }
  }
  n2 = team_sum<kTeam>(n2, scratch);
  dot = team_sum<kTeam>(dot, scratch);
  const float norm = sqrtf(n2);
  const bool tiny = norm <= kL2NormEps;
  const float inv = tiny ? 0.0f : 1.0f / norm;
  float* dxr = dx + row * D;
  for (int64_t i = int64_t(lane) * V; i < D; i += int64_t(kTeam) * V) {
    const Vec<V> a = load_vec<V>(xr + i);
    Vec<V> g = load_vec<V>(dyr + i);
#pragma unroll
    for (int k = 0; k < V; ++k)
      g.v[k] = tiny ? g.v[k] / kL2NormEps : (g.v[k] - a.v[k] * inv * inv * dot) * inv;
    store_vec<V>(dxr + i, g);
  }
}

// ---- sigmoid and the scalar gate ----

template <class OutT>
__global__ void sigmoid_forward_kernel(const float* braw, int64_t n, OutT* beta) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step)
    store_one(beta + i, sigmoid_f(braw[i]));
}

template <class DT>
__global__ void sigmoid_backward_kernel(const float* braw, const DT* dbeta, int64_t n,
                                        float* dbraw) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const float b = sigmoid_f(braw[i]);
    dbraw[i] = load_one(dbeta + i) * b * (1.0f - b);
  }
}

template <class OutT>
__global__ void scalar_gate_forward_kernel(const float* graw, const float* A_log,
                                           const float* dt_bias, int64_t rows, int64_t H, OutT* g) {
  const int64_t n = rows * H;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const int64_t h = i % H;
    store_one(g + i, -expf(A_log[h]) * softplus_f(graw[i] + dt_bias[h]));
  }
}

template <class DT>
__global__ void scalar_gate_dgraw_kernel(const float* graw, const float* A_log,
                                         const float* dt_bias, const DT* dg, int64_t rows,
                                         int64_t H, float* dgraw) {
  const int64_t n = rows * H;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const int64_t h = i % H;
    dgraw[i] = -expf(A_log[h]) * sigmoid_f(graw[i] + dt_bias[h]) * load_one(dg + i);
  }
}

// Row r's terms of (dA_log[h], ddt_bias[h]): g dg and dgraw, recomputed as the kernels above.
template <class DT>
struct ScalarGateTerms {
  const float *graw, *A_log, *dt_bias;
  const DT* dg;
  int64_t H;
  __device__ void operator()(int64_t r, int64_t h, double* acc) const {
    const int64_t i = r * H + h;
    const float a = expf(A_log[h]);
    const float xg = graw[i] + dt_bias[h];
    const float d = load_one(dg + i);
    const float g = -a * softplus_f(xg);
    const float dgraw = -a * sigmoid_f(xg) * d;
    acc[0] += double(g) * double(d);
    acc[1] += double(dgraw);
  }
};

void require_type(ElementType t, const char* what) {
  require(t == ElementType::f32 || t == ElementType::bf16,
          std::string(what) + ": element type must be f32 or bf16");
}

}  // namespace

void short_conv_silu_train_forward(const float* x, const int32_t* positions, int64_t rows,
                                   int64_t C, int64_t x_stride, const float* weight, int64_t W,
                                   OutRows y, cudaStream_t stream) {
  const char* what = "cuda::short_conv_silu_train_forward";
  const int64_t xs = x_stride > 0 ? x_stride : C;
  check_conv_sizes(rows, C, W, xs, what);
  check_out(y, C, what);
  require_type(y.type, what);
  if (rows == 0) return;
  require(x && positions && weight && y.data, std::string(what) + ": null pointer");
  require(y.data != static_cast<const void*>(x),
          std::string(what) + ": y must not overlap x (outputs read earlier rows of x)");
  const int64_t ys = out_stride(y, C);
  const ChunkPlan plan = chunk_plan(rows, C);
  const dim3 grid(unsigned(plan.column_blocks), unsigned(plan.chunks));
  dispatch_type(y.type, [&](auto* tag) {
    using OutT = Elem<decltype(tag)>;
    with_width(W, [&](auto width) {
      conv_train_forward_kernel<decltype(width)::value, OutT><<<grid, plan.threads, 0, stream>>>(
          x, positions, rows, C, xs, weight, static_cast<OutT*>(y.data), ys, plan.rows_per_chunk);
    });
  });
  check_launch(what);
}

void short_conv_silu_train_backward(const float* x, const int32_t* positions, int64_t rows,
                                    int64_t C, int64_t x_stride, const float* weight, int64_t W,
                                    const void* dy, ElementType dy_type, OutRows dx, float* dweight,
                                    TrainScratch& scratch, cudaStream_t stream) {
  const char* what = "cuda::short_conv_silu_train_backward";
  const int64_t xs = x_stride > 0 ? x_stride : C;
  check_conv_sizes(rows, C, W, xs, what);
  require_type(dy_type, what);
  check_out(dx, C, what);
  require_type(dx.type, what);
  if (rows == 0) return;
  require(x && positions && weight && dy && dx.data && dweight,
          std::string(what) + ": null pointer");
  require(dx.data != dy, std::string(what) + ": dx may not alias dy");
  require(dx.data != static_cast<const void*>(x), std::string(what) + ": dx may not alias x");
  // (reserved before anything is queued: growing reallocates)
  const ChunkPlan plan = chunk_plan(rows, C);
  double* partials = reserve_partials(scratch, plan, C, int(W), what);
  const int64_t dxs = out_stride(dx, C);
  const dim3 grid(unsigned(plan.column_blocks), unsigned(plan.chunks));
  dispatch_type(dy_type, [&](auto* dy_tag) {
    using DyT = Elem<decltype(dy_tag)>;
    dispatch_type(dx.type, [&](auto* dx_tag) {
      using OutT = Elem<decltype(dx_tag)>;
      with_width(W, [&](auto width) {
        conv_train_backward_kernel<decltype(width)::value, DyT, OutT>
            <<<grid, plan.threads, 0, stream>>>(
                x, positions, rows, C, xs, weight, static_cast<const DyT*>(dy),
                static_cast<OutT*>(dx.data), dxs, plan.rows_per_chunk, partials);
      });
    });
  });
  check_launch("cuda::short_conv_silu_train_backward (dx, dweight partials)");
  ColumnOuts outs;
  outs.out[0] = dweight;
  outs.interleaved = true;
  with_width(W, [&](auto width) {
    reduce_chunks<decltype(width)::value>(partials, plan, C, outs, stream,
                                          "cuda::short_conv_silu_train_backward (dweight)");
  });
}

void short_conv_silu_train_backward(const float* x, const int32_t* positions, int64_t rows,
                                    int64_t C, int64_t x_stride, const float* weight, int64_t W,
                                    const void* dy, ElementType dy_type, float* dx, float* dweight,
                                    TrainScratch& scratch, cudaStream_t stream) {
  short_conv_silu_train_backward(x, positions, rows, C, x_stride, weight, W, dy, dy_type,
                                 OutRows{dx, ElementType::f32, 0}, dweight, scratch, stream);
}

void rotary_embedding(void* x, ElementType type, const int32_t* positions, int64_t rows, int64_t H,
                      int64_t D, int64_t x_stride, int direction, cudaStream_t stream) {
  const char* what = "cuda::rotary_embedding";
  require(rows >= 0 && H >= 1 && D >= 2, std::string(what) + ": sizes must be positive (rows " +
                                             std::to_string(rows) + ", H " + std::to_string(H) +
                                             ", D " + std::to_string(D) + ")");
  require(D % 2 == 0, std::string(what) + ": head dim D must be even, got " + std::to_string(D));
  require(direction == 1 || direction == -1, std::string(what) + ": direction must be +1 or -1");
  require_type(type, what);
  const int64_t xs = x_stride > 0 ? x_stride : H * D;
  require(xs >= H * D, std::string(what) + ": x_stride smaller than H D");
  if (rows == 0) return;
  require(x && positions, std::string(what) + ": null pointer");
  dispatch_type(type, [&](auto* tag) {
    using T = Elem<decltype(tag)>;
    T* xt = static_cast<T*>(x);
    const int64_t chunk = 16 / int64_t(sizeof(T));
    if ((D / 2) % 8 == 0 && xs % chunk == 0 && aligned_for(xt, chunk, sizeof(T)))
      rotary_vec_kernel<T><<<grid_for(rows * (D / 16), kThreads), kThreads, 0, stream>>>(
          xt, positions, rows, H, D, xs, float(direction));
    else
      rotary_kernel<T><<<grid_for(rows * (D / 2), kThreads), kThreads, 0, stream>>>(
          xt, positions, rows, H, D, xs, float(direction));
  });
  check_launch(what);
}

void l2norm_rows_forward(const float* x, int64_t rows, int64_t D, OutRows y, cudaStream_t stream) {
  const char* what = "cuda::l2norm_rows_forward";
  require(rows >= 0 && D >= 1, std::string(what) + ": sizes must be positive");
  check_out(y, D, what);
  require_type(y.type, what);
  if (rows == 0) return;
  require(x && y.data, std::string(what) + ": null pointer");
  const int64_t ys = out_stride(y, D);
  const bool vec4 = D % 4 == 0 && ys % 4 == 0 && aligned_for(x, 4, 4) &&
                    aligned_for(y.data, 4, element_bytes(y.type));
  dispatch_type(y.type, [&](auto* tag) {
    using OutT = Elem<decltype(tag)>;
    for_rows(rows, D, vec4, [&](auto team, auto vec, dim3 grid, dim3 block) {
      l2norm_forward_kernel<decltype(team)::value, decltype(vec)::value>
          <<<grid, block, 0, stream>>>(x, rows, D, static_cast<OutT*>(y.data), ys);
    });
  });
  check_launch(what);
}

void l2norm_rows_backward(const float* x, const void* dy, ElementType dy_type, int64_t rows,
                          int64_t D, float* dx, cudaStream_t stream) {
  const char* what = "cuda::l2norm_rows_backward";
  require(rows >= 0 && D >= 1, std::string(what) + ": sizes must be positive");
  require_type(dy_type, what);
  if (rows == 0) return;
  require(x && dy && dx, std::string(what) + ": null pointer");
  require(dy_type == ElementType::f32 || static_cast<const void*>(dx) != dy,
          std::string(what) + ": dx may alias dy only when dy is fp32");
  const bool vec4 = D % 4 == 0 && aligned_for(x, 4, 4) &&
                    aligned_for(dy, 4, element_bytes(dy_type)) && aligned_for(dx, 4, 4);
  dispatch_type(dy_type, [&](auto* tag) {
    using DyT = Elem<decltype(tag)>;
    for_rows(rows, D, vec4, [&](auto team, auto vec, dim3 grid, dim3 block) {
      l2norm_backward_kernel<decltype(team)::value, decltype(vec)::value>
          <<<grid, block, 0, stream>>>(x, static_cast<const DyT*>(dy), rows, D, dx);
    });
  });
  check_launch(what);
}

void sigmoid_forward(const float* braw, int64_t n, void* beta, ElementType beta_type,
                     cudaStream_t stream) {
  const char* what = "cuda::sigmoid_forward";
  require(n >= 0, std::string(what) + ": n must not be negative");
  require_type(beta_type, what);
  if (n == 0) return;
  require(braw && beta, std::string(what) + ": null pointer");
  dispatch_type(beta_type, [&](auto* tag) {
    using OutT = Elem<decltype(tag)>;
    sigmoid_forward_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(
        braw, n, static_cast<OutT*>(beta));
  });
  check_launch(what);
}

void sigmoid_backward(const float* braw, const void* dbeta, ElementType dbeta_type, int64_t n,
                      float* dbraw, cudaStream_t stream) {
  const char* what = "cuda::sigmoid_backward";
  require(n >= 0, std::string(what) + ": n must not be negative");
  require_type(dbeta_type, what);
  if (n == 0) return;
  require(braw && dbeta && dbraw, std::string(what) + ": null pointer");
  require(dbeta_type == ElementType::f32 || static_cast<const void*>(dbraw) != dbeta,
          std::string(what) + ": dbraw may alias dbeta only when dbeta is fp32");
  dispatch_type(dbeta_type, [&](auto* tag) {
    using DT = Elem<decltype(tag)>;
    sigmoid_backward_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(
        braw, static_cast<const DT*>(dbeta), n, dbraw);
  });
  check_launch(what);
}

void scalar_gate_forward(const float* graw, const float* A_log, const float* dt_bias, int64_t rows,
                         int64_t H, void* g, ElementType g_type, cudaStream_t stream) {
  const char* what = "cuda::scalar_gate_forward";
  require(rows >= 0 && H >= 1, std::string(what) + ": sizes must be positive");
  require_type(g_type, what);
  if (rows == 0) return;
  require(graw && A_log && dt_bias && g, std::string(what) + ": null pointer");
  dispatch_type(g_type, [&](auto* tag) {
    using OutT = Elem<decltype(tag)>;
    scalar_gate_forward_kernel<<<grid_for(rows * H, kThreads), kThreads, 0, stream>>>(
        graw, A_log, dt_bias, rows, H, static_cast<OutT*>(g));
  });
  check_launch(what);
}

void scalar_gate_backward(const float* graw, const float* A_log, const float* dt_bias,
                          const void* dg, ElementType dg_type, int64_t rows, int64_t H,
                          float* dgraw, float* dA_log, float* ddt_bias, TrainScratch& scratch,
                          cudaStream_t stream) {
  const char* what = "cuda::scalar_gate_backward";
  require(rows >= 0 && H >= 1, std::string(what) + ": sizes must be positive");
  require_type(dg_type, what);
  if (rows == 0) return;
  require(graw && A_log && dt_bias && dg && dgraw && dA_log && ddt_bias,
          std::string(what) + ": null pointer");
  require(dg_type == ElementType::f32 || static_cast<const void*>(dgraw) != dg,
          std::string(what) + ": dgraw may alias dg only when dg is fp32");
  const ChunkPlan plan = chunk_plan(rows, H);
  double* partials = reserve_partials(scratch, plan, H, 2, what);
  dispatch_type(dg_type, [&](auto* tag) {
    using DT = Elem<decltype(tag)>;
    const DT* dgp = static_cast<const DT*>(dg);
    // The sums read graw and dg first, so dgraw may overwrite either afterwards.
    ColumnOuts outs;
    outs.out[0] = dA_log;
    outs.out[1] = ddt_bias;
    column_sums<2>(rows, H, ScalarGateTerms<DT>{graw, A_log, dt_bias, dgp, H}, outs, partials, plan,
                   stream, "cuda::scalar_gate_backward (dA_log, ddt_bias)");
    scalar_gate_dgraw_kernel<<<grid_for(rows * H, kThreads), kThreads, 0, stream>>>(
        graw, A_log, dt_bias, dgp, rows, H, dgraw);
    check_launch("cuda::scalar_gate_backward (dgraw)");
  });
}

void sequence_positions(std::span<const int64_t> cu_seqlens, int64_t B, int64_t T,
                        int32_t* positions, cudaStream_t stream) {
  const char* what = "cuda::sequence_positions";
  require(B >= 0 && T >= 0, std::string(what) + ": B and T must not be negative");
  const int64_t rows = B * T;
  require(rows < (int64_t(1) << 31), std::string(what) + ": too many tokens for int32 positions");
  std::vector<int32_t> host(static_cast<size_t>(rows));
  if (cu_seqlens.empty()) {
    for (int64_t r = 0; r < rows; ++r) host[r] = int32_t(r % T);
  } else {
    require(cu_seqlens.size() >= 2 && cu_seqlens.front() == 0 && cu_seqlens.back() == rows,
            std::string(what) +
                ": cu_seqlens must start at 0 and end at B T = " + std::to_string(rows));
    for (size_t n = 0; n + 1 < cu_seqlens.size(); ++n)
      require(cu_seqlens[n + 1] >= cu_seqlens[n],
              std::string(what) + ": cu_seqlens must not decrease");
    for (size_t n = 0; n + 1 < cu_seqlens.size(); ++n)
      for (int64_t r = cu_seqlens[n]; r < cu_seqlens[n + 1]; ++r)
        host[r] = int32_t(r - cu_seqlens[n]);
  }
  if (rows == 0) return;
  require(positions != nullptr, std::string(what) + ": null pointer");
  check_cuda(cudaMemcpyAsync(positions, host.data(), size_t(rows) * sizeof(int32_t),
                             cudaMemcpyHostToDevice, stream),
             "cuda::sequence_positions (copy)");
  // `host` dies on return: wait for the copy.
  check_cuda(cudaStreamSynchronize(stream), "cuda::sequence_positions (sync)");
}

}  // namespace kda::ops::cuda
