#include "model/cuda/device_tensor.h"

#include "core/dtype.h"
#include "core/error.h"
#include "core/parallel.h"

namespace kda::model::cuda {

DeviceBuffer upload(std::span<const float> values, ElementType type) {
  DeviceBuffer buffer(values.size() * ops::cuda::element_bytes(type));
  if (values.empty()) return buffer;
  if (type == ElementType::f32) {
    buffer.upload(values.data(), values.size_bytes());
  } else {
    std::vector<uint16_t> bits(values.size());
    parallel_for(int64_t(values.size()), [&](int64_t i) { bits[i] = f32_to_bf16(values[i]); });
    buffer.upload(bits.data(), bits.size() * 2);
  }
  return buffer;
}

DeviceBuffer upload(const Tensor& t, ElementType type) {
  require(t.dtype() == DType::f32, "upload: expects an fp32 host tensor");
  return upload(std::span<const float>(t.f32(), size_t(t.numel())), type);
}

std::vector<float> download_f32(const void* device, int64_t n) {
  std::vector<float> out(static_cast<size_t>(n));
  if (n > 0)
    ops::cuda::check_cuda(cudaMemcpy(out.data(), device, size_t(n) * 4, cudaMemcpyDeviceToHost),
                          "cudaMemcpy (download)");
  return out;
}

}  // namespace kda::model::cuda
