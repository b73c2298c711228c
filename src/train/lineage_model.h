// A small language model of the lineage family for training on the CPU: token embedding, then
// per layer a pre-norm token mixer (one of softmax attention, linear attention, DeltaNet, Gated
// DeltaNet, KDA (these three with fla's short convolution on q, k, v), NoPE MLA, chosen per
// layer by a pattern such as "KKKA") and a pre-norm SwiGLU MLP, a
// final RMSNorm and an untied LM head. Forward keeps what the backward needs; backward fills
// every parameter's gradient through the ops' own backward passes.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "ops/kda/kda.h"
#include "train/trainable_model.h"

namespace kda::train {

// Pattern letters: A softmax attention, L linear attention, D DeltaNet, G Gated DeltaNet, K KDA,
// M Kimi Linear's NoPE MLA (per head: qk_nope = v = head_dim, rope part head_dim / 2, latent
// 4 head_dim: Kimi's 128 / 64 / 128 / 512 at head_dim 128).
enum class MixerKind { softmax, linear, delta, gated_delta, kda, mla };
MixerKind mixer_from_letter(char letter);
std::string mixer_name(MixerKind kind);

struct LineageConfig {
  int64_t vocab = 8192;
  int64_t width = 256;
  int64_t heads = 2;
  int64_t head_dim = 128;
  int64_t mlp_hidden = 512;
  std::string pattern = "KK";  // one letter per layer
  float norm_eps = 1e-5f;
  // KDA's forget gate: "softplus" (Kimi Linear's -exp(A_log) softplus(g + dt_bias)) or "bounded"
  // (-5 sigmoid(exp(A_log) (g + dt_bias)), fla's safe gate: a channel never decays faster than
  // e^-5 a token, which the GPU's chunked kernel needs over long runs of strong forgetting).
  std::string kda_gate = "softplus";
  // The gated mixers' (G, K) initial decay: Mamba's dt drawn log-uniformly in
  // [gate_dt_max / 100, gate_dt_max] per head (fla: 0.1, so up to e^-1.6 a token with
  // exp(A_log) = 16). Smaller values start the gates near DeltaNet (little forgetting).
  float gate_dt_max = 0.1f;
  // KDA's dt drawn per channel (fla's KimiDeltaAttention init) instead of once per head (our
  // default: KDA starts as Gated DeltaNet does, docs/RECALL.md)
  bool gate_dt_per_channel = false;
  // RoPE on the softmax layers of a hybrid too (default: NoPE there, as Kimi Linear's MLA; a
  // model whose every layer is softmax always takes RoPE, having no other source of position)
  bool hybrid_rope = false;
  bool softmax_rope() const {
    return hybrid_rope || pattern.find_first_not_of('A') == std::string::npos;
  }
  static constexpr double kKdaLowerBound = -5.0;
  ops::KdaOptions kda_options() const;
  void validate() const;
};

class MixerLayer;

class LineageModel final : public TrainableModel {
 public:
  LineageModel(const LineageConfig& config, uint64_t seed);
  ~LineageModel();

  const LineageConfig& config() const { return config_; }
  std::vector<Param*> params() override;
  int64_t num_params() const;

  // See TrainableModel::forward_backward.
  StepResult forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                              bool backward, std::span<const int64_t> cu_seqlens = {}) override;

 private:
  struct Block;
  LineageConfig config_;
  std::vector<std::unique_ptr<Param>> params_;
  std::vector<std::unique_ptr<Block>> blocks_;
  Param *embed_, *final_norm_, *lm_head_;
  Param* add(const std::string& name, Shape shape, bool decay);
};

}  // namespace kda::train
