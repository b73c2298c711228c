// Routed experts for a few tokens: two fused matrix-vector kernels that read each selected
// expert's weights once (the decode step is bound by those bytes) and never wait on the host.
//   (1) hidden[pair, i] = silu(gate_i . x_t) * (up_i . x_t)      pair = (token t, slot j)
//   (2) y[t, d] += sum_j w[t, j] * (down_{e_j}[d, :] . hidden[pair (t, j)])
// Each output row of (2) belongs to one block, which sums the slots in a fixed order: no
// atomics, the same bits every run.
#include <cuda_bf16.h>

#include <algorithm>
#include <string>

#include "core/error.h"
#include "ops/moe/cuda/moe_common.cuh"
#include "ops/moe/cuda/moe_internal.h"

namespace kda::ops::cuda::moe_detail {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kGateRowsPerWarp = 2;  // intermediate rows per warp: 2 gate + 2 up dot products
constexpr int kGateRowsPerBlock = kWarps * kGateRowsPerWarp;
constexpr int kDownRows = 8;  // output rows per block; every warp covers all of them

// out[r] = rows[r][0, n) . vec[0, n) over the warp (every lane gets the sums). kVec: n % 8 == 0
// and every pointer 16-byte aligned, so each lane reads 16-byte (bf16) or 32-byte (fp32)
// packs.
template <class T, class V, int NR, bool kVec>
__device__ __forceinline__ void warp_dots(const T* (&rows)[NR], const V* vec, int64_t n, int lane,
                                          float (&out)[NR]) {
  float acc[NR];
#pragma unroll
  for (int r = 0; r < NR; ++r) acc[r] = 0.f;
  if constexpr (kVec) {
#pragma unroll(sizeof(T) == 2 ? 2 : 1)  // fp32 rows: enough registers in flight already
    for (int64_t k = int64_t(lane) * 8; k < n; k += 32 * 8) {
      float v[8];
      load8(vec + k, v);
      float m[NR][8];
#pragma unroll
      for (int r = 0; r < NR; ++r) load8(rows[r] + k, m[r]);
#pragma unroll
      for (int r = 0; r < NR; ++r)
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[r] = fmaf(m[r][q], v[q], acc[r]);
    }
  } else {
    for (int64_t k = lane; k < n; k += 32) {
      const float v = to_f32(vec[k]);
#pragma unroll
      for (int r = 0; r < NR; ++r) acc[r] = fmaf(to_f32(rows[r][k]), v, acc[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < NR; ++r) out[r] = warp_sum(acc[r]);
}

// grid (ceil(I / kGateRowsPerBlock), pairs). hidden fp32 [pairs, I].
template <class T, bool kVec>
__global__ void __launch_bounds__(kThreads)
    decode_gate_up_kernel(const T* __restrict__ x, const T* __restrict__ gate_up,
                          const int32_t* __restrict__ ids, int64_t top_k, int64_t D, int64_t I,
                          float* __restrict__ hidden) {
  const int64_t pair = blockIdx.y;
  const int64_t t = pair / top_k;
  const int64_t e = ids[pair];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t i0 = int64_t(blockIdx.x) * kGateRowsPerBlock + int64_t(warp) * kGateRowsPerWarp;
  if (i0 >= I) return;  // a whole warp; no block-wide barrier follows
  const T* W = gate_up + e * 2 * I * D;
  const T* rows[2 * kGateRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kGateRowsPerWarp; ++r) {
    const int64_t i = min(i0 + r, I - 1);  // rows past I repeat the last one, unused
    rows[2 * r] = W + i * D;
    rows[2 * r + 1] = W + (I + i) * D;
  }
  float dots[2 * kGateRowsPerWarp];
  warp_dots<T, T, 2 * kGateRowsPerWarp, kVec>(rows, x + t * D, D, lane, dots);
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kGateRowsPerWarp; ++r)
      if (i0 + r < I) hidden[pair * I + i0 + r] = silu(dots[2 * r]) * dots[2 * r + 1];
  }
}

// grid (ceil(D / kDownRows), T). Warp w takes slots w, w + kWarps, ...; the warps' partial
// sums meet in shared memory and are added in warp order.
template <class T, bool kVec>
__global__ void __launch_bounds__(kThreads)
    decode_down_kernel(const T* __restrict__ down, const int32_t* __restrict__ ids,
                       const float* __restrict__ weights, const float* __restrict__ hidden,
                       int64_t top_k, int64_t D, int64_t I, float* __restrict__ y) {
  __shared__ float partial[kWarps][kDownRows];
  const int64_t t = blockIdx.y;
  const int64_t d0 = int64_t(blockIdx.x) * kDownRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float acc[kDownRows];
#pragma unroll
  for (int r = 0; r < kDownRows; ++r) acc[r] = 0.f;
  for (int64_t j = warp; j < top_k; j += kWarps) {
    const int64_t pair = t * top_k + j;
    const int64_t e = ids[pair];
    const float weight = weights[pair];
    const T* W = down + e * D * I;
    const T* rows[kDownRows];
#pragma unroll
    for (int r = 0; r < kDownRows; ++r) rows[r] = W + min(d0 + r, D - 1) * I;
    float dots[kDownRows];
    warp_dots<T, float, kDownRows, kVec>(rows, hidden + pair * I, I, lane, dots);
#pragma unroll
    for (int r = 0; r < kDownRows; ++r) acc[r] = fmaf(weight, dots[r], acc[r]);
  }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kDownRows; ++r) partial[warp][r] = acc[r];
  }
  __syncthreads();
  if (threadIdx.x < kDownRows && d0 + threadIdx.x < D) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += partial[w][threadIdx.x];
    y[t * D + d0 + threadIdx.x] += sum;
  }
}

template <class T>
void launch_decode(const MoeDeviceWeights& w, const void* x, int64_t tokens, int64_t top_k,
                   const int32_t* ids, const float* weights, float* hidden, float* y,
                   cudaStream_t stream) {
  const int64_t D = w.D, I = w.I, pairs = tokens * top_k;
  const T* xt = static_cast<const T*>(x);
  const T* gate_up = static_cast<const T*>(w.gate_up);
  const T* down = static_cast<const T*>(w.down);
  const dim3 gate_grid(unsigned((I + kGateRowsPerBlock - 1) / kGateRowsPerBlock), unsigned(pairs));
  if (D % 8 == 0 && aligned16(xt) && aligned16(gate_up))
    decode_gate_up_kernel<T, true>
        <<<gate_grid, kThreads, 0, stream>>>(xt, gate_up, ids, top_k, D, I, hidden);
  else
    decode_gate_up_kernel<T, false>
        <<<gate_grid, kThreads, 0, stream>>>(xt, gate_up, ids, top_k, D, I, hidden);
  check_launch("moe decode (gate_up)");
  const dim3 down_grid(unsigned((D + kDownRows - 1) / kDownRows), unsigned(tokens));
  if (I % 8 == 0 && aligned16(down) && aligned16(hidden))
    decode_down_kernel<T, true>
        <<<down_grid, kThreads, 0, stream>>>(down, ids, weights, hidden, top_k, D, I, y);
  else
    decode_down_kernel<T, false>
        <<<down_grid, kThreads, 0, stream>>>(down, ids, weights, hidden, top_k, D, I, y);
  check_launch("moe decode (down)");
}

}  // namespace

void experts_decode(const MoeDeviceWeights& w, const void* x, int64_t T, int64_t top_k,
                    const int32_t* ids, const float* weights, float* y, MoeDeviceWorkspace& ws,
                    cudaStream_t stream) {
  const int64_t pairs = T * top_k;
  require(pairs <= 65535 && T <= 65535, "moe decode: too many (token, expert) pairs");
  ws.hidden.reserve(size_t(pairs * w.I) * sizeof(float));
  float* hidden = ws.hidden.as<float>();
  if (w.expert_type == ElementType::bf16)
    launch_decode<__nv_bfloat16>(w, x, T, top_k, ids, weights, hidden, y, stream);
  else
    launch_decode<float>(w, x, T, top_k, ids, weights, hidden, y, stream);
}

}  // namespace kda::ops::cuda::moe_detail
