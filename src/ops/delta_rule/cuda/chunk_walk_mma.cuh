// Pieces shared by the mma.sync state walks (chunk_state.cu, chunk_state_split.cu). A warp holds
// its rows of the state in fp32 registers across chunks, in the m16n8 accumulator layout:
// S[mt][nt][e] is row mrow0 + 16 mt + g + 8 (e >> 1), column 8 nt + 2 t + (e & 1) of its tile
// (g = lane / 4, t = lane % 4).
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "ops/delta_rule/cuda/chunk_kernels.cuh"
#include "ops/delta_rule/cuda/device_common.cuh"

namespace kda::ops::cuda_detail::walk_mma {

// The warp's rows from `src` ([K][ld] fp32 at the tile's first column; null: zeros).
template <int MT, int NB>
__device__ __forceinline__ void load_state_rows(float (&S)[MT][NB][4], const float* src, int64_t ld,
                                                int mrow0, int lane) {
  const int gr = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NB; ++nt) {
      const int r = mrow0 + 16 * mt + gr, c = 8 * nt + 2 * tq;
      float2 a = make_float2(0.f, 0.f), b = a;
      if (src) {
        a = *reinterpret_cast<const float2*>(src + size_t(r) * ld + c);
        b = *reinterpret_cast<const float2*>(src + size_t(r + 8) * ld + c);
      }
      S[mt][nt][0] = a.x, S[mt][nt][1] = a.y, S[mt][nt][2] = b.x, S[mt][nt][3] = b.y;
    }
}

template <int MT, int NB>
__device__ __forceinline__ void store_state_rows(float* dst, const float (&S)[MT][NB][4],
                                                 int64_t ld, int mrow0, int lane) {
  const int gr = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NB; ++nt) {
      const int r = mrow0 + 16 * mt + gr, c = 8 * nt + 2 * tq;
      *reinterpret_cast<float2*>(dst + size_t(r) * ld + c) =
          make_float2(S[mt][nt][0], S[mt][nt][1]);
      *reinterpret_cast<float2*>(dst + size_t(r + 8) * ld + c) =
          make_float2(S[mt][nt][2], S[mt][nt][3]);
    }
}

// S = diag(exp(G_C)) S0 + Kd^T D for the warp's rows: kd [C][LDK] (Kd, or RAW the k rows), dk
// [C][LDS] from column col (D, or RAW Dk = 2^(G_C - G_j) D), gc exp(G_C) per state row (RAW: G
// per chunk row, the decay 2^G_C).
template <int MT, int NB, int LDK, int LDS, bool RAW>
__device__ __forceinline__ void update_state(float (&S)[MT][NB][4], const __nv_bfloat16* kd,
                                             const __nv_bfloat16* dk, int col, const float* gc,
                                             int mrow0, int lane) {
  const int gr = lane >> 2;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int m0 = mrow0 + 16 * mt;
    float ga, gb;
    if constexpr (RAW) {
      ga = gb = fast_exp2(gc[kChunk - 1]);
    } else {
      ga = gc[m0 + gr], gb = gc[m0 + gr + 8];
    }
#pragma unroll
    for (int nt = 0; nt < NB; ++nt) {
      S[mt][nt][0] *= ga, S[mt][nt][1] *= ga;
      S[mt][nt][2] *= gb, S[mt][nt][3] *= gb;
    }
#pragma unroll
    for (int J = 0; J < kChunk / 16; ++J) {
      uint32_t a[4];
      load_a_trans(a, kd, LDK, m0, 16 * J, lane);
#pragma unroll
      for (int np = 0; np < NB / 2; ++np) {
        uint32_t b[4];
        load_b_kn(b, dk, LDS, 16 * J, col + 16 * np, lane);
        mma_bf16(S[mt][2 * np], a, b[0], b[1]);
        mma_bf16(S[mt][2 * np + 1], a, b[2], b[3]);
      }
    }
  }
}

// A chunk's rows of a W-wide tile (copy_rows_async, device_common.cuh).
template <int W, int LD, int threads>
__device__ __forceinline__ void copy_rows(__nv_bfloat16* dst, const __nv_bfloat16* src,
                                          int64_t stride, int len, int tid) {
  copy_rows_async<W, LD, threads, kChunk>(dst, src, stride, len, tid);
}

// RAW: a K-wide tile of q or k rows (token-major input, head h) by `threads` threads, zero past
// the chunk's length.
template <int K, int LDK, int threads>
__device__ __forceinline__ void load_raw_rows(__nv_bfloat16* dst, const __nv_bfloat16* src,
                                              const WalkedChunks& walk, int64_t chunk, int H, int h,
                                              int tid) {
  copy_rows<K, LDK, threads>(dst, src + (size_t(walk.tok0(chunk)) * H + h) * K, int64_t(H) * K,
                             walk.len(chunk), tid);
}

}  // namespace kda::ops::cuda_detail::walk_mma
