// Tensor-core attention backward for bf16 (FlashAttention-2's recompute, split so that no two
// blocks write the same gradient: deterministic, no atomics).
//
// dk / dv kernel: a block of 4 warps owns 64 keys of one KV head (each warp 16 keys, its dk and
// dv rows in registers) and walks the query heads of the group, then the query tiles (BQ
// queries) that see any of its keys, Q / dO / lse2 / delta tiles double-buffered via cp.async.
// Per tile, all transposed so the keys are the M dimension (mma.sync m16n8k16, fp32 accumulate):
//   S^T = K Q^T;  P^T = exp2(S^T scale log2(e) - lse2) (masked: key > query position);
//   dP^T = V dO^T;  dV += P^T dO;  dS^T = P^T (dP^T - delta);  dK += dS^T Q.
// P^T and dS^T go from the accumulators straight into A fragments (bf16) as in the forward.
// Key tiles run in order: tile 0 (every query sees it) is the heaviest and starts first.
//
// dq kernel: a block of 4 warps owns 64 or 128 queries of one head (each warp 16 or 32, the
// forward's rule) and walks the key tiles (64 or 32 keys, K / V double-buffered) its queries
// see: S = Q K^T, P = exp2(S scale log2(e) - lse2), dP = dO V^T, dS = P (dP - delta),
// dQ += dS K. Query tiles run heaviest first.
//
// Both kernels take tiles heaviest first over the whole grid (attention_tile_grid); sequence b
// reads q / k / v at the batch strides, lse2 / delta / d_o and writes dq / dk / dv at its dense
// offsets.
//
// Head dims are zero-padded inside to the instantiation's DKP / DVP (zero Q / K columns add
// nothing to S, zero V / dO columns nothing to dP; pad columns are never written); padded query
// rows have lse2 = +inf (P = 0), padded key rows are never written.
// Requirements (else the plain kernels run): Dk, Dv <= 128 and multiples of 8; q / k / v row
// strides (and batch strides) multiples of 8; every array 16-byte aligned.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "ops/attention/cuda/attention_backward_kernels.cuh"
#include "ops/attention/cuda/attention_kernels.cuh"
#include "ops/common/device_attributes.h"
#include "ops/delta_rule/cuda/device_common.cuh"

namespace kda::ops::cuda_detail {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kKeys = 16 * kWarps;  // keys per dk / dv block
// Keys per tile of the dq kernel at MT m16 query tiles a warp.
constexpr int dq_key_tile(int mt) {
  return mt == 1 ? 64 : 32;
}
constexpr int kPad = 8;  // bf16 elements of row padding (ldmatrix bank spread)
constexpr float kLog2e = 1.4426950408889634f;

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

// A fragment of keys (M) x [16kk, 16kk + 16) (K) from the accumulators of n-tiles 2kk, 2kk + 1
// (C layout (g, 2t | 2t+1), (g+8, ...) matches A's (g, 2t), (g+8, 2t), (g, 2t+8), (g+8, 2t+8)).
__device__ __forceinline__ void acc_to_a(uint32_t a[4], const float c0[4], const float c1[4]) {
  a[0] = pack_bf16(c0[0], c0[1]);
  a[1] = pack_bf16(c0[2], c0[3]);
  a[2] = pack_bf16(c1[0], c1[1]);
  a[3] = pack_bf16(c1[2], c1[3]);
}

// Writes a warp's 16 rows x DP columns of fp32 accumulators (times mul) as bf16 pairs to
// dst[row * row_stride + c] for rows < rows_valid, columns c < cols (cols even).
template <int DP>
__device__ __forceinline__ void store_rows(bf16* dst, int64_t row_stride, int rows_valid, int cols,
                                           const float (&acc)[DP / 8][4], float mul, int lane) {
  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r;
    if (row >= rows_valid) continue;
    bf16* out = dst + int64_t(row) * row_stride;
#pragma unroll
    for (int n = 0; n < DP / 8; ++n) {
      const int c = n * 8 + 2 * t4;
      if (c < cols)
        *reinterpret_cast<__nv_bfloat162*>(out + c) =
            __floats2bfloat162_rn(acc[n][2 * r] * mul, acc[n][2 * r + 1] * mul);
    }
  }
}

template <int DKP, int DVP, int BQ>
__global__ void __launch_bounds__(kThreads) attention_bwd_dkdv_kernel(AttentionBwdParams p) {
  constexpr int ldk = DKP + kPad, ldv = DVP + kPad;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* Ks = reinterpret_cast<bf16*>(smem_raw);              // [kKeys][ldk]
  bf16* Vs = Ks + kKeys * ldk;                               // [kKeys][ldv]
  bf16* Qs = Vs + kKeys * ldv;                               // [2][BQ][ldk]
  bf16* dOs = Qs + 2 * BQ * ldk;                             // [2][BQ][ldv]
  float* Ls = reinterpret_cast<float*>(dOs + 2 * BQ * ldv);  // [2][BQ] lse2
  float* Ds = Ls + 2 * BQ;                                   // [2][BQ] delta

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  // The first key tile is the heaviest (every query sees it).
  const AttentionBlockTile at = attention_block_tile(p.Hkv, p.batch);
  const int64_t key0 = at.rank * kKeys;
  const int kvh = at.head;
  const int64_t b = at.seq;  // the sequence
  const int Dk = p.Dk, Dv = p.Dv, group = p.group;
  const int keys_valid = int(min(int64_t(kKeys), p.Tk - key0));

  // Query tiles that see any key of this block: queries t with q_offset + t >= key0.
  const int64_t t_first = key0 > p.q_offset ? key0 - p.q_offset : 0;
  const int qt_first = int(t_first / BQ);
  const int qt_end = int((p.Tq + BQ - 1) / BQ);
  const int nqt = qt_end > qt_first ? qt_end - qt_first : 0;
  const int n_iter = group * nqt;

  const bf16* qbase = static_cast<const bf16*>(p.q) + b * p.q_bstride;
  const int64_t do_stride = int64_t(p.Hq) * Dv;
  const bf16* dobase = static_cast<const bf16*>(p.d_o) + b * p.Tq * do_stride;
  const float* lse2_base = p.lse2 + b * p.Hq * p.Tq_pad;
  const float* delta_base = p.delta + b * p.Hq * p.Tq_pad;

  auto load_q = [&](int it, int buf) {
    const int h = kvh * group + it / nqt;
    const int64_t t0 = int64_t(qt_first + it % nqt) * BQ;
    const int rows_valid = int(min(int64_t(BQ), p.Tq - t0));
    load_tile(Qs + buf * BQ * ldk, ldk, qbase + t0 * p.q_stride + int64_t(h) * Dk, p.q_stride, BQ,
              rows_valid, DKP / 8, Dk / 8, tid);
    load_tile(dOs + buf * BQ * ldv, ldv, dobase + t0 * do_stride + int64_t(h) * Dv, do_stride, BQ,
              rows_valid, DVP / 8, Dv / 8, tid);
    // lse2 / delta rows are padded to kAttentionBwdRowPad (a multiple of BQ): whole chunks.
    const int64_t w0 = int64_t(h) * p.Tq_pad + t0;
    for (int idx = tid; idx < 2 * (BQ / 4); idx += kThreads) {
      const int which = idx / (BQ / 4), c = idx % (BQ / 4);
      const float* src = (which == 0 ? lse2_base : delta_base) + w0 + 4 * c;
      cp_async16((which == 0 ? Ls : Ds) + buf * BQ + 4 * c, src);
    }
  };

  float dk[DKP / 8][4], dv[DVP / 8][4];
#pragma unroll
  for (int n = 0; n < DKP / 8; ++n) dk[n][0] = dk[n][1] = dk[n][2] = dk[n][3] = 0.f;
#pragma unroll
  for (int n = 0; n < DVP / 8; ++n) dv[n][0] = dv[n][1] = dv[n][2] = dv[n][3] = 0.f;

  if (n_iter > 0) {
    const bf16* kbase =
        static_cast<const bf16*>(p.k) + b * p.k_bstride + key0 * p.k_stride + int64_t(kvh) * Dk;
    const bf16* vbase =
        static_cast<const bf16*>(p.v) + b * p.v_bstride + key0 * p.v_stride + int64_t(kvh) * Dv;
    load_tile(Ks, ldk, kbase, p.k_stride, kKeys, keys_valid, DKP / 8, Dk / 8, tid);
    load_tile(Vs, ldv, vbase, p.v_stride, kKeys, keys_valid, DVP / 8, Dv / 8, tid);
    load_q(0, 0);
    cp_async_commit();
  }

  const float scale_log2 = p.scale * kLog2e;
  // Keys of this thread's accumulator rows g and g + 8.
  const int64_t key_lo = key0 + warp * 16 + g;

  for (int it = 0; it < n_iter; ++it) {
    const int buf = it & 1;
    if (it + 1 < n_iter) {
      load_q(it + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    const bf16* Qb = Qs + buf * BQ * ldk;
    const bf16* dOb = dOs + buf * BQ * ldv;
    const float* Lb = Ls + buf * BQ;
    const float* Db = Ds + buf * BQ;
    const int64_t qpos0 = p.q_offset + int64_t(qt_first + it % nqt) * BQ;  // position of row 0

    // S^T = K Q^T: this warp's 16 keys x BQ queries.
    float s[BQ / 8][4];
#pragma unroll
    for (int n = 0; n < BQ / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < DKP / 16; ++ks) {
      uint32_t a[4];
      load_a(a, Ks, ldk, warp * 16, ks * 16, lane);
#pragma unroll
      for (int np = 0; np < BQ / 16; ++np) {
        uint32_t b[4];
        load_b_nk(b, Qb, ldk, ks * 16, np * 16, lane);  // B(d, query) = Q[query][d]
        mma_bf16(s[2 * np], a, b[0], b[1]);
        mma_bf16(s[2 * np + 1], a, b[2], b[3]);
      }
    }

    // P^T: column (query) n*8 + 2*t4 + (e & 1), row (key) g + 8 * (e >= 2).
    const bool need_mask = key0 + kKeys - 1 > qpos0;
#pragma unroll
    for (int n = 0; n < BQ / 8; ++n) {
      const float2 lse2 = *reinterpret_cast<const float2*>(Lb + n * 8 + 2 * t4);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float pv = fast_exp2(fmaf(s[n][e], scale_log2, -((e & 1) ? lse2.y : lse2.x)));
        if (need_mask) {
          const int64_t key = key_lo + ((e & 2) ? 8 : 0);
          if (key > qpos0 + n * 8 + 2 * t4 + (e & 1)) pv = 0.f;
        }
        s[n][e] = pv;
      }
    }

    // dP^T = V dO^T.
    float dp[BQ / 8][4];
#pragma unroll
    for (int n = 0; n < BQ / 8; ++n) dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < DVP / 16; ++ks) {
      uint32_t a[4];
      load_a(a, Vs, ldv, warp * 16, ks * 16, lane);
#pragma unroll
      for (int np = 0; np < BQ / 16; ++np) {
        uint32_t b[4];
        load_b_nk(b, dOb, ldv, ks * 16, np * 16, lane);  // B(dv, query) = dO[query][dv]
        mma_bf16(dp[2 * np], a, b[0], b[1]);
        mma_bf16(dp[2 * np + 1], a, b[2], b[3]);
      }
    }

    // dV += P^T dO (K dimension: the queries).
#pragma unroll
    for (int kk = 0; kk < BQ / 16; ++kk) {
      uint32_t a[4];
      acc_to_a(a, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
      for (int dn = 0; dn < DVP / 16; ++dn) {
        uint32_t b[4];
        load_b_kn(b, dOb, ldv, kk * 16, dn * 16, lane);  // B(query, dv) = dO[query][dv]
        mma_bf16(dv[2 * dn], a, b[0], b[1]);
        mma_bf16(dv[2 * dn + 1], a, b[2], b[3]);
      }
    }

    // dS^T = P^T (dP^T - delta), into dp.
#pragma unroll
    for (int n = 0; n < BQ / 8; ++n) {
      const float2 delta = *reinterpret_cast<const float2*>(Db + n * 8 + 2 * t4);
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[n][e] = s[n][e] * (dp[n][e] - ((e & 1) ? delta.y : delta.x));
    }

    // dK += dS^T Q.
#pragma unroll
    for (int kk = 0; kk < BQ / 16; ++kk) {
      uint32_t a[4];
      acc_to_a(a, dp[2 * kk], dp[2 * kk + 1]);
#pragma unroll
      for (int dn = 0; dn < DKP / 16; ++dn) {
        uint32_t b[4];
        load_b_kn(b, Qb, ldk, kk * 16, dn * 16, lane);  // B(query, d) = Q[query][d]
        mma_bf16(dk[2 * dn], a, b[0], b[1]);
        mma_bf16(dk[2 * dn + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();  // everyone is done with buffer `buf` before it is refilled
  }

  // Rows of this warp: keys key0 + warp * 16 + (g, g + 8); zeros where no query saw the block.
  const int warp_rows = keys_valid - warp * 16;
  const int64_t out_token0 = b * p.Tk + key0 + warp * 16;
  store_rows<DKP>(static_cast<bf16*>(p.dk) + out_token0 * p.dk_stride + int64_t(kvh) * Dk,
                  p.dk_stride, warp_rows, Dk, dk, p.scale, lane);
  store_rows<DVP>(static_cast<bf16*>(p.dv) + out_token0 * p.dv_stride + int64_t(kvh) * Dv,
                  p.dv_stride, warp_rows, Dv, dv, 1.f, lane);
}

// MT: m16 query tiles per warp. MT = 2 (32 rows a warp, 128 a block) makes every K fragment
// read from shared memory feed two products in S = Q K^T and dQ += dS K (Q / dO fragments are
// re-read per key tile either way); its key tiles are 32 wide so that Q, dO and two K / V
// buffers (104 KB at D = 128) still fit two blocks per SM.
template <int DKP, int DVP, int MT>
__global__ void __launch_bounds__(kThreads) attention_bwd_dq_kernel(AttentionBwdParams p) {
  constexpr int BM = 16 * MT * kWarps;  // queries per block
  constexpr int BN = dq_key_tile(MT);   // keys per tile
  constexpr int ldk = DKP + kPad, ldv = DVP + kPad;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* Qs = reinterpret_cast<bf16*>(smem_raw);  // [BM][ldk]
  bf16* dOs = Qs + BM * ldk;                     // [BM][ldv]
  bf16* Ks = dOs + BM * ldv;                     // [2][BN][ldk]
  bf16* Vs = Ks + 2 * BN * ldk;                  // [2][BN][ldv]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const AttentionBlockTile at = attention_block_tile(p.Hq, p.batch);
  const int64_t tiles = (p.Tq + BM - 1) / BM;
  const int64_t q0 = (tiles - 1 - at.rank) * BM;  // the last query tile is the heaviest
  const int h = at.head;
  const int64_t b = at.seq;  // the sequence
  const int kvh = h / p.group;
  const int Dk = p.Dk, Dv = p.Dv;
  const int warp_row0 = warp * 16 * MT;  // this warp's first row in the block

  const int64_t q_rows = min(int64_t(BM), p.Tq - q0);  // >= 1
  const int64_t kv_end = min(p.Tk, p.q_offset + q0 + q_rows);
  const int ntiles = int((kv_end + BN - 1) / BN);

  const bf16* kbase = static_cast<const bf16*>(p.k) + b * p.k_bstride + int64_t(kvh) * Dk;
  const bf16* vbase = static_cast<const bf16*>(p.v) + b * p.v_bstride + int64_t(kvh) * Dv;
  auto load_kv = [&](int tile, int buf) {
    const int64_t k0 = int64_t(tile) * BN;
    const int valid = int(min(int64_t(BN), p.Tk - k0));
    load_tile(Ks + buf * BN * ldk, ldk, kbase + k0 * p.k_stride, p.k_stride, BN, valid, DKP / 8,
              Dk / 8, tid);
    load_tile(Vs + buf * BN * ldv, ldv, vbase + k0 * p.v_stride, p.v_stride, BN, valid, DVP / 8,
              Dv / 8, tid);
  };

  const int64_t do_stride = int64_t(p.Hq) * Dv;
  load_tile(Qs, ldk,
            static_cast<const bf16*>(p.q) + b * p.q_bstride + q0 * p.q_stride + int64_t(h) * Dk,
            p.q_stride, BM, int(q_rows), DKP / 8, Dk / 8, tid);
  load_tile(dOs, ldv,
            static_cast<const bf16*>(p.d_o) + (b * p.Tq + q0) * do_stride + int64_t(h) * Dv,
            do_stride, BM, int(q_rows), DVP / 8, Dv / 8, tid);
  load_kv(0, 0);
  cp_async_commit();

  // This thread's rows g and g + 8 of each m-tile. Rows past Tq_pad (the workspace pads to 64
  // rows, a 128-row block can reach past it) and the padded rows read as lse2 = +inf: P = 0.
  const float* lse2_row = p.lse2 + (b * p.Hq + h) * p.Tq_pad;
  const float* delta_row = p.delta + (b * p.Hq + h) * p.Tq_pad;
  float lse2[MT][2], delta[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t row = q0 + warp_row0 + 16 * mt + 8 * r + g;
      const bool in = row < p.Tq_pad;
      lse2[mt][r] = in ? lse2_row[row] : INFINITY;
      delta[mt][r] = in ? delta_row[row] : 0.f;
    }
  const float scale_log2 = p.scale * kLog2e;

  float dq[MT][DKP / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int n = 0; n < DKP / 8; ++n)
      dq[mt][n][0] = dq[mt][n][1] = dq[mt][n][2] = dq[mt][n][3] = 0.f;

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
    const bf16* Kb = Ks + buf * BN * ldk;
    const bf16* Vb = Vs + buf * BN * ldv;

    // S = Q K^T: this warp's 16 MT queries x BN keys; each K fragment feeds MT products.
    float s[MT][BN / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < BN / 8; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < DKP / 16; ++ks) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) load_a(a[mt], Qs, ldk, warp_row0 + 16 * mt, ks * 16, lane);
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t bk[4];
        load_b_nk(bk, Kb, ldk, ks * 16, np * 16, lane);  // B(d, key) = K[key][d]
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_bf16(s[mt][2 * np], a[mt], bk[0], bk[1]);
          mma_bf16(s[mt][2 * np + 1], a[mt], bk[2], bk[3]);
        }
      }
    }

    // P: row (query) g + 8 * (e >= 2) of m-tile mt, column (key) n*8 + 2*t4 + (e & 1).
    // Masked: key k0 + c past query q0 + row (c > diag + row) or past Tk (c >= keys_left);
    // both in 32 bits relative to the tile (diag > -BM whenever a mask is needed).
    const int64_t k0 = int64_t(j) * BN;
    const bool need_mask = k0 + BN - 1 > p.q_offset + q0 || k0 + BN > p.Tk;
    const int diag = int(max(min(p.q_offset + q0 - k0, int64_t(BN)), -int64_t(BM)));
    const int keys_left = int(min(p.Tk - k0, int64_t(BN)));
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float pv = fast_exp2(fmaf(s[mt][n][e], scale_log2, -lse2[mt][e >> 1]));
          if (need_mask) {
            const int c = n * 8 + 2 * t4 + (e & 1);
            const int row = warp_row0 + 16 * mt + 8 * (e >> 1) + g;
            if (c > diag + row || c >= keys_left) pv = 0.f;
          }
          s[mt][n][e] = pv;
        }
      }

    // dP = dO V^T; each V fragment feeds MT products.
    float dp[MT][BN / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < BN / 8; ++n)
        dp[mt][n][0] = dp[mt][n][1] = dp[mt][n][2] = dp[mt][n][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < DVP / 16; ++ks) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) load_a(a[mt], dOs, ldv, warp_row0 + 16 * mt, ks * 16, lane);
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t bv[4];
        load_b_nk(bv, Vb, ldv, ks * 16, np * 16, lane);  // B(dv, key) = V[key][dv]
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_bf16(dp[mt][2 * np], a[mt], bv[0], bv[1]);
          mma_bf16(dp[mt][2 * np + 1], a[mt], bv[2], bv[3]);
        }
      }
    }

    // dS = P (dP - delta), into dp; dQ += dS K (K dimension: the keys).
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < BN / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[mt][n][e] = s[mt][n][e] * (dp[mt][n][e] - delta[mt][e >> 1]);
      }
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) acc_to_a(a[mt], dp[mt][2 * kk], dp[mt][2 * kk + 1]);
#pragma unroll
      for (int dn = 0; dn < DKP / 16; ++dn) {
        uint32_t bk[4];
        load_b_kn(bk, Kb, ldk, kk * 16, dn * 16, lane);  // B(key, d) = K[key][d]
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma_bf16(dq[mt][2 * dn], a[mt], bk[0], bk[1]);
          mma_bf16(dq[mt][2 * dn + 1], a[mt], bk[2], bk[3]);
        }
      }
    }
    __syncthreads();  // everyone is done with buffer `buf` before it is refilled
  }

#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int row0 = warp_row0 + 16 * mt;
    const int64_t out_token0 = b * p.Tq + q0 + row0;
    store_rows<DKP>(static_cast<bf16*>(p.dq) + out_token0 * p.dq_stride + int64_t(h) * Dk,
                    p.dq_stride, int(q_rows) - row0, Dk, dq[mt], p.scale, lane);
  }
}

template <int DKP, int DVP, int BQ>
size_t dkdv_smem_bytes() {
  return size_t(kKeys + 2 * BQ) * (DKP + kPad) * 2 + size_t(kKeys + 2 * BQ) * (DVP + kPad) * 2 +
         size_t(4 * BQ) * sizeof(float);
}
template <int DKP, int DVP, int MT>
size_t dq_smem_bytes() {
  constexpr int rows = 16 * MT * kWarps, keys = dq_key_tile(MT);
  return size_t(rows + 2 * keys) * (DKP + kPad) * 2 + size_t(rows + 2 * keys) * (DVP + kPad) * 2;
}

// MT = 2 (the wide rule): the dq kernel at 32 rows a warp. (An 8-warp dk / dv kernel with 32
// keys a warp, P^T and dS^T through shared memory, FlashAttention-2's layout, was slower on the
// H200: T = 8192, H = 32, D = 128 backward 6.73 -> 6.99 ms, T = 2048 0.60 -> 0.65 ms.)
template <int DKP, int DVP, int BQ, int MT>
bool launch(const AttentionBwdParams& p, cudaStream_t stream) {
  static_assert(kAttentionBwdRowPad % BQ == 0, "workspace rows must cover whole query tiles");
  const size_t smem_dkdv = dkdv_smem_bytes<DKP, DVP, BQ>();
  const size_t smem_dq = dq_smem_bytes<DKP, DVP, MT>();
  const size_t limit = size_t(device_max_smem_optin());
  if (smem_dkdv > limit || smem_dq > limit) return false;

  auto dkdv = attention_bwd_dkdv_kernel<DKP, DVP, BQ>;
  check_cuda(
      cudaFuncSetAttribute(dkdv, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem_dkdv)),
      "cudaFuncSetAttribute (attention_bwd_dkdv_kernel)");
  const dim3 dkdv_grid = attention_tile_grid((p.Tk + kKeys - 1) / kKeys, p.Hkv, p.batch);
  dkdv<<<dkdv_grid, kThreads, smem_dkdv, stream>>>(p);
  check_launch("attention_bwd_dkdv_kernel");

  auto dq = attention_bwd_dq_kernel<DKP, DVP, MT>;
  check_cuda(cudaFuncSetAttribute(dq, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem_dq)),
             "cudaFuncSetAttribute (attention_bwd_dq_kernel)");
  constexpr int rows = 16 * MT * kWarps;
  const dim3 dq_grid = attention_tile_grid((p.Tq + rows - 1) / rows, p.Hq, p.batch);
  dq<<<dq_grid, kThreads, smem_dq, stream>>>(p);
  check_launch("attention_bwd_dq_kernel");
  return true;
}

}  // namespace

bool launch_attention_bwd_mma(const AttentionBwdParams& p, cudaStream_t stream) {
  if (p.Dk % 8 != 0 || p.Dv % 8 != 0 || p.Dk > 128 || p.Dv > 128) return false;
  if (p.q_stride % 8 != 0 || p.k_stride % 8 != 0 || p.v_stride % 8 != 0) return false;
  if (p.dq_stride % 8 != 0 || p.dk_stride % 8 != 0 || p.dv_stride % 8 != 0) return false;
  // d_o (dense) and dq / dk / dv of later sequences stay aligned (Dk, Dv, strides multiples of 8).
  if (p.batch > 1 && (p.q_bstride % 8 != 0 || p.k_bstride % 8 != 0 || p.v_bstride % 8 != 0))
    return false;
  for (const void* ptr : {p.q, p.k, p.v, p.d_o, static_cast<const void*>(p.dq),
                          static_cast<const void*>(p.dk), static_cast<const void*>(p.dv)})
    if (!aligned16(ptr)) return false;
  if (p.Dk == 128 && p.Dv == 128 && launch_attention_bwd_wgmma(p, stream)) return true;
  // 32 query rows a warp in the dq kernel under the forward's rule (attention_wide_rows)
  const bool wide = attention_wide_rows(p.Tq, p.Hq, p.batch);
  if (p.Dk <= 64 && p.Dv <= 64)
    return wide ? launch<64, 64, 64, 2>(p, stream) : launch<64, 64, 64, 1>(p, stream);
  return wide ? launch<128, 128, 64, 2>(p, stream) : launch<128, 128, 64, 1>(p, stream);
}

}  // namespace kda::ops::cuda_detail
