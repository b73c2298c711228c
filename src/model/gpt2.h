// GPT-2 (transformers' GPT2LMHeadModel): learned positions, pre-LayerNorm blocks of causal
// softmax attention and a GELU MLP, tied embeddings. Checkpoints store Conv1D weights as
// [in, out]; they are transposed once at load to the [out, in] layout of ops::linear.
#pragma once
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "model/causal_lm.h"
#include "model/gpt2_config.h"
#include "model/model_folder.h"

namespace kda::model {

// Sizes, parameters and memory per sequence from a GPT-2 config.json alone.
ArchitectureInfo describe_gpt2(const nlohmann::json& config);
// The checkpoint's tensor-name prefix ("transformer." or none) and every tensor name and shape
// the folder must hold (for ModelFolder::check_tensors), shared with the GPU model and trainer.
std::string gpt2_prefix(const ModelFolder& folder);
std::map<std::string, Shape> gpt2_expected_tensors(const Gpt2Config& config,
                                                   const ModelFolder& folder);
// Validates the folder's tensors (names and shapes) and loads them as fp32.
std::unique_ptr<CausalLM> load_gpt2(const ModelFolder& folder);

}  // namespace kda::model
