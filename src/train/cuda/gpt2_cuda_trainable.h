// GPT-2 trained on the GPU behind the trainer's TrainableModel face: the host Gpt2Trainable
// (fresh or loaded) keeps the parameters' names and host mirrors; model::cuda::Gpt2CudaTrainer
// (src/model/cuda/gpt2_cuda_train.h: fp32 masters, bf16 GEMMs, flash attention, fused
// cross-entropy, AdamW on the device) does the work. Checkpoints are the CPU run's files.
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <vector>

#include "model/cuda/gpt2_cuda_train.h"
#include "train/hf_gpt2.h"
#include "train/trainable_model.h"

namespace kda::train::cuda {

class Gpt2CudaTrainable final : public TrainableModel {
 public:
  explicit Gpt2CudaTrainable(std::unique_ptr<Gpt2Trainable> host);

  std::vector<Param*> params() override { return host_->params(); }
  StepResult forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                              bool backward, std::span<const int64_t> cu_seqlens = {}) override;
  void zero_grad() override { device_->zero_gradients(); }
  void scale_grads(float s) override { device_->scale_gradients(s); }
  std::unique_ptr<Optimizer> make_optimizer(const AdamWConfig& config) override;
  void pull_values() override;
  void push_values() override;

  model::cuda::Gpt2CudaTrainer& device() { return *device_; }

 private:
  std::unique_ptr<Gpt2Trainable> host_;
  std::unique_ptr<model::cuda::Gpt2CudaTrainer> device_;
};

}  // namespace kda::train::cuda
