// Tensor-core causal flash attention for bf16 prefill (FlashAttention-2 style).
//
// A block of 4 warps owns 64 or 128 queries of one head (each warp 16 or 32 query rows: MT m16
// tiles) and walks the key tiles (64 keys) that any of its queries sees, K/V tiles
// double-buffered through cp.async.
// Per tile: S = Q K^T (mma.sync m16n8k16, fp32 accumulators), scaled into log2 units and masked
// (causal with q_offset, keys past Tk), online softmax on the rows each thread holds (the max
// reduced over the quad of lanes sharing a row), P repacked from the S accumulators straight
// into A fragments (bf16), O += P V. Head dims are zero-padded inside: Dk to a multiple of 16
// (zero Q / K columns add nothing), Dv to the instantiation's DVP (pad columns are not written).
// Query tiles run heaviest (last) first over the whole grid so the causal triangle balances over
// the SMs (attention_tile_grid); sequence b reads and writes at its batch strides.
//
// Fast-path requirements (else the caller falls back to the generic kernel): Dk, Dv and the
// three row strides (and batch strides) multiples of 8 elements, q / k / v 16-byte aligned, the
// shared memory fits.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "ops/attention/cuda/attention_kernels.cuh"
#include "ops/common/device_attributes.h"
#include "ops/delta_rule/cuda/device_common.cuh"

namespace kda::ops::cuda_detail {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kBN = kAttentionKeyTile;  // keys per tile
constexpr int kPad = 8;                 // bf16 elements of row padding (ldmatrix bank spread)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Copies `rows` rows of `chunks` 16-byte chunks into smem (row stride ld); rows >= rows_valid
// and chunks >= chunks_valid are zero-filled. src points at row 0 (stride src_stride elements).
__device__ __forceinline__ void load_tile(bf16* dst, int ld, const bf16* src, int64_t src_stride,
                                          int rows, int rows_valid, int chunks, int chunks_valid,
                                          int tid) {
  const int total = rows * chunks;
  for (int idx = tid; idx < total; idx += kThreads) {
    const int r = idx / chunks, c = idx - r * chunks;
    bf16* d = dst + r * ld + c * 8;
    if (r < rows_valid && c < chunks_valid)
      cp_async16(d, src + int64_t(r) * src_stride + c * 8);
    else
      *reinterpret_cast<uint4*>(d) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// DKQ > 0: Dk padded is exactly DKQ and (MT = 1) the warp's Q fragments stay in registers;
// DKQ == 0: any padded Dk (dkp, a multiple of 16), Q fragments re-read from shared memory per
// key tile. DVP: padded Dv (a multiple of 16). MT: m16 row tiles per warp. With MT = 2 (32
// query rows a warp, 128 a block, as FlashAttention-2) every K / V fragment read from shared
// memory feeds two products instead of one, halving the shared-memory traffic per product that
// caps mma.sync at 16 rows a warp; Q fragments then come from shared memory (registers go to the
// second tile's accumulators).
template <int DKQ, int DVP, int MT>
__global__ void __launch_bounds__(kThreads) attention_prefill_kernel(AttentionParams p, int dkp) {
  constexpr int BM = 16 * MT * kWarps;         // queries per block
  constexpr int SN = MT == 1 ? kBN : kBN / 2;  // keys per sub-tile
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // compile-time strides when the head dim is (the ldmatrix offsets become immediates)
  const int ldk = (DKQ > 0 ? DKQ : dkp) + kPad;
  constexpr int ldv = DVP + kPad;
  bf16* Qs = reinterpret_cast<bf16*>(smem_raw);  // [BM][ldk]
  bf16* Ks = Qs + BM * ldk;                      // [2][kBN][ldk]
  bf16* Vs = Ks + 2 * kBN * ldk;                 // [2][kBN][ldv]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const AttentionBlockTile at = attention_block_tile(p.Hq, p.batch);
  const int64_t tiles = (p.Tq + BM - 1) / BM;
  const int64_t q0 = (tiles - 1 - at.rank) * BM;  // the last query tile is the heaviest
  const int h = at.head;
  const int64_t b = at.seq;
  const int kvh = h / p.group;
  const int Dk = p.Dk, Dv = p.Dv;
  const int warp_row0 = warp * 16 * MT;  // this warp's first row in the block

  const int64_t q_rows = min(int64_t(BM), p.Tq - q0);  // >= 1
  const int64_t kv_end = min(p.Tk, p.q_offset + q0 + q_rows);
  const int ntiles = int((kv_end + kBN - 1) / kBN);

  const bf16* qsrc =
      static_cast<const bf16*>(p.q) + b * p.q_bstride + q0 * p.q_stride + int64_t(h) * Dk;
  const bf16* kbase = static_cast<const bf16*>(p.k) + b * p.k_bstride + int64_t(kvh) * Dk;
  const bf16* vbase = static_cast<const bf16*>(p.v) + b * p.v_bstride + int64_t(kvh) * Dv;
  const int kchunks = (DKQ > 0 ? DKQ : dkp) / 8, kchunks_valid = Dk / 8;
  const int vchunks = DVP / 8, vchunks_valid = Dv / 8;

  auto load_kv = [&](int tile, int buf) {
    const int64_t key0 = int64_t(tile) * kBN;
    const int valid = int(min(int64_t(kBN), p.Tk - key0));
    load_tile(Ks + buf * kBN * ldk, ldk, kbase + key0 * p.k_stride, p.k_stride, kBN, valid, kchunks,
              kchunks_valid, tid);
    load_tile(Vs + buf * kBN * ldv, ldv, vbase + key0 * p.v_stride, p.v_stride, kBN, valid, vchunks,
              vchunks_valid, tid);
  };

  load_tile(Qs, ldk, qsrc, p.q_stride, BM, int(q_rows), kchunks, kchunks_valid, tid);
  load_kv(0, 0);
  cp_async_commit();

  // Q (and tile 0) in place before the loop; the Q fragments of DKQ > 0, MT = 1 go to registers.
  cp_async_wait<0>();
  __syncthreads();
  constexpr bool kQInRegisters = DKQ > 0 && MT == 1;
  constexpr int kQFrags = kQInRegisters ? DKQ / 16 : 1;
  uint32_t qf[kQFrags][4];
  if constexpr (kQInRegisters) {
#pragma unroll
    for (int ks = 0; ks < kQFrags; ++ks) load_a(qf[ks], Qs, ldk, warp_row0, ks * 16, lane);
  }

  float o[MT][DVP / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int n = 0; n < DVP / 8; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
  // rows g and g + 8 of each m-tile (log2 units); l_run: this thread's share of the row sums
  float m_run[MT][2], l_run[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    m_run[mt][0] = m_run[mt][1] = -INFINITY, l_run[mt][0] = l_run[mt][1] = 0.f;
  const float scale_log2 = p.scale * kLog2e;
  // Query position of this thread's row r of m-tile mt: qpos_base + 16 mt + 8 r (padded rows
  // past Tq see every key: harmless, they are never written).
  const int64_t qpos_base = p.q_offset + q0 + warp_row0 + g;

  for (int j = 0; j < ntiles; ++j) {
    const int buf = j & 1;
    if (j + 1 < ntiles) {
      load_kv(j + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    const bf16* Kb = Ks + buf * kBN * ldk;
    const bf16* Vb = Vs + buf * kBN * ldv;

    // The tile in sub-tiles of SN keys (MT = 2: 32, so the S accumulators of two m-tiles fit
    // in registers beside O without spilling), each: S, online softmax, O += P V.
#pragma unroll 1  // (unrolled, the compiler keeps both sub-tiles' Q fragments: spills)
    for (int sub0 = 0; sub0 < kBN; sub0 += SN) {
      // S = Q K^T for this warp's 16 MT rows x SN keys; each K fragment feeds MT products.
      float s[MT][SN / 8][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < SN / 8; ++n)
          s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
      const auto s_step = [&](int ks) {  // one 16-wide slice of the head dim
        uint32_t a[MT][4];
        if constexpr (kQInRegisters) {
#pragma unroll
          for (int i = 0; i < 4; ++i) a[0][i] = qf[ks][i];
        } else {
#pragma unroll
          for (int mt = 0; mt < MT; ++mt)
            load_a(a[mt], Qs, ldk, warp_row0 + 16 * mt, ks * 16, lane);
        }
#pragma unroll
        for (int np = 0; np < SN / 16; ++np) {
          uint32_t bk[4];
          load_b_nk(bk, Kb, ldk, ks * 16, sub0 + np * 16, lane);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_bf16(s[mt][2 * np], a[mt], bk[0], bk[1]);
            mma_bf16(s[mt][2 * np + 1], a[mt], bk[2], bk[3]);
          }
        }
      };
      if constexpr (DKQ > 0) {
#pragma unroll
        for (int ks = 0; ks < DKQ / 16; ++ks) s_step(ks);
      } else {
        for (int ks = 0; ks < dkp / 16; ++ks) s_step(ks);
      }

      // Mask keys past a row's position (and past Tk), then the online softmax in log2 units:
      // the row max is taken on the raw scores (scale > 0 keeps the order, and
      // fl(max s * c) = max fl(s * c)), so each probability is one FMA and one exp2.
      const int64_t key0 = int64_t(j) * kBN + sub0;
      const bool need_mask = key0 + SN - 1 > p.q_offset + q0 || key0 + SN > p.Tk;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        // the last visible key of rows g and g + 8, relative to key0 (clamped into [-1, SN])
        int last[2] = {SN, SN};
        if (need_mask) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int64_t qpos = qpos_base + 16 * mt + 8 * r;
            last[r] = int(max(int64_t(-1), min(int64_t(SN), min(qpos, p.Tk - 1) - key0)));
          }
        }
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < SN / 8; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (need_mask && n * 8 + 2 * t4 + (e & 1) > last[e >> 1]) s[mt][n][e] = -INFINITY;
            mx[e >> 1] = fmaxf(mx[e >> 1], s[mt][n][e]);
          }
        }
        float alpha[2], m_use[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
          mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
          const float m_new = fmaxf(m_run[mt][r], mx[r] * scale_log2);
          m_use[r] = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing visible yet
          alpha[r] = fast_exp2(m_run[mt][r] - m_use[r]);
          m_run[mt][r] = m_new;
        }
        float rowsum[2] = {0.f, 0.f};
#pragma unroll
        for (int n = 0; n < SN / 8; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float pv = fast_exp2(fmaf(s[mt][n][e], scale_log2, -m_use[e >> 1]));
            s[mt][n][e] = pv;
            rowsum[e >> 1] += pv;
          }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) l_run[mt][r] = l_run[mt][r] * alpha[r] + rowsum[r];
        // Rescale O only when a row's max moved (multiplying by exactly 1 changes nothing): past
        // the first tiles most rows keep their max, and the rescale is one FMUL per product.
        if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
          for (int n = 0; n < DVP / 8; ++n) {
            o[mt][n][0] *= alpha[0];
            o[mt][n][1] *= alpha[0];
            o[mt][n][2] *= alpha[1];
            o[mt][n][3] *= alpha[1];
          }
        }
      }

      // O += P V: the S accumulators of key n-tiles 2kk, 2kk+1 are the A fragment of keys
      // [16kk, 16kk + 16) (C layout (g, 2t | 2t+1), (g+8, ...) matches A's (g, 2t), (g+8, 2t),
      // (g, 2t+8), (g+8, 2t+8)); each V fragment feeds MT products.
#pragma unroll
      for (int kk = 0; kk < SN / 16; ++kk) {
        uint32_t a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          a[mt][0] = pack_bf16(s[mt][2 * kk][0], s[mt][2 * kk][1]);
          a[mt][1] = pack_bf16(s[mt][2 * kk][2], s[mt][2 * kk][3]);
          a[mt][2] = pack_bf16(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
          a[mt][3] = pack_bf16(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int dn = 0; dn < DVP / 16; ++dn) {
          uint32_t bv[4];
          load_b_kn(bv, Vb, ldv, sub0 + kk * 16, dn * 16, lane);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            mma_bf16(o[mt][2 * dn], a[mt], bv[0], bv[1]);
            mma_bf16(o[mt][2 * dn + 1], a[mt], bv[2], bv[3]);
          }
        }
      }
    }
    __syncthreads();  // everyone is done with buffer `buf` before it is refilled
  }

  // Row sums over the quad, normalise, write the valid rows and columns.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l_run[mt][r] += __shfl_xor_sync(0xffffffffu, l_run[mt][r], 1);
      l_run[mt][r] += __shfl_xor_sync(0xffffffffu, l_run[mt][r], 2);
    }
    const float inv[2] = {1.f / l_run[mt][0], 1.f / l_run[mt][1]};
    // lse in natural units: l_run is relative to m_run (log2 units), finite for every row.
    if (p.lse != nullptr && t4 == 0) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t qi = q0 + warp_row0 + 16 * mt + g + r * 8;
        if (qi < p.Tq)
          p.lse[b * p.lse_bstride + qi * p.Hq + h] = (m_run[mt][r] + log2f(l_run[mt][r])) * kLn2;
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t qi = q0 + warp_row0 + 16 * mt + g + r * 8;
      if (qi >= p.Tq) continue;
      const int64_t orow = b * p.o_bstride + (qi * p.Hq + h) * int64_t(Dv);
      if (p.o_bf16 != nullptr) {  // Dv is even: whole pairs
        bf16* out = static_cast<bf16*>(p.o_bf16) + orow;
#pragma unroll
        for (int n = 0; n < DVP / 8; ++n) {
          const int c = n * 8 + 2 * t4;
          if (c < Dv)
            *reinterpret_cast<__nv_bfloat162*>(out + c) =
                __floats2bfloat162_rn(o[mt][n][2 * r] * inv[r], o[mt][n][2 * r + 1] * inv[r]);
        }
        continue;
      }
      float* out = p.o + orow;
#pragma unroll
      for (int n = 0; n < DVP / 8; ++n) {
        const int c = n * 8 + 2 * t4;
        if (c < Dv) out[c] = o[mt][n][2 * r] * inv[r];
        if (c + 1 < Dv) out[c + 1] = o[mt][n][2 * r + 1] * inv[r];
      }
    }
  }
}

size_t prefill_smem_bytes(int rows, int dkp, int dvp) {
  return size_t(rows + 2 * kBN) * size_t(dkp + kPad) * 2 + size_t(2 * kBN) * size_t(dvp + kPad) * 2;
}

template <int DKQ, int DVP, int MT = 1>
bool launch(const AttentionParams& p, int dkp, cudaStream_t stream) {
  constexpr int rows = 16 * MT * kWarps;
  const size_t smem = prefill_smem_bytes(rows, dkp, DVP);
  if (smem > size_t(device_max_smem_optin())) return false;
  auto kernel = attention_prefill_kernel<DKQ, DVP, MT>;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
             "cudaFuncSetAttribute (attention_prefill_kernel)");
  const dim3 grid = attention_tile_grid((p.Tq + rows - 1) / rows, p.Hq, p.batch);
  kernel<<<grid, kThreads, smem, stream>>>(p, dkp);
  check_launch("attention_prefill_kernel");
  return true;
}

}  // namespace

bool launch_attention_prefill(const AttentionParams& p, cudaStream_t stream) {
  if (p.Dk % 8 != 0 || p.Dv % 8 != 0 || p.Dk > 256 || p.Dv > 256) return false;
  if (p.q_stride % 8 != 0 || p.k_stride % 8 != 0 || p.v_stride % 8 != 0) return false;
  if (p.batch > 1 && (p.q_bstride % 8 != 0 || p.k_bstride % 8 != 0 || p.v_bstride % 8 != 0))
    return false;
  if (!aligned16(p.q) || !aligned16(p.k) || !aligned16(p.v)) return false;
  // bf16 o is written in pairs
  if (p.o_bf16 != nullptr &&
      (reinterpret_cast<uintptr_t>(p.o_bf16) % 4 != 0 || (p.batch > 1 && p.o_bstride % 2 != 0)))
    return false;
  const int dkp = (p.Dk + 15) / 16 * 16;
  if (dkp == 192 && p.Dv <= 128) return launch<192, 128>(p, dkp, stream);
  if (p.Dk == 128 && p.Dv == 128 && launch_attention_prefill_tma(p, stream)) return true;
  if (dkp == 128 && p.Dv <= 128)
    return attention_wide_rows(p.Tq, p.Hq, p.batch) ? launch<128, 128, 2>(p, dkp, stream)
                                                    : launch<128, 128>(p, dkp, stream);
  if (dkp == 64 && p.Dv <= 64)
    return attention_wide_rows(p.Tq, p.Hq, p.batch) ? launch<64, 64, 2>(p, dkp, stream)
                                                    : launch<64, 64>(p, dkp, stream);
  if (p.Dv <= 32) return launch<0, 32>(p, dkp, stream);
  if (p.Dv <= 64) return launch<0, 64>(p, dkp, stream);
  if (p.Dv <= 128) return launch<0, 128>(p, dkp, stream);
  return launch<0, 256>(p, dkp, stream);
}

}  // namespace kda::ops::cuda_detail
