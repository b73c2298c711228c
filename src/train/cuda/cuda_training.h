// Makes "cuda" a training device (train/model_factory.h's move_to_device): lineage models
// (train/cuda/lineage_cuda_model.h), GPT-2 (train/cuda/gpt2_cuda_trainable.h) and Kimi Linear
// (train/cuda/kimi_cuda_model.h) train on the GPU. The kda binary calls this once at start when it
// was built with CUDA.
#pragma once

namespace kda::train::cuda {

void register_cuda_training();

}  // namespace kda::train::cuda
