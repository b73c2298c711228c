// Shared by the small kernels of nn_cuda.h: vector loads/stores of 1 or 4 elements (fp32 or bf16
// storage, fp32 arithmetic), the output-type dispatch, warp/block sums, alignment tests and the
// launch check.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "core/error.h"
#include "ops/common/device_buffer.h"
#include "ops/nn/cuda/nn_cuda.h"

namespace kda::ops::cuda::nn_detail {

inline void check_launch(const char* what) {
  check_cuda(cudaGetLastError(), what);
}

inline int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Grid of a grid-stride loop over n work items with `threads` per block.
inline unsigned grid_for(int64_t n, int threads) {
  return unsigned(std::clamp<int64_t>(ceil_div(n, threads), 1, int64_t(1) << 20));
}

// True when p may be read V elements at a time (V elements of `bytes` each, aligned to that).
inline bool aligned_for(const void* p, int V, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % (size_t(V) * bytes) == 0;
}

inline int64_t out_stride(const OutRows& y, int64_t cols) {
  return y.stride > 0 ? y.stride : cols;
}

inline void check_out(const OutRows& y, int64_t cols, const char* what) {
  require(y.stride == 0 || y.stride >= cols,
          std::string(what) + ": output stride smaller than the row width");
}

// Calls fn with a null pointer of the element type of `type` (float or __nv_bfloat16).
template <class Fn>
void dispatch_type(ElementType type, Fn&& fn) {
  if (type == ElementType::bf16)
    fn(static_cast<__nv_bfloat16*>(nullptr));
  else
    fn(static_cast<float*>(nullptr));
}

// ---- V consecutive elements (V = 1 or 4, and 8 for bf16; V > 1 needs V-element alignment) ----
template <int V>
struct Vec {
  float v[V];
};

template <int V>
__device__ __forceinline__ Vec<V> load_vec(const float* p) {
  Vec<V> r;
  if constexpr (V == 4) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    r.v[0] = a.x, r.v[1] = a.y, r.v[2] = a.z, r.v[3] = a.w;
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) r.v[i] = p[i];
  }
  return r;
}

template <int V>
__device__ __forceinline__ Vec<V> load_vec(const __nv_bfloat16* p) {
  Vec<V> r;
  if constexpr (V == 8) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 a = __bfloat1622float2(h[i]);
      r.v[2 * i] = a.x, r.v[2 * i + 1] = a.y;
    }
  } else if constexpr (V == 4) {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
    const float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
    r.v[0] = a.x, r.v[1] = a.y, r.v[2] = b.x, r.v[3] = b.y;
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) r.v[i] = __bfloat162float(p[i]);
  }
  return r;
}

template <int V>
__device__ __forceinline__ void store_vec(float* p, const Vec<V>& x) {
  if constexpr (V == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(x.v[0], x.v[1], x.v[2], x.v[3]);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) p[i] = x.v[i];
  }
}

template <int V>
__device__ __forceinline__ void store_vec(__nv_bfloat16* p, const Vec<V>& x) {
  if constexpr (V == 8) {
    uint4 raw;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(x.v[2 * i], x.v[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = raw;
  } else if constexpr (V == 4) {
    uint2 raw;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
    h[0] = __floats2bfloat162_rn(x.v[0], x.v[1]);
    h[1] = __floats2bfloat162_rn(x.v[2], x.v[3]);
    *reinterpret_cast<uint2*>(p) = raw;
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) p[i] = __float2bfloat16_rn(x.v[i]);
  }
}

// V values of an optional fp32 vector (null: `fallback`).
template <int V>
__device__ __forceinline__ Vec<V> load_or(const float* p, float fallback) {
  if (p) return load_vec<V>(p);
  Vec<V> r;
#pragma unroll
  for (int i = 0; i < V; ++i) r.v[i] = fallback;
  return r;
}

__device__ __forceinline__ float sigmoid_f(float x) {
  return 1.0f / (1.0f + expf(-x));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the team that owns a row: one warp (kTeam = 32) or the whole block (kTeam threads, a
// multiple of 32). Every thread of the team gets the total. `scratch` is __shared__ float[32];
// the leading barrier lets a block call this several times in a row.
template <int kTeam>
__device__ __forceinline__ float team_sum(float v, float* scratch) {
  v = warp_sum(v);
  if constexpr (kTeam == 32) {
    return v;
  } else {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_sum(lane < kTeam / 32 ? scratch[lane] : 0.0f);
  }
}

}  // namespace kda::ops::cuda::nn_detail

namespace kda::ops::cuda::nn_detail {

template <int N>
using Int = std::integral_constant<int, N>;

constexpr int kWarpsPerRowBlock = 8;  // rows per block when a warp owns a row

// Where this thread works in a row-team kernel: the row, and its lane within the team.
template <int kTeam>
__device__ __forceinline__ void team_position(int64_t& row, int& lane) {
  if constexpr (kTeam == 32) {
    row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
    lane = threadIdx.x % 32;
  } else {
    row = blockIdx.x;
    lane = threadIdx.x;
  }
}

// Launches a row-team kernel: fn(Int<kTeam>, Int<V>, grid, block), with a warp per row for rows
// up to 1024 wide (8 rows a block) and a 256-thread block per row above; V = 4 when vec4.
template <class Fn>
void for_rows(int64_t rows, int64_t D, bool vec4, Fn&& fn) {
  require(rows < (int64_t(1) << 31), "row kernel: too many rows");
  auto with_team = [&](auto team) {
    constexpr int kTeam = decltype(team)::value;
    const dim3 block(kTeam == 32 ? 32 * kWarpsPerRowBlock : kTeam);
    const dim3 grid(unsigned(kTeam == 32 ? ceil_div(rows, kWarpsPerRowBlock) : rows));
    if (vec4)
      fn(team, Int<4>{}, grid, block);
    else
      fn(team, Int<1>{}, grid, block);
  };
  if (D <= 1024)
    with_team(Int<32>{});
  else
    with_team(Int<256>{});
}

}  // namespace kda::ops::cuda::nn_detail

namespace kda::ops::cuda::nn_detail {

// Elementwise work over rows x cols, V consecutive columns per item (cols % V == 0): calls
// op.template apply<V>(row, col) once per item, grid-stride.
template <int V, class Op>
__global__ void map_rows_kernel(int64_t rows, int64_t cols, Op op) {
  const int64_t vcols = cols / V;
  const int64_t n = rows * vcols;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const int64_t r = i / vcols;
    const int64_t c = (i - r * vcols) * V;
    op.template apply<V>(r, c);
  }
}

// Queues map_rows_kernel with V = 4 when vec4 (which the caller sets only when cols % 4 == 0 and
// every pointer and stride allows 4-element accesses), else V = 1.
template <class Op>
void map_rows(int64_t rows, int64_t cols, bool vec4, const Op& op, cudaStream_t stream,
              const char* what) {
  if (rows == 0 || cols == 0) return;
  constexpr int kThreads = 256;
  if (vec4 && cols % 4 == 0)
    map_rows_kernel<4>
        <<<grid_for(rows * (cols / 4), kThreads), kThreads, 0, stream>>>(rows, cols, op);
  else
    map_rows_kernel<1><<<grid_for(rows * cols, kThreads), kThreads, 0, stream>>>(rows, cols, op);
  check_launch(what);
}

// One element of fp32 or bf16 storage, as fp32 (load1) or from fp32 (store1, round to nearest).
template <class T>
__device__ __forceinline__ float load1(const T* p) {
  return load_vec<1>(p).v[0];
}
template <class T>
__device__ __forceinline__ void store1(T* p, float v) {
  store_vec<1>(p, Vec<1>{{v}});
}

// A fixed-order fp64 sum over a block of kThreads threads (every thread's value, a tree by
// thread index; shared holds kThreads doubles): the same bits every run.
template <int kThreads>
__device__ double block_sum_fixed(double v, double* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (int(threadIdx.x) < half) shared[threadIdx.x] += shared[threadIdx.x + half];
    __syncthreads();
  }
  return shared[0];
}

// One AdamW update of weight w with moments m and v (in place) and gradient `grad`
// (train::AdamW::step's formulas and order, explicitly rounded operations: no fused
// multiply-adds, IEEE division and square root). The one formula of every AdamW kernel, so they
// agree bit for bit.
__device__ __forceinline__ void adamw_math(float& w, float grad, float& m, float& v, float lr,
                                           float b1, float b2, float eps, float decay, float c1,
                                           float c2, float grad_scale) {
  const float g = __fmul_rn(grad, grad_scale);
  m = __fadd_rn(__fmul_rn(b1, m), __fmul_rn(__fsub_rn(1.0f, b1), g));
  v = __fadd_rn(__fmul_rn(b2, v), __fmul_rn(__fmul_rn(__fsub_rn(1.0f, b2), g), g));
  w = __fsub_rn(w, __fmul_rn(decay, w));
  const float denom = __fadd_rn(__fsqrt_rn(__fdiv_rn(v, c2)), eps);
  w = __fsub_rn(w, __fdiv_rn(__fmul_rn(lr, __fdiv_rn(m, c1)), denom));
}

// adamw_math on element j of the arrays; returns the new weight.
__device__ __forceinline__ float adamw_update(float* param, const float* grad, float* m, float* v,
                                              int64_t j, float lr, float b1, float b2, float eps,
                                              float decay, float c1, float c2, float grad_scale) {
  float w = param[j], mj = m[j], vj = v[j];
  adamw_math(w, grad[j], mj, vj, lr, b1, b2, eps, decay, c1, c2, grad_scale);
  m[j] = mj;
  v[j] = vj;
  param[j] = w;
  return w;
}

}  // namespace kda::ops::cuda::nn_detail
