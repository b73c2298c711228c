// load_causal_lm_cuda: dispatch on config["model_type"], as model/registry.cpp does for the CPU.
#include "core/error.h"
#include "model/cuda/cuda_models.h"
#include "model/model_folder.h"

namespace kda::model::cuda {

using ops::cuda::ElementType;

std::unique_ptr<CausalLM> load_kimi_linear_cuda(const ModelFolder& folder, ElementType type);
std::unique_ptr<CausalLM> load_gpt2_cuda(const ModelFolder& folder, ElementType type);

std::unique_ptr<CausalLM> load_causal_lm_cuda(const std::string& path, ElementType type) {
  const ModelFolder folder = ModelFolder::open(path);
  const std::string type_name = folder.model_type();
  if (type_name == "kimi_linear") return load_kimi_linear_cuda(folder, type);
  if (type_name == "gpt2") return load_gpt2_cuda(folder, type);
  throw Error(folder.dir() + "/config.json: model_type '" + type_name +
              "' has no CUDA path (kimi_linear, gpt2)");
}

}  // namespace kda::model::cuda
