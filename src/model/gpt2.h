// GPT-2 (transformers' GPT2LMHeadModel): learned positions, pre-LayerNorm blocks of causal
// softmax attention and a GELU MLP, tied embeddings. Checkpoints store Conv1D weights as
// [in, out]; they are transposed once at load to the [out, in] layout of ops::linear.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>

#include "model/causal_lm.h"
#include "model/model_folder.h"

namespace kda::model {

// Sizes, parameters and memory per sequence from a GPT-2 config.json alone.
ArchitectureInfo describe_gpt2(const nlohmann::json& config);
// Validates the folder's tensors (names and shapes) and loads them as fp32.
std::unique_ptr<CausalLM> load_gpt2(const ModelFolder& folder);

}  // namespace kda::model
