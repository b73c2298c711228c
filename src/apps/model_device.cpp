#include "apps/model_device.h"

#include "core/error.h"
#ifdef KDA_HAVE_CUDA
#include "model/cuda/cuda_models.h"
#endif

namespace kda::apps {

void parse_device(const std::string& value, ModelDevice& d) {
  require(value == "cpu" || value == "cuda",
          "option --device: expected cpu or cuda, got '" + value + "'");
  d.cuda = value == "cuda";
}

void parse_dtype(const std::string& value, ModelDevice& d) {
  require(value == "bf16" || value == "fp32",
          "option --dtype: expected bf16 or fp32, got '" + value + "'");
  d.bf16 = value == "bf16";
}

std::unique_ptr<model::CausalLM> load_model_on(const std::string& path, const ModelDevice& d) {
  if (!d.cuda) return model::load_causal_lm(path);
#ifdef KDA_HAVE_CUDA
  return model::cuda::load_causal_lm_cuda(
      path, d.bf16 ? ops::cuda::ElementType::bf16 : ops::cuda::ElementType::f32);
#else
  throw Error("--device cuda: this build has no CUDA path (built without nvcc)");
#endif
}

}  // namespace kda::apps
