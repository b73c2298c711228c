// The Kimi Linear mixture-of-experts feed-forward for training: the same math as inference
// (ops/moe/moe.h, model/kimi_moe_block.cpp), with a backward pass to every weight and the
// auxiliary-loss-free load balancing of DeepSeek-V3 / Kimi.
//
//   s = sigmoid(x Wr^T)                    router scores [rows, E]
//   idx = top_k(s + bias) (with groups)     the bias only steers selection
//   w = s[idx] (/ (sum + 1e-20)) * scaling  weights from the unbiased scores
//   y = sum_j w_j expert_{idx_j}(x) + shared(x),   expert(x) = W2 (silu(W1 x) * W3 x)
//
// Gradients flow through the selected experts, the shared expert and the router (through the
// weights, their renormalisation and the sigmoid). The selection itself is piecewise constant
// and gets none; the correction bias gets no gradient and moves only through update_bias.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "ops/moe/moe.h"
#include "train/trainable_model.h"

namespace kda::train {

struct MoeParams {
  Param* router = nullptr;         // gate.weight [E, D]
  Param* bias = nullptr;           // gate.e_score_correction_bias [E]: selection only, no gradient
  std::vector<Param*> w1, w2, w3;  // per expert: w1 (gate) [I, D], w2 (down) [D, I], w3 (up) [I, D]
  // shared_experts.{gate,up,down}_proj: [Is, D], [Is, D], [D, Is]; all null when Is == 0
  Param *shared_gate = nullptr, *shared_up = nullptr, *shared_down = nullptr;
};

class MoeLayer {
 public:
  // width D, expert_hidden I, shared_hidden Is (I * num_shared_experts; 0: no shared expert).
  // Throws kda::Error when a parameter is missing or has the wrong shape. Marks the bias
  // `decay = false` (it is a running balance statistic, not a weight).
  MoeLayer(const ops::MoeRouting& routing, int64_t width, int64_t expert_hidden,
           int64_t shared_hidden, MoeParams p);

  // x [rows, D] -> y [rows, D] (overwritten); keeps what backward needs and counts each
  // expert's tokens for update_bias.
  void forward(const float* x, int64_t rows, float* y);
  // dy [rows, D] of the last forward -> dx [rows, D] (overwritten); Param::grad accumulated.
  void backward(const float* dy, float* dx);

  // Aux-loss-free balancing: with load[e] the tokens expert e received over the forward passes
  // since the last call, bias[e] += rate * sign(mean_load - load[e]); then the counts reset.
  void update_bias(float rate);
  std::span<const int64_t> expert_load() const { return load_; }

 private:
  ops::MoeRouting routing_;
  int64_t D_, I_, Is_, E_, K_;
  MoeParams p_;
  std::vector<int64_t> load_;

  // Kept by forward. Pairs (token, slot) are sorted by expert: expert e owns
  // [offset_[e], offset_[e + 1]).
  int64_t rows_ = -1;
  std::vector<float> x_;
  std::vector<int32_t> ids_;            // [rows, K]
  std::vector<float> weights_, score_;  // [rows, K]: routing weight, sigmoid score
  std::vector<int32_t> offset_, token_, slot_;
  std::vector<float> a_, b_;                // expert pre-activations (w1 x, w3 x) [pairs, I]
  std::vector<float> shared_a_, shared_b_;  // [rows, Is]

  // Scratch.
  std::vector<float> logits_, gathered_, rows_out_, hidden_, grad_h_, grad_a_, grad_b_, dweights_;
};

}  // namespace kda::train
