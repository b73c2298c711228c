// The backward of Kimi's KDA output norm on the GPU (nn_cuda.h's gated_rms_norm_sigmoid;
// ops/norm/norm.h's gated_rms_norm_sigmoid_backward is the CPU twin, same formulas):
//   y = w * n * s,  n = x inv,  inv = 1 / sqrt(mean(x^2) + eps),  s = sigmoid(gate)
//   dn = dy w s;  dx = inv (dn - n mean(dn n));  dgate = dy w n s (1 - s);  dw += sum_r dy n s
// DEVICE pointers, rows dense [rows, D]. dw is a sum over rows in a fixed order (row chunks
// summed in order, then the chunks in order): deterministic, no atomics.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/common/device_buffer.h"
#include "ops/common/device_types.h"
#include "ops/nn/cuda/nn_cuda.h"

namespace kda::ops::cuda {

// x of x_type (the forward's input), gate fp32, dy of dy_type; dx and dgate OutRows (written),
// dweight [D] ACCUMULATED. `partials` is scratch grown on demand (one per stream).
void gated_rms_norm_sigmoid_train_backward(const void* x, ElementType x_type, const float* gate,
                                           int64_t rows, int64_t D, const float* weight, float eps,
                                           const void* dy, ElementType dy_type, OutRows dx,
                                           OutRows dgate, float* dweight, DeviceBuffer& partials,
                                           cudaStream_t stream);

}  // namespace kda::ops::cuda
