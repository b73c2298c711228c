// Building blocks shared by the delta-rule state walks on wgmma (chunk_state_wgmma.cu,
// chunk_state_bwd_wgmma.cu): one warpgroup per block, chunk-sized (64-row) operands in
// 128-byte-swizzled tiles of 64 bf16 columns (wgmma.cuh's K-major layout), register A fragments
// by ldmatrix .trans, and accumulators or fragments stored transposed by stmatrix .trans.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "ops/common/wgmma.cuh"
#include "ops/delta_rule/cuda/chunk_kernels.cuh"
#include "ops/delta_rule/cuda/device_common.cuh"

namespace kda::ops::cuda_detail::walk_wgmma {

constexpr int kThreads = 128;     // one warpgroup
constexpr int kCols = 64;         // state columns per block
constexpr uint32_t kTile = 8192;  // one swizzled tile: 64 rows of 128 bytes (64 bf16)

// A 64-column tile of an fp32 state [K][ld] in the accumulator layout of the walks: s[mt][4 j + e]
// is row 64 mt + 16 warp + g + 8 (e >> 1), column 8 j + 2 t + (e & 1) (g = lane / 4, t = lane % 4).
// Read from `src` (null: zeros) or written to `dst`, both at the tile's first column.
template <int MT>
__device__ __forceinline__ void load_state_tile(float (&s)[MT][32], const float* src, int64_t ld,
                                                int warp, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 64 * mt + 16 * warp + g + 8 * half, c = 8 * j + 2 * t;
        float2 v = make_float2(0.f, 0.f);
        if (src) v = *reinterpret_cast<const float2*>(src + size_t(r) * ld + c);
        s[mt][4 * j + 2 * half] = v.x;
        s[mt][4 * j + 2 * half + 1] = v.y;
      }
}
template <int MT>
__device__ __forceinline__ void store_state_tile(float* dst, const float (&s)[MT][32], int64_t ld,
                                                 int warp, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 64 * mt + 16 * warp + g + 8 * half, c = 8 * j + 2 * t;
        *reinterpret_cast<float2*>(dst + size_t(r) * ld + c) =
            make_float2(s[mt][4 * j + 2 * half], s[mt][4 * j + 2 * half + 1]);
      }
}

// A walk kernel's dynamic shared memory (past the default 48 KB) and all of L1 as shared memory.
template <class Kernel>
void configure_walk_kernel(Kernel kernel, size_t bytes, const char* what) {
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)),
             what);
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                  int(cudaSharedmemCarveoutMaxShared)),
             what);
}

#ifdef KDA_WGMMA
// Rows [0, kChunk) of a [kChunk][kWidth] bf16 operand (row stride `stride` elements) into
// 64-wide swizzled tiles kTile apart, by cp.async; rows >= valid are zero-filled.
template <int kWidth>
__device__ __forceinline__ void load_sw128(unsigned char* dst, const __nv_bfloat16* src,
                                           int64_t stride, int valid, int tid) {
  load_rows_sw128<kThreads, kWidth>(dst, kTile, src, stride, kChunk, valid, tid);
}

// The register A fragment (16 x 16) of A = X^T at (m0, k0), X [rows][...] in swizzled tiles:
// A(m, k) = X[k][m] (load_a_trans's addressing through sw128_offset).
__device__ __forceinline__ void load_a_trans_sw128(uint32_t (&a)[4], const unsigned char* x, int m0,
                                                   int k0, int lane) {
  const int r = k0 + (lane & 7) + (lane >> 4) * 8, c = m0 + ((lane >> 3) & 1) * 8;
  ldmatrix_x4_trans(a, x + (c >> 6) * kTile + sw128_offset(r, c & 63));
}

// A 16 x 16 block in the m16k16 fragment order (matrix j: rows + 8 (j & 1), columns
// + 8 (j >> 1)) at (row0, col0) of a warp's rows, stored transposed into a swizzled tile: tile
// row = column, tile column = row.
__device__ __forceinline__ void store_fragment_transposed(unsigned char* tile,
                                                          const uint32_t (&fr)[4], int row0,
                                                          int col0, int lane) {
  const int j = lane >> 3, i = lane & 7;
  stmatrix_x4_trans(tile + sw128_offset(col0 + 8 * (j >> 1) + i, row0 + 8 * (j & 1)), fr);
}

// A 64 x 64 accumulator's bf16 pairs of this warp's rows (pairs[n][half]: columns 8 n + 2 t,
// + 1 of row 16 warp + g + 8 half) stored transposed into a swizzled tile.
__device__ __forceinline__ void store_transposed(unsigned char* tile, const uint32_t (&pairs)[8][2],
                                                 int warp, int lane) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const uint32_t fr[4] = {pairs[2 * kk][0], pairs[2 * kk][1], pairs[2 * kk + 1][0],
                            pairs[2 * kk + 1][1]};
    store_fragment_transposed(tile, fr, 16 * warp, 16 * kk, lane);
  }
}

// A state tile (load_state_tile's layout) as bf16: transposed into swizzled tiles (m-tile mt at
// tiles + mt * kTile: the K-major B operand [columns][K] of the walks' products), and as it is
// into `copy` [K][ld] at the tile's first column when not null (what the backward reads).
template <int MT>
__device__ __forceinline__ void store_state_bf16(unsigned char* tiles, __nv_bfloat16* copy,
                                                 int64_t ld, const float (&s)[MT][32], int warp,
                                                 int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    uint32_t pairs[8][2];
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        pairs[j][half] = pack_bf16(s[mt][4 * j + 2 * half], s[mt][4 * j + 2 * half + 1]);
        if (copy) {
          const int r = 64 * mt + 16 * warp + g + 8 * half;
          *reinterpret_cast<uint32_t*>(copy + size_t(r) * ld + 8 * j + 2 * t) = pairs[j][half];
        }
      }
    store_transposed(tiles + mt * kTile, pairs, warp, lane);
  }
}
#endif

}  // namespace kda::ops::cuda_detail::walk_wgmma
