// Where a model runs: `--device cpu|cuda` and `--dtype fp32|bf16` (CUDA only) for the commands
// that load models (run, verify).
#pragma once
#include <memory>
#include <string>

#include "model/causal_lm.h"

namespace kda::apps {

struct ModelDevice {
  bool cuda = false;
  bool bf16 = true;  // CUDA weights and GEMM inputs; fp32 is the exact path
  std::string describe() const { return cuda ? (bf16 ? "cuda bf16" : "cuda fp32") : "cpu"; }
};

// Parses the value of --device / --dtype into `d`; throws kda::Error on anything else.
void parse_device(const std::string& value, ModelDevice& d);
void parse_dtype(const std::string& value, ModelDevice& d);

// load_causal_lm on the chosen device. Throws kda::Error when this build has no CUDA.
std::unique_ptr<model::CausalLM> load_model_on(const std::string& path, const ModelDevice& d);

}  // namespace kda::apps
