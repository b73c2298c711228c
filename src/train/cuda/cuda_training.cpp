#include "train/cuda/cuda_training.h"

#include <memory>
#include <string>

#include "core/error.h"
#include "ops/attention/cuda/attention_cuda.h"
#include "train/cuda/gpt2_cuda_trainable.h"
#include "train/cuda/kimi_cuda_model.h"
#include "train/cuda/lineage_cuda_model.h"
#include "train/model_factory.h"

namespace kda::train::cuda {

void register_cuda_training() {
  register_training_device(
      "cuda", [](const nlohmann::json& config, std::unique_ptr<TrainableModel> host,
                 const DeviceTrainingOptions& options) {
        const std::string type = config.value("model_type", std::string());
        if (options.deterministic) ops::cuda::set_attention_backward_deterministic(true);
        if (auto* lineage = dynamic_cast<LineageModel*>(host.get())) {
          host.release();
          return std::unique_ptr<TrainableModel>(
              std::make_unique<LineageCudaModel>(std::unique_ptr<LineageModel>(lineage)));
        }
        if (auto* gpt2 = dynamic_cast<Gpt2Trainable*>(host.get())) {
          host.release();
          return std::unique_ptr<TrainableModel>(
              std::make_unique<Gpt2CudaTrainable>(std::unique_ptr<Gpt2Trainable>(gpt2)));
        }
        if (auto* kimi = dynamic_cast<KimiLinearTrainable*>(host.get())) {
          host.release();
          return std::unique_ptr<TrainableModel>(
              std::make_unique<KimiCudaModel>(std::unique_ptr<KimiLinearTrainable>(kimi)));
        }
        throw Error("train --device cuda: model_type '" + type +
                    "' trains on the CPU only (the GPU trains kda_lineage, gpt2 and kimi_linear)");
      });
}

}  // namespace kda::train::cuda
