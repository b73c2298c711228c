// The elementwise activations of a KDA layer on the device (KdaLayerParams in chunk_kernels.cuh),
// forward and backward, shared by chunk_prepare (forward and the backward's recompute) and
// chunk_bwd_local, so that both compute bit-identical gates and betas. fp32 with the fast exp /
// log / reciprocal (relative error ~1e-6, far below the bf16 rounding of everything else).
// The host-side definitions are ops/kda/kda_activations.h.
#pragma once
#include <cuda_runtime.h>

namespace kda::ops::cuda_detail {

__device__ __forceinline__ float fast_rcp(float x) {  // 1 / inf = 0
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
// -a * torch's softplus(z) (threshold 20)
__device__ __forceinline__ float kda_gate_softplus(float a, float z) {
  return -a * (z > 20.f ? z : __logf(1.f + __expf(z)));
}
// lower_bound * sigmoid(a z)
__device__ __forceinline__ float kda_gate_bounded(float lower_bound, float a, float z) {
  return lower_bound * fast_rcp(1.f + __expf(-a * z));
}
__device__ __forceinline__ float kda_beta_sigmoid(float b) {
  return fast_rcp(1.f + __expf(-b));
}

// Backward of the gate at z = graw + dt_bias for the upstream gradient dg (of the activated,
// natural-log gate): dz (= dgraw = the term of ddt_bias) and the term of dA_log.
//   softplus:    g = -a sp(z):       dz = -a sigmoid(z) dg,           dA = g dg
//   lower bound: g = lb sigmoid(a z): dz = lb s (1 - s) a dg,        dA = dz z
// s (1 - s) from e = exp(-|a z|) <= 1: s (1 - s) = e / (1 + e)^2 (no cancellation, no inf).
__device__ __forceinline__ void kda_gate_grad(bool softplus, float lower_bound, float a, float z,
                                              float dg, float& dz, float& dA) {
  if (softplus) {
    const float sp = z > 20.f ? z : log1pf(__expf(z));
    dz = -a * fast_rcp(1.f + __expf(-z)) * dg;
    dA = -a * sp * dg;
  } else {
    const float e = __expf(-fabsf(a * z));
    const float p = fast_rcp(1.f + e);
    dz = lower_bound * e * p * p * a * dg;
    dA = dz * z;
  }
}

}  // namespace kda::ops::cuda_detail
