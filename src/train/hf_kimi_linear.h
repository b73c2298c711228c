// Kimi Linear (transformers' KimiLinearForCausalLM) as a training model: every tensor under its
// checkpoint name, forward and backward through KDA (short conv, gates, gated norm), NoPE MLA,
// the dense MLP and the MoE (router included), and the MoE's auxiliary-loss-free balancing.
// A folder saved from it (config.json + model.safetensors) loads in `kda run` and transformers.
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/kimi_linear_config.h"
#include "train/trainable_model.h"

namespace kda::train {

class KimiLinearTrainable final : public TrainableModel {
 public:
  // Weights from a Hugging Face folder (any dtype, sharded or not), held as fp32.
  static std::unique_ptr<KimiLinearTrainable> from_folder(const std::string& dir);
  // Fresh weights for `config` (a kimi_linear config.json), initialised as transformers and fla
  // do (normal(0, initializer_range) matrices, A_log = log U(1, 16), dt_bias = softplus^-1 of
  // a log-uniform step in [1e-3, 0.1]).
  static std::unique_ptr<KimiLinearTrainable> from_config(const nlohmann::json& config,
                                                          uint64_t seed);
  ~KimiLinearTrainable() override;

  const nlohmann::json& config() const { return json_; }
  std::vector<Param*> params() override;
  StepResult forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                              bool backward, std::span<const int64_t> cu_seqlens = {}) override;
  // Nudges each MoE layer's selection bias toward uniform expert load (DeepSeek-V3's
  // auxiliary-loss-free balancing): bias[e] += rate * sign(mean load - load[e]).
  void after_optimizer_step() override;
  float bias_update_rate = 1e-3f;
  // max / mean expert load of the training passes since the last optimizer step, per MoE layer
  // (1 = perfectly balanced). Passes without backward (evaluation) do not count.
  std::vector<double> expert_load_imbalance() const;

 private:
  struct Layer;
  explicit KimiLinearTrainable(const nlohmann::json& config);
  Param* add(const std::string& name, Shape shape, bool decay);
  void build(const std::string& dense_prefix_name);

  nlohmann::json json_;
  model::KimiLinearConfig c_;
  std::vector<std::unique_ptr<Param>> params_;
  std::vector<std::unique_ptr<Layer>> layers_;
  Param *embed_ = nullptr, *final_norm_ = nullptr, *lm_head_ = nullptr;
};

}  // namespace kda::train
