#include "model/cuda/kimi_cuda_blocks.h"

namespace kda::model::cuda {

SessionDevice::SessionDevice(ElementType type) {
  ops::cuda::check_cuda(cudaStreamCreate(&stream_), "cudaStreamCreate");
  gemm_ = std::make_unique<ops::cuda::Gemm>(stream_);
  ctx_ = std::make_unique<Context>(Context{*gemm_, type, {}, {}});
}

SessionDevice::~SessionDevice() {
  ctx_.reset();
  gemm_.reset();  // the handle before its stream
  if (stream_) cudaStreamDestroy(stream_);
}

}  // namespace kda::model::cuda
