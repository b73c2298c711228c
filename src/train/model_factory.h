// Training models by architecture: the lineage family (model_type "kda_lineage"), Kimi Linear
// ("kimi_linear") and GPT-2 ("gpt2"), from a config (fresh weights) or a Hugging Face folder.
#pragma once
#include <cstdint>
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
// One line: "kimi_linear: 4 layers (3 KDA + 1 MLA), hidden 256" or "lineage KKKA, width 256".
std::string describe_architecture(const nlohmann::json& config);

}  // namespace kda::train
