// GPT-2 (transformers' GPT2LMHeadModel) as a training model on the CPU, fp32: learned token and
// position embeddings, per layer pre-LayerNorm causal attention and a GELU MLP with residuals,
// a final LayerNorm and the head tied to the token embedding. Parameters keep the checkpoint's
// names and layouts (Conv1D weights [in, out], y = x W + b), so a trained model saves as a
// folder that transformers and `kda run` load. Forward keeps what the backward needs; the
// backward accumulates every gradient, the tied embedding's from both of its uses.
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/gpt2_config.h"
#include "train/trainable_model.h"

namespace kda::train {

class Gpt2Trainable final : public TrainableModel {
 public:
  // config.json + weights (sharded, bf16 and fp16 become fp32).
  static std::unique_ptr<Gpt2Trainable> from_folder(const std::string& dir);
  // Random weights as transformers' GPT2PreTrainedModel._init_weights: normal(0,
  // initializer_range) matrices and embeddings, c_proj weights / sqrt(2 n_layer), zero biases,
  // LayerNorm weight 1 and bias 0.
  static std::unique_ptr<Gpt2Trainable> from_config(const nlohmann::json& config, uint64_t seed);
  ~Gpt2Trainable() override;

  const model::Gpt2Config& settings() const { return config_; }
  // The config.json to save next to the weights (model_type gpt2, fp32).
  nlohmann::json config() const;
  std::vector<Param*> params() override;

  // See TrainableModel::forward_backward. Positions restart at 0 at every row and document
  // start; a position at or past n_positions throws kda::Error.
  StepResult forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                              bool backward, std::span<const int64_t> cu_seqlens = {}) override;

 private:
  struct Layer;
  Gpt2Trainable(const nlohmann::json& config_json, const std::string& prefix);
  Param* add(const std::string& name, Shape shape);

  model::Gpt2Config config_;
  nlohmann::json config_json_;
  std::vector<std::unique_ptr<Param>> params_;
  std::vector<std::unique_ptr<Layer>> layers_;
  Param *wte_, *wpe_, *ln_f_weight_, *ln_f_bias_;
  // kept from the last forward for the backward
  std::vector<int64_t> positions_, cu_seqlens_;
  std::vector<float> x_final_, ln_f_out_, ln_f_mean_, ln_f_rstd_;
};

}  // namespace kda::train
