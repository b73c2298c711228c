// One token-mixer sub-layer of a lineage model: projections in, (for the delta-rule family) a
// causal short convolution + SiLU on q, k and v as fla's layers have, the mixer op, projection
// out.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "train/lineage_model.h"

namespace kda::train {

struct MixerWeights {
  Param *Wq = nullptr, *Wk = nullptr, *Wv = nullptr, *Wo = nullptr;
  Param* Wb = nullptr;                         // beta projection [H, d] (delta family)
  Param* Wg = nullptr;                         // gate projection [H, d] or [H * dh, d]
  Param *A_log = nullptr, *dt_bias = nullptr;  // gate parameters
  // short convolutions [inner, 1, kShortConvWidth] on q, k, v (delta family), or all null
  Param *q_conv = nullptr, *k_conv = nullptr, *v_conv = nullptr;
};

// The delta-rule layers' causal short convolution (fla's ShortConvolution, kernel 4), followed
// by SiLU, as DeltaNet, Gated DeltaNet and KDA layers apply it to q, k and v.
constexpr int64_t kShortConvWidth = 4;

class MixerLayer {
 public:
  // rope: rotary position embedding on q and k (softmax only; models whose every layer is
  // softmax need it for positions; hybrids take positions from their recurrent layers, NoPE).
  MixerLayer(MixerKind kind, int64_t width, int64_t heads, int64_t head_dim, MixerWeights w,
             bool rope = false)
      : kind_(kind), d_(width), H_(heads), dh_(head_dim), rope_(rope), w_(w) {}
  // The KDA op's options (KDA layers only; l2 normalisation on, the gate of the config).
  void set_kda_options(const ops::KdaOptions& options) { kda_options_ = options; }
  // x [B * T, d] -> y [B * T, d]; keeps activations for backward. With cu_seqlens (offsets
  // into the B * T flattened tokens, starting at 0 and ending at B * T), the tokens are one
  // packed batch: recurrent state starts from zero, attention does not look back, and RoPE
  // positions restart at 0 at every listed offset. Empty: B independent rows of T tokens.
  void forward(const float* x, int64_t B, int64_t T, float* y,
               std::span<const int64_t> cu_seqlens = {});
  // dy -> dx (overwritten); parameter gradients accumulated.
  void backward(const float* dy, float* dx);

 private:
  // The chunked ops' shape and inputs over this step's activations (forward and backward).
  ops::DeltaRuleShape op_shape(ops::Gate gate) const;
  ops::DeltaRuleInputs<float> delta_inputs() const;
  ops::KdaInputs<float> kda_inputs() const;

  MixerKind kind_;
  int64_t d_, H_, dh_, B_ = 0, T_ = 0;
  bool rope_ = false;
  MixerWeights w_;
  ops::KdaOptions kda_options_;
  std::vector<int64_t> cu_seqlens_, positions_;  // packed layout (empty: B rows) and RoPE
  std::vector<float> x_, q_, k_, v_, braw_, graw_, o_, lse_;
  // delta / gated delta: activated inputs
  std::vector<float> qn_, kn_, beta_, g_;
  // short convolution: q, k, v before it, and the sequences it runs over
  std::vector<float> pre_conv_[3];
  std::vector<int64_t> segments_;
};

}  // namespace kda::train
