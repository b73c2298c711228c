// Kimi Linear (KimiLinearForCausalLM, transformers' native `kimi_linear`): KDA and NoPE MLA
// token mixers under a dense MLP (first layers) or a sigmoid-routed MoE, on the CPU in fp32.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>

#include "model/causal_lm.h"
#include "model/model_folder.h"

namespace kda::model {

// Parameter counts, layer map and memory per sequence of a config.json (no weights needed).
// Throws kda::Error naming the bad field.
ArchitectureInfo describe_kimi_linear(const nlohmann::json& config);

// Checks every tensor name and shape against the config, then loads the weights as fp32.
std::unique_ptr<CausalLM> load_kimi_linear(const ModelFolder& folder);

}  // namespace kda::model
