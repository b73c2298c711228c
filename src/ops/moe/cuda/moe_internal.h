// The two ways moe_routed_forward evaluates the routed experts once the routing (ids, weights
// on the device) is known. Private to src/ops/moe/cuda.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/moe/cuda/moe_cuda.h"

namespace kda::ops::cuda::moe_detail {

// Few tokens: fused matrix-vector kernels, nothing waits on the host.
void experts_decode(const MoeDeviceWeights& w, const void* x, int64_t T, int64_t top_k,
                    const int32_t* ids, const float* weights, float* y, MoeDeviceWorkspace& ws,
                    cudaStream_t stream);

// Many tokens: group the (token, slot) pairs by expert on the device, one cuBLAS product pair
// per used expert, then a deterministic combine. One device-to-host copy of the counts.
void experts_prefill(const MoeDeviceWeights& w, int64_t num_experts, const void* x, int64_t T,
                     int64_t top_k, const int32_t* ids, const float* weights, float* y,
                     MoeDeviceWorkspace& ws, Gemm& gemm);

}  // namespace kda::ops::cuda::moe_detail
