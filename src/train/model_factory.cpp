#include "train/model_factory.h"

#include <map>

#include "core/error.h"
#include "model/kimi_linear_config.h"
#include "model/model_folder.h"
#include "train/hf_gpt2.h"
#include "train/hf_kimi_linear.h"

namespace kda::train {

using json = nlohmann::json;

json lineage_config_json(const LineageConfig& c) {
  return {{"model_type", "kda_lineage"},
          {"vocab_size", c.vocab},
          {"hidden_size", c.width},
          {"num_heads", c.heads},
          {"head_dim", c.head_dim},
          {"intermediate_size", c.mlp_hidden},
          {"layer_pattern", c.pattern},
          {"rms_norm_eps", c.norm_eps},
          {"kda_gate", c.kda_gate},
          {"gate_init_dt_max", c.gate_dt_max},
          {"gate_init_dt_per_channel", c.gate_dt_per_channel},
          {"hybrid_softmax_rope", c.hybrid_rope}};
}

LineageConfig lineage_config_from_json(const json& j) {
  require(j.at("model_type") == "kda_lineage", "model_type is not kda_lineage");
  LineageConfig c{j.at("vocab_size"),  j.at("hidden_size"),       j.at("num_heads"),
                  j.at("head_dim"),    j.at("intermediate_size"), j.at("layer_pattern"),
                  j.at("rms_norm_eps")};
  c.kda_gate = j.value("kda_gate", std::string("softplus"));  // both absent in older checkpoints
  c.gate_dt_max = j.value("gate_init_dt_max", 0.1f);
  c.gate_dt_per_channel = j.value("gate_init_dt_per_channel", false);
  c.hybrid_rope = j.value("hybrid_softmax_rope", false);
  return c;
}

namespace {

std::map<std::string, DeviceTrainableFactory>& training_devices() {
  static std::map<std::string, DeviceTrainableFactory> devices;
  return devices;
}

}  // namespace

void register_training_device(const std::string& device, DeviceTrainableFactory factory) {
  training_devices()[device] = std::move(factory);
}

std::unique_ptr<TrainableModel> move_to_device(const std::string& device, const json& config,
                                               std::unique_ptr<TrainableModel> host,
                                               const DeviceTrainingOptions& options) {
  if (device == "cpu") return host;
  const auto it = training_devices().find(device);
  require(it != training_devices().end(),
          "train: device '" + device + "' is not in this build (cpu" +
              (training_devices().empty() ? std::string(")") : std::string(", cuda)")));
  return it->second(config, std::move(host), options);
}

namespace {

std::string model_type_of(const json& config) {
  require(config.is_object() && config.contains("model_type") && config["model_type"].is_string(),
          "config: no model_type");
  return config["model_type"].get<std::string>();
}

}  // namespace

std::unique_ptr<TrainableModel> new_trainable(const json& config, uint64_t seed) {
  const std::string type = model_type_of(config);
  if (type == "kda_lineage") {
    const LineageConfig c = lineage_config_from_json(config);
    c.validate();
    return std::make_unique<LineageModel>(c, seed);
  }
  if (type == "kimi_linear") return KimiLinearTrainable::from_config(config, seed);
  if (type == "gpt2") return Gpt2Trainable::from_config(config, seed);
  throw Error("train: model_type '" + type +
              "' cannot be trained (kda_lineage, kimi_linear, gpt2)");
}

std::unique_ptr<TrainableModel> load_trainable(const std::string& dir) {
  const std::string type = model::ModelFolder::open(dir).model_type();
  if (type == "kimi_linear") return KimiLinearTrainable::from_folder(dir);
  if (type == "gpt2") return Gpt2Trainable::from_folder(dir);
  throw Error(dir + ": model_type '" + type + "' cannot be trained (kimi_linear, gpt2)");
}

int64_t config_vocab(const json& config) {
  return model_type_of(config) == "gpt2" ? model::config_int_or(config, "vocab_size", 50257)
                                         : model::config_int(config, "vocab_size");
}

std::string describe_architecture(const json& config) {
  const std::string type = model_type_of(config);
  if (type == "kda_lineage") {
    const LineageConfig c = lineage_config_from_json(config);
    return "lineage " + c.pattern + ", width " + std::to_string(c.width);
  }
  if (type == "kimi_linear") {
    const model::KimiLinearConfig c = model::KimiLinearConfig::parse(config);
    return "kimi_linear: " + std::to_string(c.num_layers) + " layers (" +
           std::to_string(c.count(model::KimiMixer::kda)) + " KDA + " +
           std::to_string(c.count(model::KimiMixer::mla)) + " MLA; " +
           std::to_string(c.count(model::KimiFfn::moe)) + " MoE of " +
           std::to_string(c.num_experts) + " experts), hidden " + std::to_string(c.hidden_size);
  }
  return type + ": " + std::to_string(model::config_int_or(config, "n_layer", 12)) +
         " layers, width " + std::to_string(model::config_int_or(config, "n_embd", 768));
}

}  // namespace kda::train
