// Tensor-memory-accelerator (TMA, sm_90) building blocks: bf16 tensor maps with the 128-byte
// swizzle that wgmma.cuh's K-major tiles use (chunk c of row r at r * 128 + ((c ^ (r % 8)) * 16),
// the destination 1024-byte aligned) and tiled loads completing on an mbarrier (the mbarrier
// operations of a producer / consumer ring: ops/common/async_copy.cuh).
#pragma once
#include <cuda.h>  // CUtensorMap (the type only: the encoder comes from the runtime's entry point)
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/common/async_copy.cuh"
#include "ops/delta_rule/cuda/device_common.cuh"

namespace kda::ops::cuda_detail {

// A bf16 tensor map of `rank` (2..5) dimensions, dims[0] contiguous; strides_bytes[i] is the
// stride of dimension i + 1 (multiples of 16); box[] the elements a load brings (box[0] * 2 <=
// 128: one swizzle row); out-of-bounds elements read as zero. False if the driver refuses.
bool encode_tensor_map_bf16(CUtensorMap* map, const void* base, int rank, const uint64_t* dims,
                            const uint64_t* strides_bytes, const uint32_t* box);

// One box of the tensor map at coordinates (c0, c1[, c2, c3]) into dst (1024-byte aligned for
// the 128-byte swizzle), its bytes counted on bar.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int c0, int c1,
                                            uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_addr(bar))
      : "memory");
}
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, int c0, int c1,
                                            int c2, int c3, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(bar))
      : "memory");
}

}  // namespace kda::ops::cuda_detail
