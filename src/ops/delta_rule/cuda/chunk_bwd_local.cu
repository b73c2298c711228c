// chunk_bwd_local: every input gradient of one chunk, once chunk_state_bwd has produced the
// gradient dS of the state leaving it and dD. One block of 256 threads (8 warps) per (chunk,
// value head). With S0 the entering state, X = (I + L)^-1, A = decayed K K^T (strictly lower),
// E = exp(G), G the in-chunk gate cumsum and dO' = scale dO (the algebra of
// ../cpu/delta_rule_chunk_backward.cpp, regrouped so that no exp(-G) is ever formed alone):
//   1. dq  = E * (dO' S0^T);   b = exp(G_C - G) * (D dS^T);   dAqk = tril(dO' D^T);
//      dG_C = exp(G_C) * rowsum(dS * S0) + colsum(k * b)
//   2. dVb = X^T dD (dv = beta dVb);  R = beta (V - Kt S0);  a = -beta E (dVb S0^T);
//      dTm = dD R^T
//   3. dL = -X^T dTm X^T (strictly lower);  dAkk = beta dL
//   4. pairwise (decay exp(G_i - G_j), j <= i):  dq_i += sum_j dAqk_ij k_j,
//      a_i += sum_j dAkk_ij k_j,  b_j += sum_i (dAqk_ij q_i + dAkk_ij k_i)
//   5. dk = a + b,  dG = q dq + k (a - b),  dg_t = dG_C + sum_{i >= t} dG_i (KDA: pairwise
//      part of dG summed from the nearer end of the chunk),
//      dbeta = rowsum(dL * A) + rowsum(dVb * v) - rowsum((dVb S0^T) * Kt)
// KDA's pairwise decays use chunk_prepare's anchors (first row of each 16-row block): the
// operands carry factors <= 1 or bounded by 15 tokens of decay; a chunk whose decay leaves that
// range (raw g, the softplus gate) forms step 4 with no factor above 1 instead (exact_pairs:
// off-diagonal blocks on the tensor cores, the diagonal blocks elementwise in fp32).
// Scalar gates fold the decay into dAqk / dAkk. Products on bf16 tensor cores with fp32
// accumulation; G, dq, dk, dG fp32.
//
// A KDA layer's options (x.layer, runtime flags): the q / k rows are L2-normalised in shared
// memory once loaded, g and beta activated as loaded (kda_layer_math.cuh, as chunk_prepare), so
// dq, dk are the normalised rows' gradients (finish_qk_grads maps them to the raw rows'); dg is
// mapped to dgraw by every thread once the chunk's dg is in shared memory (graw kept in an extra
// bf16 tile), with the block's ddt_bias and dA_log terms (one per thread and one per warp) left
// in gd.gate_part for kda_gate_grads; dbeta to dbraw.
//
// Deterministic (no atomics): every sum over warps goes to slots with one owner each and is
// added up in a fixed order (dbeta: one partial per column half, kept by its owner thread across
// steps 2-3; dG_C: one per 16-row block, in sF while step 4's factors are not there yet).

#include <algorithm>
#include <cstdlib>

#include "ops/delta_rule/cuda/chunk_kernels.cuh"
#include "ops/delta_rule/cuda/delta_rule_cuda.h"
#include "ops/delta_rule/cuda/device_common.cuh"
#include "ops/delta_rule/cuda/kda_layer_math.cuh"

namespace kda::ops::cuda_detail {
namespace {

using bf16 = __nv_bfloat16;
constexpr int C = kChunk;
constexpr int kThreads = kBwdLocalThreads;
constexpr float kLog2e = 1.4426950408889634f;

constexpr size_t cmax(size_t a, size_t b) {
  return a > b ? a : b;
}

template <Gate GATE, int K, int V>
struct LocalLayout {
  static constexpr int LDK = K + 8, LDV = V + 8, LDC = C + 8, LDG = K + 4;
  static constexpr int LDT = cmax(LDK, LDV);  // step 2 / 4 tiles hold C x K or C x V
  static constexpr size_t tile_c = size_t(C) * LDC * 2, tile_k = size_t(C) * LDK * 2;
  static constexpr size_t tile_v = size_t(C) * LDV * 2, tile_t = size_t(C) * LDT * 2;
  static constexpr size_t bytes_s = size_t(K) * LDV * 2;
  // S0 (steps 1-2), then dG (fp32, step 5)
  static constexpr size_t off_s0 = 0, bytes_s0 = cmax(bytes_s, size_t(C) * LDG * 4);
  static constexpr size_t off_g = off_s0 + bytes_s0;
  static constexpr size_t bytes_g = GATE == Gate::channel ? size_t(C) * LDG * 4 : C * 4;
  static constexpr size_t off_q = off_g + bytes_g, off_k = off_q + tile_k;
  static constexpr size_t off_x = off_k + tile_k, off_a = off_x + tile_c;
  static constexpr size_t off_daqk = off_a + tile_c;
  // step 1: dS, dO, D; step 2: dD, v | dTm, dVb | tmp, R; step 4: Qs, Ks, Kn in tiles 0, 3, 1
  static constexpr size_t off_big = off_daqk + tile_c;
  static constexpr size_t bytes_big = cmax(bytes_s + 2 * tile_v, 4 * tile_t);
  static constexpr size_t off_small = off_big + bytes_big;
  // small: beta[C], dbeta[2][C] (a partial per column half), dGC[K], F[6][K]
  static constexpr size_t total = off_small + (3 * C + 7 * K) * 4;
  // KDA layer gate only: graw (bf16, C x K) for dg -> dgraw at the end
  static constexpr size_t off_graw = total, total_layer = total + size_t(C) * K * 2;
};

// mma accumulator element e of n-tile nt: row 16 * m_blk + gr (+8 for e >= 2), column
// n0 + 8 * nt + 2 * tq (+1 for odd e).
struct Frag {
  int gr, tq;
  __device__ int row(int m0, int e) const { return m0 + gr + (e >> 1) * 8; }
  __device__ int col(int n0, int nt, int e) const { return n0 + 8 * nt + 2 * tq + (e & 1); }
};

__device__ __forceinline__ float bf(const bf16* p) {
  return __bfloat162float(*p);
}

// Row sums of per-thread partials (rows gr and gr + 8) over the 4 lanes of a quad, added to the
// warp's own partial of each row (dst: its column half's): the quad's first lane owns the two
// slots in every step, so the adds need no atomics and keep their order run to run.
__device__ __forceinline__ void add_rows(float* dst, int r0, float lo, float hi, int tq) {
  lo += __shfl_xor_sync(0xffffffffu, lo, 1);
  lo += __shfl_xor_sync(0xffffffffu, lo, 2);
  hi += __shfl_xor_sync(0xffffffffu, hi, 1);
  hi += __shfl_xor_sync(0xffffffffu, hi, 2);
  if (tq == 0) {
    dst[r0] += lo;
    dst[r0 + 8] += hi;
  }
}

// Step 4 of a wide chunk (EXACT), blockwise: the warp's rows i lie in the 16-row
// block wm (anchor a = m0, its first row), so
//   4a / 4b (dq_i, a_i over j <= i): for blocks J < wm the B operand k_j 2^(G_a - G_j) (<= 1:
//     G falls along the chunk) is formed as its fragment is loaded and the product runs on the
//     tensor cores, the row scale 2^(G_i - G_a) (<= 1) after; the diagonal block elementwise;
//   4c (b_j over i >= j): for blocks I > wm the B operands q_i 2^(G_i - G_b), k_i 2^(G_i - G_b)
//     with b = m0 + 16 (the next block's first row; <= 1), the row scale 2^(G_b - G_j) (<= 1)
//     after; the diagonal block elementwise.
// No factor exceeds 1, so nothing overflows however wide the decay (rows past the chunk's end
// hold G constant). Measured on the H200 (session 25): the softplus-wide KDA layer fwd+bwd at
// 8 x 2048 took 18.7 ms with step 4 wholly elementwise (~64 exp2 an element and pair list), 15.0
// ms with this (16).
template <int K>
__device__ __forceinline__ void exact_pairs_blocked(const bf16* sq, const bf16* sk, const float* sG,
                                                    const bf16* sdAqk, const bf16* sdAkk,
                                                    float (&dq)[K / 16][4], float (&dk)[K / 16][4],
                                                    float (&dG)[K / 16][4], const Frag fr,
                                                    const int wm, const int m0, const int kb,
                                                    const int lane) {
  constexpr int LDK = K + 8, LDC = C + 8, LDG = K + 4, NTK = K / 16;
  const int gr = fr.gr, tq = fr.tq;
  // The factors of one load_b_kn fragment pair: b[2u] holds rows j0, j0 + 1 and b[2u + 1] rows
  // j0 + 8, j0 + 9 of column c0 + 8u. sign = 1: 2^(G_anchor - G_j) (rows before the anchor);
  // sign = -1: 2^(G_j - G_anchor) (rows after it).
  const auto row_factors = [&](float(&f)[8], int j0, int c0, const float* anchor, float sign) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const float ga = anchor[c0 + 8 * u];
      const float* g = sG + j0 * LDG + c0 + 8 * u;
      f[4 * u + 0] = fast_exp2(sign * (ga - g[0]));
      f[4 * u + 1] = fast_exp2(sign * (ga - g[LDG]));
      f[4 * u + 2] = fast_exp2(sign * (ga - g[8 * LDG]));
      f[4 * u + 3] = fast_exp2(sign * (ga - g[9 * LDG]));
    }
  };
  const auto scale_rows = [](uint32_t(&b)[4], const float(&f)[8]) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      b[2 * u] = scale_bf16x2(b[2 * u], f[4 * u], f[4 * u + 1]);
      b[2 * u + 1] = scale_bf16x2(b[2 * u + 1], f[4 * u + 2], f[4 * u + 3]);
    }
  };
  const float* g_a = sG + m0 * LDG;  // this block's anchor row
#pragma unroll 1
  for (int pass = 0; pass < 2; ++pass) {  // 4a: dAqk into dq; 4b: dAkk into a (dk, dG)
    const bf16* dA = pass == 0 ? sdAqk : sdAkk;
    float acc[NTK][4] = {};
    for (int J = 0; J < wm; ++J) {
      uint32_t a[4];
      load_a(a, dA, LDC, m0, 16 * J, lane);
#pragma unroll
      for (int np = 0; np < NTK / 2; ++np) {
        uint32_t b[4];
        float f[8];
        load_b_kn(b, sk, LDK, 16 * J, kb + 16 * np, lane);
        row_factors(f, 16 * J + 2 * tq, kb + 16 * np + gr, g_a, 1.f);
        scale_rows(b, f);
        mma_bf16(acc[2 * np], a, b[0], b[1]);
        mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < NTK; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = fr.row(m0, e), c = fr.col(kb, nt, e);
        const float g_r = sG[r * LDG + c];
        float v = acc[nt][e] * fast_exp2(g_r - g_a[c]);
        const int last = pass == 0 ? r : r - 1;  // dAqk keeps its diagonal, dAkk does not
        for (int j = m0; j <= last; ++j)
          v += bf(dA + r * LDC + j) * bf(sk + j * LDK + c) * exp2f(g_r - sG[j * LDG + c]);
        if (pass == 0) {
          dq[nt][e] += v;
        } else {
          dk[nt][e] += v;
          dG[nt][e] += bf(sk + r * LDK + c) * v;
        }
      }
  }
  // 4c: b_j = sum_{i >= j} (dAqk_ij q_i + dAkk_ij k_i) 2^(G_i - G_j) into dk, dG
  float acc[NTK][4] = {};
  const bool after = wm < C / 16 - 1;  // blocks below this one
  const float* g_b = sG + (after ? m0 + 16 : m0) * LDG;
  if (after) {
    for (int I = wm + 1; I < C / 16; ++I) {
      uint32_t aq[4], ak[4];
      load_a_trans(aq, sdAqk, LDC, m0, 16 * I, lane);
      load_a_trans(ak, sdAkk, LDC, m0, 16 * I, lane);
#pragma unroll
      for (int np = 0; np < NTK / 2; ++np) {
        uint32_t bq[4], bk[4];
        float f[8];
        load_b_kn(bq, sq, LDK, 16 * I, kb + 16 * np, lane);
        load_b_kn(bk, sk, LDK, 16 * I, kb + 16 * np, lane);
        row_factors(f, 16 * I + 2 * tq, kb + 16 * np + gr, g_b, -1.f);
        scale_rows(bq, f);
        scale_rows(bk, f);
        mma_bf16(acc[2 * np], aq, bq[0], bq[1]);
        mma_bf16(acc[2 * np + 1], aq, bq[2], bq[3]);
        mma_bf16(acc[2 * np], ak, bk[0], bk[1]);
        mma_bf16(acc[2 * np + 1], ak, bk[2], bk[3]);
      }
    }
  }
#pragma unroll
  for (int nt = 0; nt < NTK; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = fr.row(m0, e), c = fr.col(kb, nt, e);
      const float g_r = sG[r * LDG + c];
      float v = after ? acc[nt][e] * fast_exp2(g_b[c] - g_r) : 0.f;
      for (int i = r; i < m0 + 16; ++i) {
        float t = bf(sdAqk + i * LDC + r) * bf(sq + i * LDK + c);
        if (i > r) t += bf(sdAkk + i * LDC + r) * bf(sk + i * LDK + c);
        v += t * exp2f(sG[i * LDG + c] - g_r);
      }
      dk[nt][e] += v;
      dG[nt][e] -= bf(sk + r * LDK + c) * v;
    }
}

// One (chunk, value head). EXACT (KDA only, unless the gate is bounded inside the split's range:
// decay_within_split): the instance whose step 4 forms wide-decay chunks' pairwise terms with no
// factor above 1 (exact_pairs_blocked); a separate instance, so that the default one keeps its
// registers (the extra branch costs the K = 128 instance ~40 bytes of spills).
template <Gate GATE, int K, int V, bool EXACT>
__device__ __forceinline__ void bwd_local_chunk(const ChunkTokens& x, const ChunkWorkspace& ws,
                                                const ChunkGrads& gd, const int64_t chunk,
                                                const int hv) {
  using L = LocalLayout<GATE, K, V>;
  constexpr int LDK = L::LDK, LDV = L::LDV, LDC = L::LDC, LDG = L::LDG, LDT = L::LDT;
  constexpr bool kChannel = GATE == Gate::channel;
  constexpr int NTK = K / 16, NTV = V / 16;  // n8-tiles per warp (each warp: half the columns)
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sS0 = reinterpret_cast<bf16*>(smem + L::off_s0);
  float* sdG = reinterpret_cast<float*>(smem + L::off_s0);
  float* sG = reinterpret_cast<float*>(smem + L::off_g);
  bf16* sq = reinterpret_cast<bf16*>(smem + L::off_q);
  bf16* sk = reinterpret_cast<bf16*>(smem + L::off_k);
  bf16* sX = reinterpret_cast<bf16*>(smem + L::off_x);
  bf16* sA = reinterpret_cast<bf16*>(smem + L::off_a);  // A, then dAkk (in place)
  bf16* sdAqk = reinterpret_cast<bf16*>(smem + L::off_daqk);
  unsigned char* big = smem + L::off_big;
  bf16* sdS = reinterpret_cast<bf16*>(big);
  bf16* sdO = reinterpret_cast<bf16*>(big + L::bytes_s);
  bf16* sD = reinterpret_cast<bf16*>(big + L::bytes_s + L::tile_v);
  bf16* t0 = reinterpret_cast<bf16*>(big);  // step 2+ tiles
  bf16* t1 = reinterpret_cast<bf16*>(big + L::tile_t);
  bf16* t2 = reinterpret_cast<bf16*>(big + 2 * L::tile_t);
  bf16* t3 = reinterpret_cast<bf16*>(big + 3 * L::tile_t);
  float* sBeta = reinterpret_cast<float*>(smem + L::off_small);
  float* sdBeta = sBeta + C;  // [2][C]: the column halves' partials (add_rows)
  float* sdGC = sdBeta + 2 * C;
  float* sF = sdGC + K;
  bf16* sGraw = reinterpret_cast<bf16*>(smem + L::off_graw);  // KDA layer gate only
  const bool layer_gate = kChannel && x.layer.gate;

  const int h = hv / (x.HV / x.H);
  const int64_t tok0 = ws.chunk_tok0[chunk];
  const int len = int(ws.chunk_len[chunk]);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp & 3, wn = warp >> 2;
  const Frag fr{lane >> 2, lane & 3};
  const int gr = fr.gr, tq = fr.tq;
  const size_t ch = size_t(chunk) * x.HV + hv;
  const int m0 = 16 * wm;       // this warp's 16 output rows
  const int kb = wn * (K / 2);  // its C x K columns
  const int vb = wn * (V / 2);  // its C x V columns
  const int cb = wn * 32;       // its C x C columns

  // ---- loads: q, k, dO (token rows, zero past the end), X, A, S0, dS, D (workspace) ----
  for (int idx = tid; idx < C * K / 8; idx += kThreads) {
    const int i = idx / (K / 8), c = (idx % (K / 8)) * 8;
    if (i < len) {
      cp_async16(sq + i * LDK + c, x.q + (size_t(tok0 + i) * x.H + h) * K + c);
      cp_async16(sk + i * LDK + c, x.k + (size_t(tok0 + i) * x.H + h) * K + c);
    } else {
      *reinterpret_cast<uint4*>(sq + i * LDK + c) = make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>(sk + i * LDK + c) = make_uint4(0, 0, 0, 0);
    }
  }
  for (int idx = tid; idx < C * V / 8; idx += kThreads) {
    const int i = idx / (V / 8), c = (idx % (V / 8)) * 8;
    if (i < len)
      cp_async16(sdO + i * LDV + c, gd.dO + (size_t(tok0 + i) * x.HV + hv) * V + c);
    else
      *reinterpret_cast<uint4*>(sdO + i * LDV + c) = make_uint4(0, 0, 0, 0);
    cp_async16(sD + i * LDV + c, ws.D + (ch * C + i) * V + c);
  }
  for (int idx = tid; idx < C * C / 8; idx += kThreads) {
    const int i = idx / (C / 8), c = (idx % (C / 8)) * 8;
    cp_async16(sX + i * LDC + c, ws.X + (ch * C + i) * C + c);
    cp_async16(sA + i * LDC + c, ws.A + (ch * C + i) * C + c);
  }
  for (int idx = tid; idx < K * V / 8; idx += kThreads) {
    const int i = idx / (V / 8), c = (idx % (V / 8)) * 8;
    cp_async16(sS0 + i * LDV + c, ws.S0 + (ch * K + i) * V + c);
    cp_async16(sdS + i * LDV + c, gd.dS + (ch * K + i) * V + c);
  }
  cp_async_commit();

  // gate cumulative sums in log2 units (as chunk_prepare); rows past the end repeat the last
  if (tid < C) {
    float b = tid < len ? to_f32(x.beta[size_t(tok0 + tid) * x.HV + hv]) : 0.f;
    if (x.layer.beta_sigmoid && tid < len) b = kda_beta_sigmoid(b);
    sBeta[tid] = b;
    sdBeta[tid] = 0.f;
    sdBeta[C + tid] = 0.f;
  }
  if constexpr (kChannel) {
    constexpr int kSegs = kThreads / K, kRows = C / kSegs;
    const int c = tid % K, seg = tid / K;
    float gv[kRows];  // all loads first (predicated), then the arithmetic
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int i = seg * kRows + r;
      gv[r] = i < len ? to_f32(x.g[(size_t(tok0 + i) * x.HV + hv) * K + c]) : 0.f;
    }
    if (layer_gate) {  // g holds graw: keep it (exact in bf16), activate; rows past the end 0
      const float a = x.layer.A_log ? __expf(x.layer.A_log[hv]) : 1.f;
      const float bias = x.layer.dt_bias ? x.layer.dt_bias[size_t(hv) * K + c] : 0.f;
      const float lb = x.layer.lower_bound;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int i = seg * kRows + r;
        sGraw[i * K + c] = __float2bfloat16_rn(gv[r]);
        const float z = gv[r] + bias;
        const float act =
            x.layer.gate_softplus ? kda_gate_softplus(a, z) : kda_gate_bounded(lb, a, z);
        gv[r] = i < len ? act : 0.f;
      }
    }
    float run = 0.f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int i = seg * kRows + r;
      run += gv[r] * kLog2e;
      sG[i * LDG + c] = run;
    }
    __syncthreads();
    float offset = 0.f;
    for (int s = 0; s < seg; ++s) offset += sG[((s + 1) * kRows - 1) * LDG + c];
    __syncthreads();
    if (seg > 0) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) sG[(seg * kRows + r) * LDG + c] += offset;
    }
  } else if constexpr (GATE == Gate::scalar) {
    if (warp == 0) {
      const int i0 = 2 * lane, i1 = 2 * lane + 1;
      const float x0 = i0 < len ? to_f32(x.g[size_t(tok0 + i0) * x.HV + hv]) * kLog2e : 0.f;
      const float x1 = i1 < len ? to_f32(x.g[size_t(tok0 + i1) * x.HV + hv]) * kLog2e : 0.f;
      float scan = x0 + x1;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const float up = __shfl_up_sync(0xffffffffu, scan, off);
        if (lane >= off) scan += up;
      }
      sG[i1] = scan;
      sG[i0] = scan - x1;
    }
  } else {
    if (tid < C) sG[tid] = 0.f;
  }
  cp_async_wait<0>();
  __syncthreads();
  if (x.layer.l2norm_qk) {
    // q, k rows <- row / max(|row|, 1e-6) in place: two threads a row (64 of q, 64 of k)
    static_assert(kThreads == 4 * C, "two threads per row of q and of k");
    const int rr = tid >> 1, half = tid & 1;
    bf16* row = (rr < C ? sq : sk) + (rr % C) * LDK + half * (K / 2);
    const float inv = pair_row_inv_norm<K>(row);
#pragma unroll
    for (int c = 0; c < K / 2; c += 8) {
      float v8[8];
      load8(row + c, v8);
#pragma unroll
      for (int e = 0; e < 8; ++e) v8[e] *= inv;
      store8_bf16(row + c, v8);
    }
    __syncthreads();
  }

  // G (log2 units) at (row, channel), and at the chunk's last token
  auto gat = [&](int i, int c) -> float {
    if constexpr (kChannel) return sG[i * LDG + c];
    return sG[i];
  };
  const int last = len - 1;

  float dq[NTK][4], dk[NTK][4], dG[NTK][4];

  // ---- step 1 ----
  {
    // 1a: dq = scale E (dO S0^T)
    float acc[NTK][4] = {};
#pragma unroll
    for (int kk = 0; kk < V / 16; ++kk) {
      uint32_t a[4];
      load_a(a, sdO, LDV, m0, 16 * kk, lane);
#pragma unroll
      for (int np = 0; np < NTK / 2; ++np) {
        uint32_t b[4];
        load_b_nk(b, sS0, LDV, 16 * kk, kb + 16 * np, lane);
        mma_bf16(acc[2 * np], a, b[0], b[1]);
        mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < NTK; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = fr.row(m0, e), c = fr.col(kb, nt, e);
        dq[nt][e] = x.scale * fast_exp2(gat(r, c)) * acc[nt][e];
      }
  }
  {
    // 1b: b = exp(G_C - G) (D dS^T); dk = b, dG = -k b, dG_C += colsum(k b) (a part per row
    // block in sF, unused until step 4)
    float acc[NTK][4] = {};
#pragma unroll
    for (int kk = 0; kk < V / 16; ++kk) {
      uint32_t a[4];
      load_a(a, sD, LDV, m0, 16 * kk, lane);
#pragma unroll
      for (int np = 0; np < NTK / 2; ++np) {
        uint32_t b[4];
        load_b_nk(b, sdS, LDV, 16 * kk, kb + 16 * np, lane);
        mma_bf16(acc[2 * np], a, b[0], b[1]);
        mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < NTK; ++nt) {
      float colsum[2] = {0.f, 0.f};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = fr.row(m0, e), c = fr.col(kb, nt, e);
        const float bv = fast_exp2(gat(last, c) - gat(r, c)) * acc[nt][e];
        const float kv = bf(sk + r * LDK + c);
        dk[nt][e] = bv;
        dG[nt][e] = -kv * bv;
        colsum[e & 1] += kv * bv;
      }
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        float v = colsum[p];
        v += __shfl_xor_sync(0xffffffffu, v, 4);
        v += __shfl_xor_sync(0xffffffffu, v, 8);
        v += __shfl_xor_sync(0xffffffffu, v, 16);
        if (gr == 0) sF[wm * K + kb + 8 * nt + 2 * tq + p] = v;  // this row block's part
      }
    }
  }
  {
    // 1c: dAqk = tril(scale dO D^T) (scalar gates: times exp(G_i - G_j))
    float acc[4][4] = {};
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      if (2 * wn + np > wm) continue;  // blocks above the diagonal stay zero
#pragma unroll
      for (int kk = 0; kk < V / 16; ++kk) {
        uint32_t a[4], b[4];
        load_a(a, sdO, LDV, m0, 16 * kk, lane);
        load_b_nk(b, sD, LDV, 16 * kk, cb + 16 * np, lane);
        mma_bf16(acc[2 * np], a, b[0], b[1]);
        mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int r = fr.row(m0, e), j = fr.col(cb, nt, e);
        float v0 = j <= r ? x.scale * acc[nt][e] : 0.f;
        float v1 = j + 1 <= r ? x.scale * acc[nt][e + 1] : 0.f;
        if constexpr (GATE == Gate::scalar) {
          if (j <= r) v0 *= fast_exp2(sG[r] - sG[j]);
          if (j + 1 <= r) v1 *= fast_exp2(sG[r] - sG[j + 1]);
        }
        *reinterpret_cast<uint32_t*>(sdAqk + r * LDC + j) = pack_bf16(v0, v1);
      }
  }
  {
    // 1d: dG_C = exp(G_C) rowsum(dS * S0) (every row written), then plus 1b's parts
    constexpr int kPer = kThreads / K;  // threads per state row (2 or 4, adjacent lanes)
    const int r = tid / kPer, part = tid % kPer;
    float s = 0.f;
    for (int c = part * (V / kPer); c < (part + 1) * (V / kPer); c += 2) {
      const float2 a = unpack_bf16(*reinterpret_cast<const uint32_t*>(sdS + r * LDV + c));
      const float2 b = unpack_bf16(*reinterpret_cast<const uint32_t*>(sS0 + r * LDV + c));
      s += a.x * b.x + a.y * b.y;
    }
#pragma unroll
    for (int off = 1; off < kPer; off <<= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (part == 0) sdGC[r] = fast_exp2(gat(last, r)) * s;
  }
  __syncthreads();
  static_assert(4 * K <= 6 * K, "1b's parts fit in sF");
  for (int c = tid; c < K; c += kThreads)
    sdGC[c] += (sF[c] + sF[K + c]) + (sF[2 * K + c] + sF[3 * K + c]);

  // ---- step 2: dD -> t0, v -> t1 ----
  bf16* sdD = t0;
  bf16* sv = t1;
  for (int idx = tid; idx < C * V / 8; idx += kThreads) {
    const int i = idx / (V / 8), c = (idx % (V / 8)) * 8;
    cp_async16(sdD + i * LDT + c, gd.dD + (ch * C + i) * V + c);
    if (i < len)
      cp_async16(sv + i * LDT + c, x.v + (size_t(tok0 + i) * x.HV + hv) * V + c);
    else
      *reinterpret_cast<uint4*>(sv + i * LDT + c) = make_uint4(0, 0, 0, 0);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  bf16* sdVb = t2;
  bf16* sR = t3;
  {
    // 2a: dVb = X^T dD; dv = beta dVb; dbeta += rowsum(dVb * v)
    float acc[NTV][4] = {};
    for (int I = wm; I < C / 16; ++I) {
      uint32_t a[4];
      load_a_trans(a, sX, LDC, m0, 16 * I, lane);
#pragma unroll
      for (int np = 0; np < NTV / 2; ++np) {
        uint32_t b[4];
        load_b_kn(b, sdD, LDT, 16 * I, vb + 16 * np, lane);
        mma_bf16(acc[2 * np], a, b[0], b[1]);
        mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
    float rs[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < NTV; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int r = fr.row(m0, e), c = fr.col(vb, nt, e);
        const float d0 = acc[nt][e], d1 = acc[nt][e + 1];
        const float2 vv = unpack_bf16(*reinterpret_cast<const uint32_t*>(sv + r * LDT + c));
        rs[e >> 1] += d0 * vv.x + d1 * vv.y;
        *reinterpret_cast<uint32_t*>(sdVb + r * LDT + c) = pack_bf16(d0, d1);
        if (r < len)
          *reinterpret_cast<uint32_t*>(gd.dv + (size_t(tok0 + r) * x.HV + hv) * V + c) =
              pack_bf16(sBeta[r] * d0, sBeta[r] * d1);
      }
    add_rows(sdBeta + wn * C, m0 + gr, rs[0], rs[1], tq);
  }
  {
    // 2b: R = beta (v - Kt S0), Kt = k E (A fragments scaled on the fly)
    float acc[NTV][4] = {};
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
      uint32_t a[4];
      load_a(a, sk, LDK, m0, 16 * kk, lane);
      if constexpr (GATE != Gate::none) {
        const int r0 = m0 + gr, c0 = 16 * kk + 2 * tq;
        a[0] = scale_bf16x2(a[0], fast_exp2(gat(r0, c0)), fast_exp2(gat(r0, c0 + 1)));
        a[1] = scale_bf16x2(a[1], fast_exp2(gat(r0 + 8, c0)), fast_exp2(gat(r0 + 8, c0 + 1)));
        a[2] = scale_bf16x2(a[2], fast_exp2(gat(r0, c0 + 8)), fast_exp2(gat(r0, c0 + 9)));
        a[3] = scale_bf16x2(a[3], fast_exp2(gat(r0 + 8, c0 + 8)), fast_exp2(gat(r0 + 8, c0 + 9)));
      }
#pragma unroll
      for (int np = 0; np < NTV / 2; ++np) {
        uint32_t b[4];
        load_b_kn(b, sS0, LDV, 16 * kk, vb + 16 * np, lane);
        mma_bf16(acc[2 * np], a, b[0], b[1]);
        mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < NTV; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int r = fr.row(m0, e), c = fr.col(vb, nt, e);
        const float2 vv = unpack_bf16(*reinterpret_cast<const uint32_t*>(sv + r * LDT + c));
        *reinterpret_cast<uint32_t*>(sR + r * LDT + c) =
            pack_bf16(sBeta[r] * (vv.x - acc[nt][e]), sBeta[r] * (vv.y - acc[nt][e + 1]));
      }
  }
  __syncthreads();
  bf16* sdTm = t1;  // v is dead
  {
    // 2d: a = -beta E (dVb S0^T); dbeta -= rowsum((dVb S0^T) * Kt)
    float acc[NTK][4] = {};
#pragma unroll
    for (int kk = 0; kk < V / 16; ++kk) {
      uint32_t a[4];
      load_a(a, sdVb, LDT, m0, 16 * kk, lane);
#pragma unroll
      for (int np = 0; np < NTK / 2; ++np) {
        uint32_t b[4];
        load_b_nk(b, sS0, LDV, 16 * kk, kb + 16 * np, lane);
        mma_bf16(acc[2 * np], a, b[0], b[1]);
        mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
    float rs[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < NTK; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = fr.row(m0, e), c = fr.col(kb, nt, e);
        const float E = fast_exp2(gat(r, c)), kv = bf(sk + r * LDK + c);
        rs[e >> 1] -= acc[nt][e] * kv * E;
        const float av = -sBeta[r] * E * acc[nt][e];
        dk[nt][e] += av;
        dG[nt][e] += kv * av;
      }
    add_rows(sdBeta + wn * C, m0 + gr, rs[0], rs[1], tq);
  }
  {
    // 2e: dTm = dD R^T (full C x C)
    float acc[4][4] = {};
#pragma unroll
    for (int kk = 0; kk < V / 16; ++kk) {
      uint32_t a[4];
      load_a(a, sdD, LDT, m0, 16 * kk, lane);
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        uint32_t b[4];
        load_b_nk(b, sR, LDT, 16 * kk, cb + 16 * np, lane);
        mma_bf16(acc[2 * np], a, b[0], b[1]);
        mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int r = fr.row(m0, e), j = fr.col(cb, nt, e);
        *reinterpret_cast<uint32_t*>(sdTm + r * LDT + j) = pack_bf16(acc[nt][e], acc[nt][e + 1]);
      }
  }
  __syncthreads();

  // ---- step 3: tmp = X^T dTm -> t2 (dVb dead); dL = -tmp X^T; dAkk = beta dL (into sA) ----
  bf16* sTmp = t2;
  {
    float acc[4][4] = {};
    for (int P = wm; P < C / 16; ++P) {
      uint32_t a[4];
      load_a_trans(a, sX, LDC, m0, 16 * P, lane);
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        uint32_t b[4];
        load_b_kn(b, sdTm, LDT, 16 * P, cb + 16 * np, lane);
        mma_bf16(acc[2 * np], a, b[0], b[1]);
        mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int r = fr.row(m0, e), j = fr.col(cb, nt, e);
        *reinterpret_cast<uint32_t*>(sTmp + r * LDT + j) = pack_bf16(acc[nt][e], acc[nt][e + 1]);
      }
  }
  __syncthreads();
  // The EXACT instance: a chunk whose decay leaves the anchors' split (the test
  // chunk_prepare flags chunks by) forms step 4's pairwise terms by exact_pairs_blocked instead
  bool exact_pairs = false;
  if constexpr (kChannel && EXACT) {
    bool wide = false;
    for (int idx = tid; idx < C * K; idx += kThreads) {
      const int i = idx / K, c = idx % K;
      wide |= sG[(i & ~15) * LDG + c] - sG[i * LDG + c] > ChunkWorkspace::kWideDecayLog2;
    }
    exact_pairs = __syncthreads_or(wide);
  }
  // KDA operands for step 4 (t0 = Qs, t3 = Ks, t1 = Kn; dD, R, dTm are dead):
  //   Qs_i = q_i 2^(G_i - G_a), Ks_i = k_i 2^(G_i - G_a), Kn_i = k_i 2^(G_a - G_i), a = 16 (i / 16)
  //   F[I, J] = 2^(G_aI - G_aJ) for J < I
  bf16* sQs = kChannel ? t0 : sq;
  bf16* sKs = kChannel ? t3 : sk;
  bf16* sKn = kChannel ? t1 : sk;
  if (kChannel && !exact_pairs) {
    for (int idx = tid; idx < C * K / 8; idx += kThreads) {
      const int i = idx / (K / 8), c = (idx % (K / 8)) * 8;
      float q8[8], k8[8], qs[8], ks[8], kn[8];
      load8(sq + i * LDK + c, q8);
      load8(sk + i * LDK + c, k8);
      const float* gi = sG + i * LDG + c;
      const float* ga = sG + (i & ~15) * LDG + c;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float rel = gi[e] - ga[e];
        const float es = fast_exp2(rel);
        qs[e] = q8[e] * es;
        ks[e] = k8[e] * es;
        kn[e] = k8[e] * fast_exp2(-rel);
      }
      store8_bf16(sQs + i * LDT + c, qs);
      store8_bf16(sKs + i * LDT + c, ks);
      store8_bf16(sKn + i * LDT + c, kn);
    }
    for (int idx = tid; idx < 6 * K; idx += kThreads) {
      const int p = idx / K, c = idx % K;
      const int I = p < 1 ? 1 : p < 3 ? 2 : 3;
      const int J = p - I * (I - 1) / 2;
      sF[idx] = fast_exp2(sG[16 * I * LDG + c] - sG[16 * J * LDG + c]);
    }
  }
  {
    float acc[4][4] = {};
#pragma unroll
    for (int np = 0; np < 2; ++np) {
      const int Jb = 2 * wn + np;
      if (Jb > wm) continue;
      for (int Q = 0; Q <= Jb; ++Q) {  // X[j][q] = 0 for q > j
        uint32_t a[4], b[4];
        load_a(a, sTmp, LDT, m0, 16 * Q, lane);
        load_b_nk(b, sX, LDC, 16 * Q, cb + 16 * np, lane);
        mma_bf16(acc[2 * np], a, b[0], b[1]);
        mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
    float rs[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 4; e += 2) {
        const int r = fr.row(m0, e), j = fr.col(cb, nt, e);
        if (cb + 8 * nt > m0 + 15) continue;  // above the diagonal blocks: A and dAkk are 0
        const float2 av = unpack_bf16(*reinterpret_cast<const uint32_t*>(sA + r * LDC + j));
        const float l0 = j < r ? -acc[nt][e] : 0.f, l1 = j + 1 < r ? -acc[nt][e + 1] : 0.f;
        rs[e >> 1] += l0 * av.x + l1 * av.y;
        float d0 = sBeta[r] * l0, d1 = sBeta[r] * l1;
        if constexpr (GATE == Gate::scalar) {
          if (j < r) d0 *= fast_exp2(sG[r] - sG[j]);
          if (j + 1 < r) d1 *= fast_exp2(sG[r] - sG[j + 1]);
        }
        *reinterpret_cast<uint32_t*>(sA + r * LDC + j) = pack_bf16(d0, d1);
      }
    add_rows(sdBeta + wn * C, m0 + gr, rs[0], rs[1], tq);
  }
  __syncthreads();
  const bf16* sdAkk = sA;
  if constexpr (kChannel) {
    // Keep the pairwise part of dG apart (see step 5): park the rest, q dq included, in the S0
    // region (dead since 2d) and restart dG at -q dq so that step 5's "+ q dq" leaves the
    // pairwise part alone.
#pragma unroll
    for (int nt = 0; nt < NTK; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = fr.row(m0, e), c = fr.col(kb, nt, e);
        const float qd = bf(sq + r * LDK + c) * dq[nt][e];
        sdG[r * LDG + c] = dG[nt][e] + qd;
        dG[nt][e] = -qd;
      }
  }

  // ---- step 4: pairwise terms ----
  if (!exact_pairs) {
    // 4a: dq_i += 2^(G_i - G_aI) sum_{J <= I} dAqk[I, J] (Kn_J F[I, J]); 4b: the same with dAkk
    // into a (dk += a, dG += k a)
#pragma unroll
    for (int pass = 0; pass < 2; ++pass) {
      const bf16* dA = pass == 0 ? sdAqk : sdAkk;
      float acc[NTK][4] = {};
      for (int J = 0; J <= wm; ++J) {
        uint32_t a[4];
        load_a(a, dA, LDC, m0, 16 * J, lane);
#pragma unroll
        for (int np = 0; np < NTK / 2; ++np) {
          uint32_t b[4];
          load_b_kn(b, sKn, kChannel ? LDT : LDK, 16 * J, kb + 16 * np, lane);
          if constexpr (kChannel) {
            if (J < wm) {
              const float* f = sF + (wm * (wm - 1) / 2 + J) * K + kb + 16 * np + gr;
              b[0] = scale_bf16x2(b[0], f[0], f[0]);
              b[1] = scale_bf16x2(b[1], f[0], f[0]);
              b[2] = scale_bf16x2(b[2], f[8], f[8]);
              b[3] = scale_bf16x2(b[3], f[8], f[8]);
            }
          }
          mma_bf16(acc[2 * np], a, b[0], b[1]);
          mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < NTK; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = fr.row(m0, e), c = fr.col(kb, nt, e);
          float v = acc[nt][e];
          if constexpr (kChannel) v *= fast_exp2(sG[r * LDG + c] - sG[m0 * LDG + c]);
          if (pass == 0) {
            dq[nt][e] += v;
          } else {
            dk[nt][e] += v;
            dG[nt][e] += bf(sk + r * LDK + c) * v;
          }
        }
    }
    {
      // 4c: b_j += 2^(G_aJ - G_j) sum_{I >= J} (dAqk[I, J]^T Qs_I + dAkk[I, J]^T Ks_I) F[I, J]
      float acc[NTK][4] = {};
      for (int I = wm; I < C / 16; ++I) {
        uint32_t aq[4], ak[4];
        load_a_trans(aq, sdAqk, LDC, m0, 16 * I, lane);
        load_a_trans(ak, sdAkk, LDC, m0, 16 * I, lane);
#pragma unroll
        for (int np = 0; np < NTK / 2; ++np) {
          uint32_t bq[4], bk[4];
          load_b_kn(bq, sQs, kChannel ? LDT : LDK, 16 * I, kb + 16 * np, lane);
          load_b_kn(bk, sKs, kChannel ? LDT : LDK, 16 * I, kb + 16 * np, lane);
          if constexpr (kChannel) {
            if (I > wm) {
              const float* f = sF + (I * (I - 1) / 2 + wm) * K + kb + 16 * np + gr;
#pragma unroll
              for (int u = 0; u < 2; ++u) {
                bq[u] = scale_bf16x2(bq[u], f[0], f[0]);
                bk[u] = scale_bf16x2(bk[u], f[0], f[0]);
                bq[u + 2] = scale_bf16x2(bq[u + 2], f[8], f[8]);
                bk[u + 2] = scale_bf16x2(bk[u + 2], f[8], f[8]);
              }
            }
          }
          mma_bf16(acc[2 * np], aq, bq[0], bq[1]);
          mma_bf16(acc[2 * np + 1], aq, bq[2], bq[3]);
          mma_bf16(acc[2 * np], ak, bk[0], bk[1]);
          mma_bf16(acc[2 * np + 1], ak, bk[2], bk[3]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < NTK; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = fr.row(m0, e), c = fr.col(kb, nt, e);
          float v = acc[nt][e];
          if constexpr (kChannel) v *= fast_exp2(sG[m0 * LDG + c] - sG[r * LDG + c]);
          dk[nt][e] += v;
          dG[nt][e] -= bf(sk + r * LDK + c) * v;
        }
    }
  } else {
    exact_pairs_blocked<K>(sq, sk, sG, sdAqk, sdAkk, dq, dk, dG, fr, wm, m0, kb, lane);
  }

  // ---- step 5: dG += q dq; write dq, dk; dg by reverse cumulative sum; dbeta ----
  // KDA: dg_t = dG_C + sum_{i >= t} (inter_i + pair_i). The pairwise terms of the chunk sum to
  // zero (each pair adds at i what it takes at j), so sum_{i >= t} pair_i = -sum_{i < t} pair_i;
  // the shorter side (prefix for t < C / 2) carries less bf16 rounding noise.
  float* sdGp = reinterpret_cast<float*>(big);  // KDA: the pairwise part (step 4's tiles dead)
  static_assert(L::bytes_big >= size_t(C) * LDG * 4, "pairwise dG tile");
  if constexpr (kChannel) __syncthreads();
  float* dG_out = kChannel ? sdGp : sdG;
  const bool grouped = gd.dq_part != nullptr;
#pragma unroll
  for (int nt = 0; nt < NTK; ++nt)
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      const int r = fr.row(m0, e), c = fr.col(kb, nt, e);
      dG[nt][e] += bf(sq + r * LDK + c) * dq[nt][e];
      dG[nt][e + 1] += bf(sq + r * LDK + c + 1) * dq[nt][e + 1];
      *reinterpret_cast<float2*>(dG_out + r * LDG + c) = make_float2(dG[nt][e], dG[nt][e + 1]);
      if (r < len) {
        if (grouped) {
          const size_t off = (size_t(tok0 + r) * x.HV + hv) * K + c;
          *reinterpret_cast<float2*>(gd.dq_part + off) = make_float2(dq[nt][e], dq[nt][e + 1]);
          *reinterpret_cast<float2*>(gd.dk_part + off) = make_float2(dk[nt][e], dk[nt][e + 1]);
        } else {
          const size_t off = (size_t(tok0 + r) * x.H + h) * K + c;
          *reinterpret_cast<uint32_t*>(gd.dq + off) = pack_bf16(dq[nt][e], dq[nt][e + 1]);
          *reinterpret_cast<uint32_t*>(gd.dk + off) = pack_bf16(dk[nt][e], dk[nt][e + 1]);
        }
      }
    }
  __syncthreads();
  if (tid < len) {
    float db = sdBeta[tid] + sdBeta[C + tid];
    if (x.layer.beta_sigmoid) db *= sBeta[tid] * (1.f - sBeta[tid]);  // dbraw
    gd.dbeta[size_t(tok0 + tid) * x.HV + hv] = __float2bfloat16_rn(db);
  }
  if constexpr (kChannel) {
    // Two passes: the K channel threads form dg by the two-sided sums (a serial walk of the
    // chunk's rows, a few shared-memory adds a row) into sdG; then every thread maps a share of
    // the rows to dgraw and writes them (the gate's backward has transcendentals: it ran inside
    // the serial walk on half the threads before).
    for (int c = tid; c < K; c += kThreads) {
      float inter = sdGC[c], pair = 0.f;
      for (int i = C - 1; i >= 0; --i) {
        inter += sdG[i * LDG + c];
        pair += sdGp[i * LDG + c];
        sdG[i * LDG + c] = i >= C / 2 ? inter + pair : inter;  // (row i read above, then replaced)
      }
      float prefix = 0.f;  // the rows i < C / 2: suffix minus the pairwise prefix
      for (int i = 0; i < C / 2; ++i) {
        sdG[i * LDG + c] -= prefix;
        prefix += sdGp[i * LDG + c];
      }
    }
    __syncthreads();
    // KDA layer gate: dg -> dgraw; this thread's channel's ddt_bias and dA_log terms
    static_assert(kThreads % K == 0, "a thread keeps one channel");
    const int c = tid % K;
    const float a = layer_gate && x.layer.A_log ? __expf(x.layer.A_log[hv]) : 1.f;
    const float bias = layer_gate && x.layer.dt_bias ? x.layer.dt_bias[size_t(hv) * K + c] : 0.f;
    float dbias = 0.f, dA = 0.f;
    bf16* dg = gd.dg + (size_t(tok0) * x.HV + hv) * K + c;  // row i at dg[i * HV * K]
    for (int i = tid / K; i < len; i += kThreads / K) {
      float v = sdG[i * LDG + c];
      if (layer_gate) {
        float dz, da;
        kda_gate_grad(x.layer.gate_softplus, x.layer.lower_bound, a,
                      __bfloat162float(sGraw[i * K + c]) + bias, v, dz, da);
        dbias += dz;
        dA += da;
        v = dz;
      }
      dg[size_t(i) * x.HV * K] = __float2bfloat16_rn(v);
    }
    if (layer_gate && gd.gate_part) {  // every thread is here: a term per thread, one per warp
      float* part = gd.gate_part + ch * kGatePartFloats;
      part[tid] = dbias;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) dA += __shfl_xor_sync(0xffffffffu, dA, off);
      if (lane == 0) part[kThreads + warp] = dA;
    }
  } else if constexpr (GATE == Gate::scalar) {
    // row totals, then a suffix sum over the 64 rows (one warp, two rows per lane)
    float* rows = sdBeta;  // dbeta was written above; reuse after a barrier
    __syncthreads();
    if (tid < C) {
      float s = 0.f;
      for (int c = 0; c < K; ++c) s += sdG[tid * LDG + c];
      rows[tid] = s;
    }
    __syncthreads();
    if (warp == 0) {
      float gc = 0.f;
      for (int c = lane; c < K; c += 32) gc += sdGC[c];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) gc += __shfl_xor_sync(0xffffffffu, gc, off);
      // lane l owns rows 2l, 2l + 1; suffix sums via an inclusive scan from the top
      const float r0 = rows[2 * lane], r1 = rows[2 * lane + 1];
      float scan = r0 + r1;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const float dn = __shfl_down_sync(0xffffffffu, scan, off);
        if (lane + off < 32) scan += dn;
      }
      const float s0 = scan + gc, s1 = scan - r0 + gc;  // suffix from 2l and from 2l + 1
      if (2 * lane < len) gd.dg[size_t(tok0 + 2 * lane) * x.HV + hv] = __float2bfloat16_rn(s0);
      if (2 * lane + 1 < len)
        gd.dg[size_t(tok0 + 2 * lane + 1) * x.HV + hv] = __float2bfloat16_rn(s1);
    }
  }
}

// With ws.wide_flag (KDA chunks tested for wide decays by chunk_prepare): the default instance
// takes the grid's unflagged chunks and the EXACT instance, on a grid of its own, walks the
// list of the flagged ones; so only wide chunks pay for the exact path. Without it: the
// grid's every chunk, in either instance.
template <Gate GATE, int K, int V, bool EXACT>
__global__ void __launch_bounds__(kThreads, 1)
    chunk_bwd_local_kernel(const ChunkTokens x, const ChunkWorkspace ws, const ChunkGrads gd) {
  if constexpr (EXACT) {                          // one loop, so that the body is inlined once
    const bool listed = ws.wide_flag != nullptr;  // (uniform: a kernel parameter)
    // (the count clamped to the list's length: a lone KDA_BWD_STAGES=local run on a fresh
    // workspace must not walk past it)
    const unsigned entries = unsigned(ws.num_chunks) * unsigned(x.HV);
    const unsigned n = listed ? min(*ws.wide_count, entries) : 1u, step = listed ? gridDim.x : 1u;
    for (unsigned e = listed ? blockIdx.x : 0u; e < n; e += step) {
      const unsigned entry = listed ? ws.wide_list[e] : blockIdx.x * unsigned(x.HV) + blockIdx.y;
      bwd_local_chunk<GATE, K, V, true>(x, ws, gd, entry / unsigned(x.HV),
                                        int(entry % unsigned(x.HV)));
      __syncthreads();  // the next chunk reuses the shared memory
    }
  } else {
    if (ws.wide_flag && ws.wide_flag[size_t(blockIdx.x) * x.HV + blockIdx.y]) return;  // listed
    bwd_local_chunk<GATE, K, V, false>(x, ws, gd, blockIdx.x, int(blockIdx.y));
  }
}

template <Gate GATE, int K, int V, bool EXACT>
void launch(const ChunkTokens& x, const ChunkWorkspace& ws, const ChunkGrads& gd,
            cudaStream_t stream) {
  using L = LocalLayout<GATE, K, V>;
  constexpr bool kChannel = GATE == Gate::channel;
  constexpr size_t most = kChannel ? L::total_layer : L::total;
  static_assert(most <= 227 * 1024, "chunk_bwd_local: shared memory");
  static const bool configured = [] {
    check_cuda(cudaFuncSetAttribute(chunk_bwd_local_kernel<GATE, K, V, EXACT>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, int(most)),
               "chunk_bwd_local shared memory limit");
    return true;
  }();
  (void)configured;
  // the EXACT walk of the list: one block an SM (what its shared memory allows anyway)
  const int64_t all = ws.num_chunks * x.HV;
  const dim3 grid = EXACT && ws.wide_flag
                        ? dim3(unsigned(std::min<int64_t>(all, std::max(1, device_sm_count()))))
                        : dim3(unsigned(ws.num_chunks), unsigned(x.HV));
  const size_t bytes = kChannel && x.layer.gate ? L::total_layer : L::total;
  chunk_bwd_local_kernel<GATE, K, V, EXACT><<<grid, kThreads, bytes, stream>>>(x, ws, gd);
  check_launch("chunk_bwd_local kernel");
}

template <Gate GATE, bool EXACT = false>
void launch_kv(const ChunkTokens& x, const ChunkWorkspace& ws, const ChunkGrads& gd, int K, int V,
               cudaStream_t stream) {
  if (K == 128 && V == 128) return launch<GATE, 128, 128, EXACT>(x, ws, gd, stream);
  require(K == 64 && V == 64, "chunk_bwd_local: K = V = 64 or 128");
  return launch<GATE, 64, 64, EXACT>(x, ws, gd, stream);
}

// One thread per 4 channels of one (token, q / k head) row; a row's K / 4 threads are adjacent
// lanes of one warp (K / 4 in {16, 32}), so its sums are warp shuffles. dy: the fp32 sum of the
// group's partials (GROUPED) or the bf16 row in dq / dk; with l2norm, dx = (dy - x (x . dy) /
// |x|^2) / |x| for |x| > 1e-6, else dy / 1e-6 (ops/kda/kda_activations.h).
template <bool GROUPED>
__global__ void finish_qk_grads_kernel(const float* __restrict__ dq_part,
                                       const float* __restrict__ dk_part, bf16* dq, bf16* dk,
                                       const bf16* __restrict__ q, const bf16* __restrict__ k,
                                       int64_t rows, int H, int group, int K, bool l2norm) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int per_row = K / 4;
  const bool live = idx < rows * per_row;        // dead lanes work on row 0 and store nothing
  const int64_t row = live ? idx / per_row : 0;  // token * H + h
  const int c = int(idx % per_row) * 4;
  float gq[4] = {0.f, 0.f, 0.f, 0.f}, gk[4] = {0.f, 0.f, 0.f, 0.f};
  if constexpr (GROUPED) {
    const int64_t tok = row / H;
    const int h = int(row % H);
    for (int gi = 0; gi < group; ++gi) {
      const size_t off = (size_t(tok) * H * group + size_t(h) * group + gi) * K + c;
      const float4 a = *reinterpret_cast<const float4*>(dq_part + off);
      const float4 b = *reinterpret_cast<const float4*>(dk_part + off);
      gq[0] += a.x, gq[1] += a.y, gq[2] += a.z, gq[3] += a.w;
      gk[0] += b.x, gk[1] += b.y, gk[2] += b.z, gk[3] += b.w;
    }
  } else {
    load4(dq + row * K + c, gq);
    load4(dk + row * K + c, gk);
  }
  if (l2norm) {
    float xq[4], xk[4];
    load4(q + row * K + c, xq);
    load4(k + row * K + c, xk);
    float s[4] = {0.f, 0.f, 0.f, 0.f};  // |q|^2, q . dq, |k|^2, k . dk
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[0] += xq[e] * xq[e];
      s[1] += xq[e] * gq[e];
      s[2] += xk[e] * xk[e];
      s[3] += xk[e] * gk[e];
    }
    for (int off = 1; off < per_row; off <<= 1)
#pragma unroll
      for (int j = 0; j < 4; ++j) s[j] += __shfl_xor_sync(0xffffffffu, s[j], off);
    auto back = [](float* g, const float* xr, float n2, float dot) {
      const float norm = sqrtf(n2);
      if (norm <= 1e-6f) {
#pragma unroll
        for (int e = 0; e < 4; ++e) g[e] *= 1e6f;
        return;
      }
      const float inv = 1.f / norm, proj = dot / n2;
#pragma unroll
      for (int e = 0; e < 4; ++e) g[e] = (g[e] - xr[e] * proj) * inv;
    };
    back(gq, xq, s[0], s[1]);
    back(gk, xk, s[2], s[3]);
  }
  if (live) {
    store4(dq + row * K + c, gq);
    store4(dk + row * K + c, gk);
  }
}

// One block per value head: thread t adds slot t of every chunk's gate_part in chunk order,
// then ddt_bias[c] sums the slots of the chunk_bwd_local threads of channel c (t % K == c) and
// dA_log the warps' slots, in index order. Fixed orders throughout, so the same bits every run.
__global__ void __launch_bounds__(kThreads)
    kda_gate_grads_kernel(const float* __restrict__ part, int64_t num_chunks, int HV, int K,
                          float* dA_log, float* ddt_bias) {
  constexpr int kWarps = kThreads / 32;
  __shared__ float slot[kGatePartFloats];
  const int hv = blockIdx.x, t = threadIdx.x;
  const float* p = part + size_t(hv) * kGatePartFloats;
  const size_t stride = size_t(HV) * kGatePartFloats;  // from one chunk to the next
  float s = 0.f, w = 0.f;
  for (int64_t ch = 0; ch < num_chunks; ++ch) {
    s += p[ch * stride + t];
    if (t < kWarps) w += p[ch * stride + kThreads + t];
  }
  slot[t] = s;
  if (t < kWarps) slot[kThreads + t] = w;
  __syncthreads();
  if (ddt_bias && t < K) {
    float d = 0.f;
    for (int j = t; j < kThreads; j += K) d += slot[j];
    ddt_bias[size_t(hv) * K + t] = d;
  }
  if (dA_log && t == 0) {
    float a = 0.f;
    for (int j = 0; j < kWarps; ++j) a += slot[kThreads + j];
    dA_log[hv] = a;
  }
}

}  // namespace

void launch_kda_gate_grads(const ChunkGrads& gd, int64_t num_chunks, int HV, int K,
                           cudaStream_t stream) {
  if (!gd.dA_log && !gd.ddt_bias) return;
  require(gd.gate_part != nullptr && K <= kThreads, "kda_gate_grads: gate_part and K <= 256");
  kda_gate_grads_kernel<<<HV, kThreads, 0, stream>>>(gd.gate_part, num_chunks, HV, K, gd.dA_log,
                                                     gd.ddt_bias);
  check_launch("kda_gate_grads kernel");
}

void launch_chunk_bwd_local(const ChunkTokens& x, const ChunkWorkspace& ws, const ChunkGrads& gd,
                            Gate gate, int K, int V, cudaStream_t stream) {
  // KDA chunks chunk_prepare listed (wide decays: raw g, the softplus gate) go to the EXACT
  // instance, which forms their pairwise terms exactly, the others to the default instance; a
  // gate bounded inside the split's range lists none and takes the default instance alone
  // Kernel-lab knob KDA_BWD_EXACT_ALL=1: every chunk through the EXACT instance, as before the
  // split (for the A/B timing of raw g and the softplus gate)
  static const bool exact_all = [] {
    const char* knob = std::getenv("KDA_BWD_EXACT_ALL");
    return knob && knob[0] == '1';
  }();
  const auto launch_exact = [&](const ChunkWorkspace& w) {
    return launch_kv<Gate::channel, true>(x, w, gd, K, V, stream);
  };
  ChunkWorkspace w = ws;
  switch (gate) {
    case Gate::channel:
      if (decay_within_split(x.layer) || !ws.wide_count) {
        w.wide_flag = nullptr;
        return launch_kv<Gate::channel>(x, w, gd, K, V, stream);
      }
      if (exact_all) {
        w.wide_flag = nullptr;
        return launch_exact(w);
      }
      launch_kv<Gate::channel>(x, w, gd, K, V, stream);  // the unflagged chunks
      return launch_exact(w);                            // the listed ones
    case Gate::scalar:
      w.wide_flag = nullptr;
      return launch_kv<Gate::scalar>(x, w, gd, K, V, stream);
    case Gate::none:
      w.wide_flag = nullptr;
      return launch_kv<Gate::none>(x, w, gd, K, V, stream);
  }
}

void launch_finish_qk_grads(const ChunkTokens& x, const ChunkGrads& gd, int64_t tokens, int K,
                            cudaStream_t stream) {
  const bool grouped = gd.dq_part != nullptr, l2norm = x.layer.l2norm_qk;
  if (!grouped && !l2norm) return;
  const int64_t rows = tokens * x.H, threads = rows * (K / 4);
  const int block = 256;
  const unsigned grid = unsigned((threads + block - 1) / block);
  if (grouped)
    finish_qk_grads_kernel<true><<<grid, block, 0, stream>>>(
        gd.dq_part, gd.dk_part, gd.dq, gd.dk, x.q, x.k, rows, x.H, x.HV / x.H, K, l2norm);
  else
    finish_qk_grads_kernel<false><<<grid, block, 0, stream>>>(nullptr, nullptr, gd.dq, gd.dk, x.q,
                                                              x.k, rows, x.H, 1, K, l2norm);
  check_launch("finish_qk_grads kernel");
}

}  // namespace kda::ops::cuda_detail
