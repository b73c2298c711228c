// The mixture-of-experts training kernels of moe_train_cuda.h: gathers, the per-token combine
// over slots (in slot order: deterministic), the weighted expert hidden, the expert hidden's
// backward (a warp per pair for the routing weight's dot product) and the router's backward
// (a thread per token).
#include <cuda_bf16.h>

#include <string>

#include "ops/moe/cuda/moe_train_cuda.h"
#include "ops/nn/cuda/nn_common.cuh"

namespace kda::ops::cuda {
namespace {

using namespace nn_detail;

__device__ __forceinline__ float silu_f(float a) {
  return a / (1.0f + expf(-a));
}

template <class In, class Out>
__global__ void gather_rows_kernel(const In* src, const int32_t* rows, int64_t n, int64_t D,
                                   Out* dst, int64_t dst_stride) {
  const int64_t total = n * D;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
    const int64_t p = i / D, c = i - p * D;
    store1(dst + p * dst_stride + c, load1(src + int64_t(rows[p]) * D + c));
  }
}

__global__ void combine_kernel(const float* x, const int32_t* slot_pair, const float* weights,
                               int64_t T, int64_t K, int64_t D, float* y, bool accumulate) {
  const int64_t total = T * D;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
    const int64_t t = i / D, c = i - t * D;
    float acc = accumulate ? y[i] : 0.0f;
    for (int64_t j = 0; j < K; ++j) {
      const float w = weights ? weights[t * K + j] : 1.0f;
      acc += w * x[int64_t(slot_pair[t * K + j]) * D + c];
    }
    y[i] = acc;
  }
}

template <class Out>
__global__ void weighted_swiglu_kernel(const float* gate_up, const float* weights,
                                       const int32_t* pair_slot, int64_t pairs, int64_t I, Out* y,
                                       int64_t y_stride) {
  const int64_t total = pairs * I;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; n < total; n += step) {
    const int64_t p = n / I, i = n - p * I;
    const float a = gate_up[p * 2 * I + i], b = gate_up[p * 2 * I + I + i];
    store1(y + p * y_stride + i, weights[pair_slot[p]] * silu_f(a) * b);
  }
}

// A warp per pair.
template <class Out>
__global__ void expert_backward_kernel(const float* gate_up, const float* g, const float* weights,
                                       const int32_t* pair_slot, int64_t pairs, int64_t I,
                                       Out* d_gate_up, int64_t d_stride, float* dweights) {
  const int64_t p = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (p >= pairs) return;
  const float* a = gate_up + p * 2 * I;
  const float* b = a + I;
  const float* gp = g + p * I;
  const int32_t slot = pair_slot[p];
  const float w = weights[slot];
  Out* d = d_gate_up + p * d_stride;
  float dot = 0.0f;
  for (int64_t i = lane; i < I; i += 32) {
    const float ai = a[i], bi = b[i], gi = gp[i];
    const float sig = 1.0f / (1.0f + expf(-ai));
    const float silu = ai * sig;
    dot += gi * silu * bi;
    const float wg = w * gi;
    store1(d + i, wg * bi * sig * (1.0f + ai * (1.0f - sig)));
    store1(d + I + i, wg * silu);
  }
  dot = warp_sum(dot);
  if (lane == 0) dweights[slot] = dot;
}

__global__ void router_backward_kernel(const float* logits, const int32_t* ids,
                                       const float* dweights, int64_t T, int64_t E, int64_t K,
                                       bool renormalize, double scaling, float* dlogits) {
  const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= T) return;
  float* dl = dlogits + t * E;
  for (int64_t e = 0; e < E; ++e) dl[e] = 0.0f;
  const int32_t* id = ids + t * K;
  const float* dw = dweights + t * K;
  double sum = 0, dot = 0;
  for (int64_t j = 0; j < K; ++j) {
    const float s = 1.0f / (1.0f + expf(-logits[t * E + id[j]]));
    sum += s;
    dot += double(dw[j]) * s;
  }
  const double inv = 1.0 / (sum + 1e-20);
  for (int64_t j = 0; j < K; ++j) {
    const float s = 1.0f / (1.0f + expf(-logits[t * E + id[j]]));
    const double ds =
        renormalize ? scaling * inv * (double(dw[j]) - dot * inv) : scaling * double(dw[j]);
    dl[id[j]] = float(ds * s * (1.0 - s));
  }
}

constexpr int kThreads = 256;

}  // namespace

void gather_rows(const void* src, ElementType src_type, const int32_t* rows, int64_t n, int64_t D,
                 OutRows dst, cudaStream_t stream) {
  require(n >= 0 && D >= 1, "gather_rows: bad sizes");
  check_out(dst, D, "gather_rows");
  if (n == 0) return;
  const int64_t stride = out_stride(dst, D);
  dispatch_type(src_type, [&](auto* in_tag) {
    using In = std::remove_pointer_t<decltype(in_tag)>;
    dispatch_type(dst.type, [&](auto* out_tag) {
      using Out = std::remove_pointer_t<decltype(out_tag)>;
      gather_rows_kernel<<<grid_for(n * D, kThreads), kThreads, 0, stream>>>(
          static_cast<const In*>(src), rows, n, D, static_cast<Out*>(dst.data), stride);
    });
  });
  check_launch("gather_rows");
}

void moe_combine(const float* x, const int32_t* slot_pair, const float* weights, int64_t T,
                 int64_t K, int64_t D, float* y, bool accumulate, cudaStream_t stream) {
  require(T >= 0 && K >= 1 && D >= 1, "moe_combine: bad sizes");
  if (T == 0) return;
  combine_kernel<<<grid_for(T * D, kThreads), kThreads, 0, stream>>>(x, slot_pair, weights, T, K, D,
                                                                     y, accumulate);
  check_launch("moe_combine");
}

void moe_weighted_swiglu(const float* gate_up, const float* weights, const int32_t* pair_slot,
                         int64_t pairs, int64_t I, OutRows y, cudaStream_t stream) {
  require(pairs >= 0 && I >= 1, "moe_weighted_swiglu: bad sizes");
  check_out(y, I, "moe_weighted_swiglu");
  if (pairs == 0) return;
  dispatch_type(y.type, [&](auto* tag) {
    using Out = std::remove_pointer_t<decltype(tag)>;
    weighted_swiglu_kernel<<<grid_for(pairs * I, kThreads), kThreads, 0, stream>>>(
        gate_up, weights, pair_slot, pairs, I, static_cast<Out*>(y.data), out_stride(y, I));
  });
  check_launch("moe_weighted_swiglu");
}

void moe_expert_backward(const float* gate_up, const float* g, const float* weights,
                         const int32_t* pair_slot, int64_t pairs, int64_t I, OutRows d_gate_up,
                         float* dweights, cudaStream_t stream) {
  require(pairs >= 0 && I >= 1, "moe_expert_backward: bad sizes");
  check_out(d_gate_up, 2 * I, "moe_expert_backward");
  if (pairs == 0) return;
  constexpr int kWarps = 8;
  dispatch_type(d_gate_up.type, [&](auto* tag) {
    using Out = std::remove_pointer_t<decltype(tag)>;
    expert_backward_kernel<<<unsigned(ceil_div(pairs, kWarps)), 32 * kWarps, 0, stream>>>(
        gate_up, g, weights, pair_slot, pairs, I, static_cast<Out*>(d_gate_up.data),
        out_stride(d_gate_up, 2 * I), dweights);
  });
  check_launch("moe_expert_backward");
}

void moe_router_backward(const float* logits, const int32_t* ids, const float* dweights, int64_t T,
                         int64_t E, int64_t K, bool renormalize, double scaling, float* dlogits,
                         cudaStream_t stream) {
  require(T >= 0 && E >= 1 && K >= 1 && K <= E, "moe_router_backward: bad sizes");
  if (T == 0) return;
  constexpr int kTokens = 128;
  router_backward_kernel<<<unsigned(ceil_div(T, kTokens)), kTokens, 0, stream>>>(
      logits, ids, dweights, T, E, K, renormalize, scaling, dlogits);
  check_launch("moe_router_backward");
}

}  // namespace kda::ops::cuda
