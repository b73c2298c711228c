// Device helpers shared by the mixture-of-experts kernels: 8-element loads of bf16 or fp32 rows
// as floats, warp sums, and the launch check. Private to src/ops/moe/cuda.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/common/device_buffer.h"
#include "ops/delta_rule/cuda/device_common.cuh"

namespace kda::ops::cuda::moe_detail {

using cuda_detail::aligned16;
using cuda_detail::check_launch;
using cuda_detail::from_f32;
using cuda_detail::to_f32;

// 8 consecutive elements as floats; p 16-byte aligned.
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float out[8]) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void load8(const float* p, float out[8]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(p));
  const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
  out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
  out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}

// Every lane gets the sum over the warp.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float silu(float g) {
  return g / (1.0f + expf(-g));
}

}  // namespace kda::ops::cuda::moe_detail
