// Training models by architecture: the lineage family (model_type "kda_lineage"), Kimi Linear
// ("kimi_linear") and GPT-2 ("gpt2"), from a config (fresh weights) or a Hugging Face folder.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "train/lineage_model.h"
#include "train/trainable_model.h"

namespace kda::train {

// A lineage model's config.json fields (model_type "kda_lineage"), and back.
nlohmann::json lineage_config_json(const LineageConfig& c);
LineageConfig lineage_config_from_json(const nlohmann::json& j);

// Fresh weights for any supported config; throws kda::Error for another model_type.
std::unique_ptr<TrainableModel> new_trainable(const nlohmann::json& config, uint64_t seed);
// The weights of a model folder (kimi_linear or gpt2).
std::unique_ptr<TrainableModel> load_trainable(const std::string& dir);
int64_t config_vocab(const nlohmann::json& config);

// Training on another device ("cuda"): a factory takes the host model (fresh or loaded; its
// params() become the device model's host mirrors) and returns the model that runs there. The
// device's library registers it (train/cuda/cuda_training.h); the CPU build knows none.
// How a device trains (not a property of the model: the same weights train either way).
struct DeviceTrainingOptions {
  // Bit-reproducible steps (`--deterministic`): the one kernel that sums with atomics, the wgmma
  // softmax attention backward's dQ, gives way to the mma.sync pair (slower at head dim 128).
  // Everything else already is. A setting of the process, once set (the attention op's).
  bool deterministic = false;
};
using DeviceTrainableFactory = std::function<std::unique_ptr<TrainableModel>(
    const nlohmann::json& config, std::unique_ptr<TrainableModel> host,
    const DeviceTrainingOptions& options)>;
void register_training_device(const std::string& device, DeviceTrainableFactory factory);
// `host` itself for "cpu" (always deterministic); throws kda::Error for a device this build
// does not have.
std::unique_ptr<TrainableModel> move_to_device(const std::string& device,
                                               const nlohmann::json& config,
                                               std::unique_ptr<TrainableModel> host,
                                               const DeviceTrainingOptions& options = {});
// One line: "kimi_linear: 4 layers (3 KDA + 1 MLA), hidden 256" or "lineage KKKA, width 256".
std::string describe_architecture(const nlohmann::json& config);

}  // namespace kda::train
