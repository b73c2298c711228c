// Mixture-of-experts feed-forward pieces, fp32, token-major rows of width D:
//
// Routing (DeepSeek-V3 "noaux" style, as Kimi Linear uses it):
//   s = sigmoid(router_logits)                      one score per expert
//   choice = s + correction_bias                     the bias only steers selection
//   (group step: experts split into num_groups groups; a group scores the sum of its two best
//    choices; only the best topk_groups groups stay eligible)
//   idx = top_k(choice); w = s[idx]                  weights from the unbiased scores
//   w = w / (sum(w) + 1e-20) (when renormalize); w *= scaling
//
// Experts are SwiGLU MLPs: expert(x) = down(silu(gate x) * up x). Evaluation groups the tokens
// by expert so each selected expert runs one GEMM over its tokens; experts nobody chose cost
// nothing.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

namespace kda::ops {

struct MoeRouting {
  int64_t num_experts = 1;
  int64_t top_k = 1;
  int64_t num_groups = 1;   // expert groups (1: no group step)
  int64_t topk_groups = 1;  // groups kept per token
  bool renormalize = true;
  double scaling = 1.0;  // routed_scaling_factor

  // Throws kda::Error naming the bad field.
  void validate() const;
};

// logits [T, E]; bias [E] may be null. Writes ids [T, top_k] (best first) and weights [T, top_k].
void moe_route_sigmoid(const MoeRouting& routing, const float* logits, int64_t T, const float* bias,
                       int32_t* ids, float* weights);

// One SwiGLU MLP's weights in torch's [out, in] layout, gate and up stacked:
// gate_up [2 I, D] (rows 0..I-1 gate, I..2I-1 up), down [D, I].
struct SwigluWeights {
  const float* gate_up = nullptr;
  const float* down = nullptr;
};

// Reusable buffers (grown, never shrunk) so decode steps do not allocate.
struct MoeWorkspace {
  std::vector<float> rows, hidden, act, out;
  std::vector<int32_t> count, offset, token, slot;
};

// y [T, D] = down(silu(gate x) * up x) for x [T, D] (dense MLP, intermediate I).
void swiglu_mlp(const float* x, int64_t T, int64_t D, int64_t I, const SwigluWeights& w, float* y,
                MoeWorkspace& ws);

// y [T, D] += sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) over the routed experts.
void moe_experts_accumulate(const float* x, int64_t T, int64_t D, int64_t I,
                            std::span<const SwigluWeights> experts, const int32_t* ids,
                            const float* weights, int64_t top_k, float* y, MoeWorkspace& ws);

}  // namespace kda::ops
