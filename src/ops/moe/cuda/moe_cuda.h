// The routed experts of a mixture-of-experts feed-forward on the GPU (ops/moe.h's routing and
// SwiGLU experts, same formulas): sigmoid router in fp32, selection bias, optional group step,
// top-k, renormalisation and scaling, then each selected expert's SwiGLU MLP over its tokens,
// accumulated into y weighted by the routing weights. The shared experts are a plain dense
// MLP and not part of this call.
//
// Two paths, same results to rounding: for a few tokens (decode, T <= kMoeGemvTokens) fused
// matrix-vector kernels read each selected expert's weights once and nothing waits on the host;
// for prefill the tokens are grouped by expert on the device and each used expert runs cuBLAS
// products over its rows (one device-to-host copy of the per-expert counts per call).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/common/device_buffer.h"
#include "ops/common/device_types.h"
#include "ops/gemm/cuda/gemm_cuda.h"
#include "ops/moe/moe.h"

namespace kda::ops::cuda {

constexpr int64_t kMoeGemvTokens = 16;

// Device weights. Router fp32 (as transformers runs the gate: fp32 logits); experts in one
// element type, stacked: gate_up [E, 2 I, D] (rows 0..I-1 gate, I..2I-1 up, per expert), down
// [E, D, I].
struct MoeDeviceWeights {
  int64_t D = 0, I = 0;
  const float* router = nullptr;           // [E, D]
  const float* correction_bias = nullptr;  // [E] or null
  ElementType expert_type = ElementType::bf16;
  const void* gate_up = nullptr;
  const void* down = nullptr;
};

// Buffers grown on demand and kept (decode steps do not allocate).
struct MoeDeviceWorkspace {
  DeviceBuffer logits, ids, weights, order, counts, rows, hidden, act, out;
};

// y [T, D] fp32 += sum_j w[t, j] expert_{id[t, j]}(x[t]). x32: the input rows in fp32 (the
// router's input); x: the same rows in expert_type (the experts' input; may be x32 itself when
// expert_type is fp32). Work is queued on gemm.stream().
void moe_routed_forward(const MoeRouting& routing, const MoeDeviceWeights& w, const float* x32,
                        const void* x, int64_t T, float* y, MoeDeviceWorkspace& ws, Gemm& gemm);

// Routing alone (exposed for checks): ids [T, top_k] int32 (best first) and weights [T, top_k]
// fp32, from fp32 logits [T, E]; bias [E] or null.
void moe_route(const MoeRouting& routing, const float* logits, int64_t T, const float* bias,
               int32_t* ids, float* weights, cudaStream_t stream);

}  // namespace kda::ops::cuda
