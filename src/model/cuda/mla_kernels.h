// Kernels of the MLA mixer on the GPU that are not generic layer ops (nn_cuda.h): laying out the
// expanded keys and values of every head from the kv_b product and the cached latent rows.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/common/device_types.h"

namespace kda::model::cuda {

// From kvb [Tk, H, nope + v] fp32 (the latent's kv_b product) and the cached latent rows
// rows [Tk, latent + rope] (type `type`, k_rope = the last rope values of a row), writes
// keys [Tk, H, nope + rope] = [k_nope_h ; k_rope] and values [Tk, H, v], both of type `type`.
void mla_expand_keys_values(const float* kvb, const void* rows, int64_t Tk, int64_t H, int64_t nope,
                            int64_t rope, int64_t v, int64_t latent, ops::cuda::ElementType type,
                            void* keys, void* values, cudaStream_t stream);

// cache_rows[length - 1, :] = row, with `length` read from device memory when the kernel runs
// (a decode step's new latent row, appended by a replayed CUDA graph). `width` elements of
// `type` per row.
void mla_append_row(const void* row, void* cache_rows, int64_t width, ops::cuda::ElementType type,
                    const int32_t* length_device, cudaStream_t stream);

}  // namespace kda::model::cuda
