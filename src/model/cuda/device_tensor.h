// Host fp32 arrays moved to the device in the engine's weight type (fp32, or bf16 rounded to
// nearest even), and device fp32 arrays brought back.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "core/tensor.h"
#include "ops/common/device_buffer.h"
#include "ops/common/device_types.h"

namespace kda::model::cuda {

using ops::cuda::DeviceBuffer;
using ops::cuda::ElementType;

// `values` as `type` in a new device buffer.
DeviceBuffer upload(std::span<const float> values, ElementType type);
// An fp32 host Tensor as `type`.
DeviceBuffer upload(const Tensor& t, ElementType type);
// n fp32 values at a device address.
std::vector<float> download_f32(const void* device, int64_t n);

}  // namespace kda::model::cuda
