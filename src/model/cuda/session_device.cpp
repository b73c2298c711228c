#include "core/error.h"
#include "model/cuda/kimi_cuda_blocks.h"

namespace kda::model::cuda {

void copy_device_bytes(DeviceBuffer& dst, const DeviceBuffer& src, size_t bytes,
                       cudaStream_t stream) {
  if (bytes == 0) return;
  require(bytes <= src.bytes() && bytes <= dst.bytes(), "copy_device_bytes: past a buffer's end");
  ops::cuda::check_cuda(
      cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDeviceToDevice, stream),
      "cudaMemcpyAsync (session copy)");
}

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
