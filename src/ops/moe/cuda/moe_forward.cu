// moe_routed_forward: fp32 router logits through cuBLAS, the routing kernel, then the decode or
// prefill evaluation of the selected experts (moe_internal.h).
#include <cuda_runtime.h>

#include <string>

#include "core/error.h"
#include "ops/moe/cuda/moe_cuda.h"
#include "ops/moe/cuda/moe_internal.h"

namespace kda::ops::cuda {

void moe_routed_forward(const MoeRouting& routing, const MoeDeviceWeights& w, const float* x32,
                        const void* x, int64_t T, float* y, MoeDeviceWorkspace& ws, Gemm& gemm) {
  routing.validate();
  require(T >= 0, "moe_routed_forward: T must not be negative");
  require(w.D >= 1 && w.I >= 1, "moe_routed_forward: D and I must be positive");
  if (T == 0) return;
  require(x32 && x && y, "moe_routed_forward: null input or output");
  require(w.router && w.gate_up && w.down, "moe_routed_forward: null weights");
  const int64_t E = routing.num_experts, top_k = routing.top_k;
  cudaStream_t stream = gemm.stream();

  ws.logits.reserve(size_t(T * E) * sizeof(float));
  ws.ids.reserve(size_t(T * top_k) * sizeof(int32_t));
  ws.weights.reserve(size_t(T * top_k) * sizeof(float));
  float* logits = ws.logits.as<float>();
  int32_t* ids = ws.ids.as<int32_t>();
  float* weights = ws.weights.as<float>();

  gemm.linear(ElementType::f32, T, E, w.D, {x32, 0}, {w.router, 0}, {logits, ElementType::f32, 0});
  moe_route(routing, logits, T, w.correction_bias, ids, weights, stream);
  if (T <= kMoeGemvTokens)
    moe_detail::experts_decode(w, x, T, top_k, ids, weights, y, ws, stream);
  else
    moe_detail::experts_prefill(w, E, x, T, top_k, ids, weights, y, ws, gemm);
}

}  // namespace kda::ops::cuda
