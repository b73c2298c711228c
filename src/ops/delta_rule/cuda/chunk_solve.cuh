// X = (I + L)^-1 for a chunk's 64 x 64 strictly lower-triangular L (fp32 in shared memory, row
// stride LD), by 16 x 16 blocks: the four diagonal blocks by forward substitution, then the
// off-diagonal ones in three merge stages on the tensor cores. Shared by chunk_prepare and
// chunk_prepare_exact (blocks of 8 warps).
#pragma once
#include "ops/delta_rule/cuda/device_common.cuh"

namespace kda::ops::cuda_detail {

// X(I, I) = (I + L(I, I))^-1 for I = block: called by 16 lanes of one warp (a column each);
// writes the whole diagonal blocks of sX (zeros above their diagonals).
template <int LD>
__device__ __forceinline__ void invert_diagonal_blocks(const float* sL, float* sX, int block,
                                                       int lane) {
  const int I = block, c = lane;
  const float* Lb = sL + 16 * I * LD + 16 * I;
  float col[16];
#pragma unroll
  for (int r = 0; r < 16; ++r) {
    float s = r == c ? 1.f : 0.f;
#pragma unroll
    for (int m = 0; m < r; ++m) s -= Lb[r * LD + m] * col[m];
    col[r] = s;
  }
#pragma unroll
  for (int r = 0; r < 16; ++r) sX[(16 * I + r) * LD + 16 * I + c] = col[r];
}

// The blocks below the diagonal, after invert_diagonal_blocks and a barrier: stage d forms the
// blocks (I, J) with I - J = d, X(I, J) = -X(I, I) sum_kb L(I, kb) X(kb, J), on the tensor cores
// (3xTF32, about fp32's precision): one warp per 8-column strip of a block, Y and then X(I, J)
// inside the warp, so one barrier a stage (session 20: GDN forward -3 % at 8 x 2048 against
// scalar float4 merges with two). Y of block J lives in L's upper block (J, 3), which the caller
// leaves unused. Every thread of the block calls it; it ends with a barrier.
template <int LD>
__device__ __forceinline__ void merge_inverse_blocks(float* sL, float* sX, int warp, int lane) {
  static_assert(LD % 2 == 0, "float2 stores");
  const int gr = lane >> 2, tq = lane & 3;
  float* const sY = sL + 48;
  for (int d = 1; d < 4; ++d) {
    if (warp < 2 * (4 - d)) {
      const int J = warp >> 1, I = J + d, strip = 8 * (warp & 1), n0 = 16 * J + strip;
      float y[4] = {};
      for (int k0 = 16 * J; k0 < 16 * I; k0 += 8) {
        const float* la = sL + (16 * I + gr) * LD + k0 + tq;
        const float* xb = sX + (k0 + tq) * LD + n0 + gr;
        const float a[4] = {la[0], la[8 * LD], la[4], la[8 * LD + 4]};
        const float b[2] = {xb[0], xb[4 * LD]};
        mma_fp32_3xtf32(y, a, b);
      }
      float* ys = sY + 16 * J * LD + strip;
      *reinterpret_cast<float2*>(ys + gr * LD + 2 * tq) = make_float2(y[0], y[1]);
      *reinterpret_cast<float2*>(ys + (gr + 8) * LD + 2 * tq) = make_float2(y[2], y[3]);
      __syncwarp();
      float xo[4] = {};
#pragma unroll
      for (int k0 = 0; k0 < 16; k0 += 8) {
        const float* xa = sX + (16 * I + gr) * LD + 16 * I + k0 + tq;
        const float* yb = ys + (k0 + tq) * LD + gr;
        const float a[4] = {xa[0], xa[8 * LD], xa[4], xa[8 * LD + 4]};
        const float b[2] = {yb[0], yb[4 * LD]};
        mma_fp32_3xtf32(xo, a, b);
      }
      float* xs = sX + (16 * I + gr) * LD + n0 + 2 * tq;
      *reinterpret_cast<float2*>(xs) = make_float2(-xo[0], -xo[1]);
      *reinterpret_cast<float2*>(xs + 8 * LD) = make_float2(-xo[2], -xo[3]);
    }
    __syncthreads();
  }
}

}  // namespace kda::ops::cuda_detail
