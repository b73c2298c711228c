#include <cuda_bf16.h>

#include "core/error.h"
#include "model/cuda/mla_kernels.h"
#include "ops/common/device_buffer.h"
#include "ops/delta_rule/cuda/device_common.cuh"

namespace kda::model::cuda {
namespace {

using ops::cuda_detail::from_f32;
using ops::cuda_detail::to_f32;

// One block per (token, head); threads stride over the head's nope + rope + v outputs.
template <class T>
__global__ void expand_kernel(const float* kvb, const T* rows, int64_t H, int64_t nope,
                              int64_t rope, int64_t v, int64_t latent, T* keys, T* values) {
  const int64_t t = blockIdx.x, h = blockIdx.y;
  const int64_t qk = nope + rope;
  const float* src = kvb + (t * H + h) * (nope + v);
  const T* row = rows + t * (latent + rope);
  T* key = keys + (t * H + h) * qk;
  T* value = values + (t * H + h) * v;
  for (int64_t i = threadIdx.x; i < qk + v; i += blockDim.x) {
    if (i < nope) {
      key[i] = from_f32<T>(src[i]);
    } else if (i < qk) {
      key[i] = row[latent + (i - nope)];
    } else {
      value[i - qk] = from_f32<T>(src[nope + (i - qk)]);
    }
  }
}

// One block; 4-byte units (a row of bf16 latent + rope values is 1152 bytes).
__global__ void append_row_kernel(const uint32_t* row, uint32_t* cache_rows, int64_t units,
                                  const int32_t* length_device) {
  const int64_t at = int64_t(*length_device - 1) * units;
  for (int64_t u = threadIdx.x; u < units; u += blockDim.x) cache_rows[at + u] = row[u];
}

}  // namespace

void mla_append_row(const void* row, void* cache_rows, int64_t width, ops::cuda::ElementType type,
                    const int32_t* length_device, cudaStream_t stream) {
  const int64_t bytes = width * int64_t(ops::cuda::element_bytes(type));
  require(bytes % 4 == 0, "mla_append_row: the row must be a whole number of 4-byte units");
  append_row_kernel<<<1, 256, 0, stream>>>(static_cast<const uint32_t*>(row),
                                           static_cast<uint32_t*>(cache_rows), bytes / 4,
                                           length_device);
  ops::cuda::check_cuda(cudaGetLastError(), "mla_append_row");
}

void mla_expand_keys_values(const float* kvb, const void* rows, int64_t Tk, int64_t H, int64_t nope,
                            int64_t rope, int64_t v, int64_t latent, ops::cuda::ElementType type,
                            void* keys, void* values, cudaStream_t stream) {
  require(Tk >= 0 && H > 0 && H <= 65535 && nope > 0 && rope >= 0 && v > 0 && latent > 0,
          "mla_expand_keys_values: bad sizes");
  if (Tk == 0) return;
  require(Tk <= 0x7fffffff, "mla_expand_keys_values: too many tokens");
  const dim3 grid{unsigned(Tk), unsigned(H), 1u};
  if (type == ops::cuda::ElementType::f32) {
    expand_kernel<float><<<grid, 128, 0, stream>>>(kvb, static_cast<const float*>(rows), H, nope,
                                                   rope, v, latent, static_cast<float*>(keys),
                                                   static_cast<float*>(values));
  } else {
    expand_kernel<__nv_bfloat16><<<grid, 128, 0, stream>>>(
        kvb, static_cast<const __nv_bfloat16*>(rows), H, nope, rope, v, latent,
        static_cast<__nv_bfloat16*>(keys), static_cast<__nv_bfloat16*>(values));
  }
  ops::cuda::check_cuda(cudaGetLastError(), "mla_expand_keys_values");
}

}  // namespace kda::model::cuda
