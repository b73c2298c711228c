// The elementwise pieces of training a mixture-of-experts feed-forward on the GPU
// (train/moe_layer.h's forward and backward; the GEMMs are the caller's cuBLAS products per
// expert). Tokens are routed to top_k experts each: slot s = t * top_k + j is token t's j-th
// choice; the (token, slot) pairs sorted by expert are "pairs" p, with pair_slot[p] the slot of
// pair p and slot_pair[s] the pair of slot s (inverse permutations of [0, T top_k)).
//
// All pointers are DEVICE pointers, rows dense. Every result is deterministic: no atomics; a
// token's sum over its slots runs in slot order. Bad sizes throw kda::Error before anything is
// queued; every launch is checked.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/common/device_types.h"
#include "ops/nn/cuda/nn_cuda.h"

namespace kda::ops::cuda {

// dst[p, :] = src[rows[p], :] for p < n (src of src_type, dense [*, D]; dst OutRows, the cast
// included).
void gather_rows(const void* src, ElementType src_type, const int32_t* rows, int64_t n, int64_t D,
                 OutRows dst, cudaStream_t stream);

// y[t, :] (= or +=) sum_{j < K} w_j x[slot_pair[t K + j], :] with w_j = weights[t K + j]
// (weights null: 1). x fp32 [T K, D], y fp32 [T, D].
void moe_combine(const float* x, const int32_t* slot_pair, const float* weights, int64_t T,
                 int64_t K, int64_t D, float* y, bool accumulate, cudaStream_t stream);

// y[p, i] = weights[pair_slot[p]] * silu(a) * b with [a | b] = gate_up[p] (fp32 [pairs, 2 I]):
// the routing-weighted expert hidden (what the down projection's weight gradient reads).
void moe_weighted_swiglu(const float* gate_up, const float* weights, const int32_t* pair_slot,
                         int64_t pairs, int64_t I, OutRows y, cudaStream_t stream);

// The expert hidden's backward. g fp32 [pairs, I] = dy W2 (the unweighted gradient of the
// expert's hidden h = silu(a) b), w = weights[pair_slot[p]]:
//   dweights[pair_slot[p]] = g . h  (the routing weight's gradient; overwritten)
//   d_gate_up[p] = [w g b silu'(a) | w g silu(a)]  (OutRows, [pairs, 2 I])
void moe_expert_backward(const float* gate_up, const float* g, const float* weights,
                         const int32_t* pair_slot, int64_t pairs, int64_t I, OutRows d_gate_up,
                         float* dweights, cudaStream_t stream);

// The router's backward (train/moe_layer.cpp's formulas): with s_j = sigmoid(logits[t,
// ids[t K + j]]) and w_j = c s_j / (sum_j s_j + 1e-20) (renormalize) or c s_j, from the weights'
// gradients dweights [T, K]: dlogits [T, E] fp32 (overwritten; zero for experts not chosen).
void moe_router_backward(const float* logits, const int32_t* ids, const float* dweights, int64_t T,
                         int64_t E, int64_t K, bool renormalize, double scaling, float* dlogits,
                         cudaStream_t stream);

}  // namespace kda::ops::cuda
