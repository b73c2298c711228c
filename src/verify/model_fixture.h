// Holds a model folder against its reference.safetensors (the ../shared/fixtures/models
// format): logits of one forward pass (<= 1e-4 relative), the mean next-token loss (<= 1e-5),
// and the greedy continuation produced through the decode path (prefill, then one token at a
// time through the caches), which must be identical; with grads/model.safetensors, also the
// loss and every weight's gradient through the training model (<= 1e-3 relative per tensor).
// Rows reuse FixtureReport.
#pragma once
#include <functional>
#include <memory>
#include <string>

#include "model/causal_lm.h"
#include "verify/op_fixture.h"

namespace kda::verify {

constexpr double kLogitsTolerance = 1e-4;
constexpr double kLossTolerance = 1e-5;
constexpr double kModelGradientTolerance = 1e-3;

// True when `path` is a folder with config.json and reference.safetensors.
bool is_model_fixture(const std::string& path);
// `load` picks the model's device (default: model::load_causal_lm, the CPU). The gradient check
// (grads/) runs only with the default loader: training runs on the CPU.
using ModelLoader = std::function<std::unique_ptr<model::CausalLM>(const std::string&)>;
FixtureReport check_model_folder(const std::string& path, const ModelLoader& load = {});

}  // namespace kda::verify
