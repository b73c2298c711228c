// Makes "cuda" a training device (train/model_factory.h's move_to_device): lineage models train
// on the GPU (train/cuda/lineage_cuda_model.h). The kda binary calls this once at start when it
// was built with CUDA.
#pragma once

namespace kda::train::cuda {

void register_cuda_training();

}  // namespace kda::train::cuda
