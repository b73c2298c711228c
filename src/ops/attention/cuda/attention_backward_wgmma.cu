// The causal attention backward on wgmma (sm_90a), head dims 128 / 128, in one kernel
// (FlashAttention-2's dQ by atomics: 5 products a tile where the mma.sync pair of kernels does 7).
// KDA_ATTENTION_WGMMA=0 turns it off.
//
// A block of two warpgroups owns 128 keys of one KV head (warpgroup w: keys 64 w .. 64 w + 63)
// and walks the query tiles (64 queries) of every query head of its group that see them:
//   S^T  = K Q^T      8 x wgmma m64n64k16 (K and Q from 128-byte-swizzled K-major tiles)
//   dP^T = V dO^T     8 x wgmma m64n64k16 (V and dO likewise)
//   P^T = exp2(S^T scale log2(e) - lse2[query]), causal mask; dS^T = P^T (dP^T - delta[query])
//   dV  += P^T dO     4 x wgmma m64n128k16, P^T from registers, dO^T from shared memory
//   dK  += dS^T Q     4 x wgmma m64n128k16, dS^T from registers, Q^T from shared memory
//   dQ   = dS K       8 x wgmma m64n64k16 (warpgroup w: head dims 64 w ..), dS written to shared
//                     memory by stmatrix .trans, K^T (made once) as B; added to fp32 sums in the
//                     workspace (float2 atomics), scaled and cast to bf16 by a second kernel.
// Q and dO arrive by cp.async (double-buffered, with the tile's lse2 / delta), then are copied
// transposed (Q^T, dO^T: head-dim rows, query columns) so that every B operand is K-major.
// Barriers a tile: copies landed; transposes written (after fence.proxy.async); dS written;
// products done. dK is scaled by the softmax scale once at the end; keys no query sees get
// zeros. dK / dV are deterministic (each block owns its keys); dQ's sums are not (atomics).
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ops/attention/cuda/attention_backward_kernels.cuh"
#include "ops/attention/cuda/attention_kernels.cuh"
#include "ops/common/device_attributes.h"
#include "ops/common/wgmma.cuh"

namespace kda::ops::cuda_detail {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kD = 128;   // Dk = Dv
constexpr int kBK = 128;  // keys a block
constexpr int kBQ = 64;   // queries a tile
constexpr int kThreads = 256;
constexpr uint32_t kRowBytes = 128;           // a swizzled row: 64 bf16
constexpr uint32_t kKCol = kBK * kRowBytes;   // one 64-wide column tile of K (or V)
constexpr uint32_t kQCol = kBQ * kRowBytes;   // one 64-wide column tile of a Q (or dO) tile
constexpr uint32_t kQBuf = 2 * kQCol;         // a Q tile (128 dims)
constexpr uint32_t kTBytes = kD * kRowBytes;  // a transposed tile: 128 dim rows x 64 queries
// K, V | Q, dO double-buffered | Q^T, dO^T | lse2, delta double-buffered | K^T | dS
constexpr uint32_t kOffV = 2 * kKCol;
constexpr uint32_t kOffQ = kOffV + 2 * kKCol;
constexpr uint32_t kOffDO = kOffQ + 2 * kQBuf;
constexpr uint32_t kOffQT = kOffDO + 2 * kQBuf;
constexpr uint32_t kOffDOT = kOffQT + kTBytes;
constexpr uint32_t kOffL = kOffDOT + kTBytes;
constexpr uint32_t kOffDelta = kOffL + 2 * kBQ * 4;
constexpr uint32_t kOffKT = kOffDelta + 2 * kBQ * 4;  // 1024-aligned (the sum of whole tiles)
constexpr uint32_t kKTCol = kD * kRowBytes;           // one 64-key column tile of K^T
constexpr uint32_t kOffDS = kOffKT + 2 * kKTCol;
constexpr uint32_t kSmemBytes = kOffDS + 2 * kQCol;  // dS: 64 queries x 128 keys
static_assert(kOffKT % 1024 == 0 && kOffDS % 1024 == 0, "swizzled tiles sit on 1024 bytes");
constexpr size_t kSmemLaunch = kSmemBytes + 1024;  // + room to align the base to 1024
constexpr float kLog2e = 1.4426950408889634f;

__global__ void __launch_bounds__(kThreads, 1) attention_bwd_wgmma_kernel(AttentionBwdParams p) {
#ifdef KDA_WGMMA
  extern __shared__ unsigned char smem_raw[];
  // the shared-window address 1024-byte aligned (the descriptors and the swizzle see it)
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  unsigned char* Ks = smem;
  unsigned char* Vs = smem + kOffV;
  unsigned char* Qs = smem + kOffQ;
  unsigned char* dOs = smem + kOffDO;
  unsigned char* Qt = smem + kOffQT;
  unsigned char* dOt = smem + kOffDOT;
  float* Ls = reinterpret_cast<float*>(smem + kOffL);
  float* Ds = reinterpret_cast<float*>(smem + kOffDelta);
  unsigned char* Kt = smem + kOffKT;   // [2 key column tiles][128 dim rows][64 keys]
  unsigned char* dSs = smem + kOffDS;  // [2 key column tiles][64 query rows][64 keys]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2, wq = warp & 3;
  const int g = lane >> 2, t4 = lane & 3;
  const AttentionBlockTile at = attention_block_tile(p.Hkv, p.batch);
  const int64_t key0 = at.rank * kBK;  // the first key tile is the heaviest
  const int kvh = at.head;
  const int64_t b = at.seq;
  const int group = p.group;
  const int keys_valid = int(min(int64_t(kBK), p.Tk - key0));

  // Query tiles that see any key of this block: queries t with q_offset + t >= key0.
  const int64_t t_first = key0 > p.q_offset ? key0 - p.q_offset : 0;
  const int qt_first = int(t_first / kBQ);
  const int qt_end = int((p.Tq + kBQ - 1) / kBQ);
  const int nqt = qt_end > qt_first ? qt_end - qt_first : 0;
  const int n_iter = group * nqt;

  const bf16* qbase = static_cast<const bf16*>(p.q) + b * p.q_bstride;
  const int64_t do_stride = int64_t(p.Hq) * kD;
  const bf16* dobase = static_cast<const bf16*>(p.d_o) + b * p.Tq * do_stride;
  const float* lse2_base = p.lse2 + b * p.Hq * p.Tq_pad;
  const float* delta_base = p.delta + b * p.Hq * p.Tq_pad;

  const auto load_rows = [&](unsigned char* dst, uint32_t col_bytes, const bf16* src,
                             int64_t stride, int rows, int valid) {
    load_rows_sw128<kThreads>(dst, col_bytes, src, stride, rows, valid, tid);
  };
  const auto load_q = [&](int it, int buf) {
    const int h = kvh * group + it / nqt;
    const int64_t t0 = int64_t(qt_first + it % nqt) * kBQ;
    const int valid = int(min(int64_t(kBQ), p.Tq - t0));
    load_rows(Qs + buf * kQBuf, kQCol, qbase + t0 * p.q_stride + int64_t(h) * kD, p.q_stride, kBQ,
              valid);
    load_rows(dOs + buf * kQBuf, kQCol, dobase + t0 * do_stride + int64_t(h) * kD, do_stride, kBQ,
              valid);
    // lse2 / delta rows are padded to kAttentionBwdRowPad (a multiple of kBQ): whole chunks
    const int64_t w0 = int64_t(h) * p.Tq_pad + t0;
    if (tid < 2 * (kBQ / 4)) {
      const int which = tid / (kBQ / 4), c = tid % (kBQ / 4);
      cp_async16((which == 0 ? Ls : Ds) + buf * kBQ + 4 * c,
                 (which == 0 ? lse2_base : delta_base) + w0 + 4 * c);
    }
  };
  // Q (or dO) of buffer `buf` copied transposed into `dst` (head-dim rows, query columns):
  // thread t takes queries 2 (t % 32), 2 (t % 32) + 1 and head-dim chunks t / 32, t / 32 + 8;
  // one 32-bit store holds both queries of one head dim (a warp fills one 128-byte row).
  const int tpair = tid & 31, tchunk = tid >> 5;
  const auto transpose = [&](const unsigned char* src, uint32_t src_col, unsigned char* dst) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int c = tchunk + 8 * i;  // head dims 8 c .. 8 c + 7
      const uint32_t off = (c >> 3) * src_col;
      const uint4 lo4 =
          *reinterpret_cast<const uint4*>(src + off + sw128_offset(2 * tpair, (c & 7) * 8));
      const uint4 hi4 =
          *reinterpret_cast<const uint4*>(src + off + sw128_offset(2 * tpair + 1, (c & 7) * 8));
      const uint32_t* lo = reinterpret_cast<const uint32_t*>(&lo4);
      const uint32_t* hi = reinterpret_cast<const uint32_t*>(&hi4);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const uint32_t a = (lo[e >> 1] >> (16 * (e & 1))) & 0xFFFFu;
        const uint32_t d = (hi[e >> 1] >> (16 * (e & 1))) & 0xFFFFu;
        *reinterpret_cast<uint32_t*>(dst + sw128_offset(8 * c + e, 2 * tpair)) = a | (d << 16);
      }
    }
  };

  float dk[64], dv[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) dk[i] = dv[i] = 0.f;

  if (n_iter > 0) {
    const bf16* kb =
        static_cast<const bf16*>(p.k) + b * p.k_bstride + key0 * p.k_stride + int64_t(kvh) * kD;
    const bf16* vb =
        static_cast<const bf16*>(p.v) + b * p.v_bstride + key0 * p.v_stride + int64_t(kvh) * kD;
    load_rows(Ks, kKCol, kb, p.k_stride, kBK, keys_valid);
    load_rows(Vs, kKCol, vb, p.v_stride, kBK, keys_valid);
    load_q(0, 0);
    cp_async_commit();
  }

  const float scale_log2 = p.scale * kLog2e;
  const int key_row = wg * 64 + wq * 16 + g;  // this thread's keys in the block: + 0 and + 8
  const int64_t key_lo = key0 + key_row;
  const unsigned char* k_wg = Ks + wg * 64 * kRowBytes;
  const unsigned char* v_wg = Vs + wg * 64 * kRowBytes;

  for (int it = 0; it < n_iter; ++it) {
    const int buf = it & 1;
    if (it + 1 < n_iter) {
      load_q(it + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // Q / dO / lse2 / delta of this tile landed (and K, V the first time)
    transpose(Qs + buf * kQBuf, kQCol, Qt);
    transpose(dOs + buf * kQBuf, kQCol, dOt);
    if (it == 0) {  // K^T for dQ = dS K: keys 0..63, 64..127 into K^T's two column tiles
      transpose(Ks, kKCol, Kt);
      transpose(Ks + 64 * kRowBytes, kKCol, Kt + kKTCol);
    }
    fence_proxy_async();
    __syncthreads();  // the transposes (and the cp.async'd tiles) visible to wgmma

    // S^T = K Q^T, dP^T = V dO^T: this warpgroup's 64 keys x 64 queries each
    float st[32], dpt[32];
    const unsigned char* q_buf = Qs + buf * kQBuf;
    const unsigned char* do_buf = dOs + buf * kQBuf;
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      const uint32_t off = (ks & 3) * 32, col = ks >> 2;
      wgmma_m64n64k16_ss(st, sw128_desc(k_wg + col * kKCol + off),
                         sw128_desc(q_buf + col * kQCol + off), ks > 0);
    }
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      const uint32_t off = (ks & 3) * 32, col = ks >> 2;
      wgmma_m64n64k16_ss(dpt, sw128_desc(v_wg + col * kKCol + off),
                         sw128_desc(do_buf + col * kQCol + off), ks > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(st);
    fence_operands(dpt);

    // P^T and dS^T: row (key) g + 8 (e >= 2) of the warp, column (query) 8 n + 2 t + (e & 1).
    // Padded queries have lse2 = +inf (P = 0); keys past Tk are zero rows never written.
    const int64_t qpos0 = p.q_offset + int64_t(qt_first + it % nqt) * kBQ;  // row 0's position
    const bool need_mask = key0 + kBK - 1 > qpos0;
    const float* Lb = Ls + buf * kBQ;
    const float* Db = Ds + buf * kBQ;
#pragma unroll
    for (int n = 0; n < kBQ / 8; ++n) {
      const float2 lse2 = *reinterpret_cast<const float2*>(Lb + n * 8 + 2 * t4);
      const float2 delta = *reinterpret_cast<const float2*>(Db + n * 8 + 2 * t4);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float pv = fast_exp2(fmaf(st[4 * n + e], scale_log2, -((e & 1) ? lse2.y : lse2.x)));
        if (need_mask) {
          const int64_t key = key_lo + ((e & 2) ? 8 : 0);
          if (key > qpos0 + n * 8 + 2 * t4 + (e & 1)) pv = 0.f;
        }
        st[4 * n + e] = pv;
        dpt[4 * n + e] = pv * (dpt[4 * n + e] - ((e & 1) ? delta.y : delta.x));
      }
    }
    // A fragments for queries [16 kk, 16 kk + 16): n8 blocks 2 kk, 2 kk + 1
    uint32_t pa[kBQ / 16][4], sa[kBQ / 16][4];
#pragma unroll
    for (int kk = 0; kk < kBQ / 16; ++kk) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        pa[kk][i] = pack_bf16(st[8 * kk + 2 * i], st[8 * kk + 2 * i + 1]);
        sa[kk][i] = pack_bf16(dpt[8 * kk + 2 * i], dpt[8 * kk + 2 * i + 1]);
      }
    }
    // dS (queries x keys) into shared memory for dQ = dS K: this warpgroup's keys are dS's
    // column tile wg; stmatrix .trans turns each 8 x 8 block of dS^T around (matrix j of an A
    // fragment: keys + 8 (j & 1), queries + 8 (j >> 1)).
    {
      const int j = lane >> 3, i = lane & 7;
      unsigned char* ds_tile = dSs + wg * kQCol;
#pragma unroll
      for (int kk = 0; kk < kBQ / 16; ++kk)
        stmatrix_x4_trans(ds_tile + sw128_offset(16 * kk + 8 * (j >> 1) + i, wq * 16 + 8 * (j & 1)),
                          sa[kk]);
    }
    // dV += P^T dO, dK += dS^T Q (B: dO^T, Q^T, K-major)
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBQ / 16; ++kk)
      wgmma_m64n128k16_rs(dv, pa[kk], sw128_desc(dOt + kk * 32));
#pragma unroll
    for (int kk = 0; kk < kBQ / 16; ++kk) wgmma_m64n128k16_rs(dk, sa[kk], sw128_desc(Qt + kk * 32));
    wgmma_commit();
    fence_proxy_async();
    __syncthreads();  // both warpgroups' halves of dS written
    // dQ (64 queries x this warpgroup's 64 head dims) = dS (64 x 128 keys) K (128 keys x 64 dims)
    float dq[32];
    fence_operands(dq);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kBK / 16; ++ks) {
      const uint32_t off = (ks & 3) * 32, col = ks >> 2;
      wgmma_m64n64k16_ss(dq, sw128_desc(dSs + col * kQCol + off),
                         sw128_desc(Kt + col * kKTCol + wg * 64 * kRowBytes + off), ks > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(dk);
    fence_operands(dv);
    fence_operands(dq);
    fence_operands(pa);
    fence_operands(sa);
    // dQ into the fp32 accumulator (every key block of the head adds its share; scaled and
    // cast by attention_bwd_dq_cast_kernel)
    {
      const int h = kvh * group + it / nqt;
      const int64_t t0 = int64_t(qt_first + it % nqt) * kBQ;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int64_t t = t0 + wq * 16 + g + 8 * r;
        if (t >= p.Tq) continue;
        float* row = p.dq_accum + ((b * p.Tq + t) * p.Hq + h) * int64_t(kD) + wg * 64 + 2 * t4;
#pragma unroll
        for (int n = 0; n < 8; ++n)
          atomicAdd(reinterpret_cast<float2*>(row + 8 * n),
                    make_float2(dq[4 * n + 2 * r], dq[4 * n + 2 * r + 1]));
      }
    }
    __syncthreads();  // everyone is done with buffer `buf`, Q^T, dO^T and dS before the next tile
  }

  // This thread's keys key_lo (+ 8): dK (times the scale) and dV as bf16 pairs; zeros where no
  // query saw the block.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (key_row + 8 * r >= keys_valid) continue;
    const int64_t token = b * p.Tk + key_lo + 8 * r;
    bf16* dk_row = static_cast<bf16*>(p.dk) + token * p.dk_stride + int64_t(kvh) * kD;
    bf16* dv_row = static_cast<bf16*>(p.dv) + token * p.dv_stride + int64_t(kvh) * kD;
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) {
      const int c = n * 8 + 2 * t4;
      *reinterpret_cast<__nv_bfloat162*>(dk_row + c) =
          __floats2bfloat162_rn(dk[4 * n + 2 * r] * p.scale, dk[4 * n + 2 * r + 1] * p.scale);
      *reinterpret_cast<__nv_bfloat162*>(dv_row + c) =
          __floats2bfloat162_rn(dv[4 * n + 2 * r], dv[4 * n + 2 * r + 1]);
    }
  }
#else
  __trap();  // sm_90a only (the launcher checks the device)
#endif
}

// dq (bf16, at dq_stride) = scale * the fp32 sums, four head dims a thread.
__global__ void attention_bwd_dq_cast_kernel(AttentionBwdParams p) {
  const int64_t quads = int64_t(p.batch) * p.Tq * p.Hq * (kD / 4);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < quads;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / (kD / 4);  // (b Tq + t) Hq + h
    const int c = int(i % (kD / 4)) * 4;
    const int64_t token = row / p.Hq;
    const int h = int(row % p.Hq);
    const float4 x = reinterpret_cast<const float4*>(p.dq_accum)[i];
    __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(static_cast<bf16*>(p.dq) +
                                                            token * p.dq_stride + h * kD + c);
    dst[0] = __floats2bfloat162_rn(x.x * p.scale, x.y * p.scale);
    dst[1] = __floats2bfloat162_rn(x.z * p.scale, x.w * p.scale);
  }
}

}  // namespace

bool launch_attention_bwd_wgmma(const AttentionBwdParams& p, cudaStream_t stream) {
  if (!attention_wgmma_enabled() || p.dq_accum == nullptr) return false;
  if (p.Dk != kD || p.Dv != kD) return false;
  static_assert(kAttentionBwdRowPad % kBQ == 0, "workspace rows must cover whole query tiles");
  if (kSmemLaunch > size_t(device_max_smem_optin())) return false;
  const int64_t dq_floats = int64_t(p.batch) * p.Tq * p.Hq * kD;
  check_cuda(cudaMemsetAsync(p.dq_accum, 0, size_t(dq_floats) * sizeof(float), stream),
             "cudaMemsetAsync (attention dQ sums)");
  check_cuda(cudaFuncSetAttribute(attention_bwd_wgmma_kernel,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemLaunch)),
             "cudaFuncSetAttribute (attention_bwd_wgmma_kernel)");
  const dim3 grid = attention_tile_grid((p.Tk + kBK - 1) / kBK, p.Hkv, p.batch);
  attention_bwd_wgmma_kernel<<<grid, kThreads, kSmemLaunch, stream>>>(p);
  check_launch("attention_bwd_wgmma_kernel");
  const int64_t quads = dq_floats / 4;
  const int blocks = int(std::min<int64_t>((quads + 255) / 256, 16 * device_sm_count()));
  attention_bwd_dq_cast_kernel<<<blocks, 256, 0, stream>>>(p);
  check_launch("attention_bwd_dq_cast_kernel");
  return true;
}

}  // namespace kda::ops::cuda_detail
