// chunk_prepare: everything about one chunk that does not depend on the state entering it.
// One block of 256 threads (8 warps) per (chunk of 64 tokens, value head); see
// chunk_kernels.cuh for what it writes, and ../shared/notes/chunked-delta-rule.md for the math.
//
// Gates are kept in log2 units (G = log2(e) * cumsum g). For KDA the pairwise decay
// exp(G_i - G_j) is split around an anchor a = 16 * (i / 16) (the first row of i's 16-row block):
//   q_i^T diag(2^(G_i - G_j)) k_j = (q_i 2^(G_i - G_a)) . (k_j 2^(G_a - G_j)),
// where for j in an earlier block J the right factor is 2^(G_a - G_aJ) 2^(G_aJ - G_j), the
// first part (<= 1, per channel) applied to the left operand. Only diagonal blocks carry
// factors above 1 (bounded by 15 tokens of decay). For scalar gates the decay is applied
// after the product, exactly.
//
// LAYER (KDA only; the forward and the backward's recompute): a KDA layer's in-kernel options
// (KdaLayerParams): the gate activation and sigmoid(beta) as they are loaded
// (kda_layer_math.cuh), and the q / k row norms from the loaded tiles, folded into phase 2's
// scalings (one bf16 rounding, where fla rounds the normalised q / k first).
// Gated DeltaNet forward (ws.raw_qk): Qt and Kd are not written; gC gets G (chunk_state reads
// q, k itself). With ws.qt_in_state (the split walk's QROWS): Kd and M are written,
// Qt is not, and gC gets G.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <type_traits>

#include "ops/delta_rule/cuda/chunk_kernels.cuh"
#include "ops/delta_rule/cuda/chunk_solve.cuh"
#include "ops/delta_rule/cuda/delta_rule_cuda.h"
#include "ops/delta_rule/cuda/device_common.cuh"
#include "ops/delta_rule/cuda/kda_layer_math.cuh"

namespace kda::ops::cuda_detail {
namespace {

using bf16 = __nv_bfloat16;
constexpr int C = kChunk;
constexpr int kThreads = 256;
constexpr float kLog2e = 1.4426950408889634f;

// Shared memory, sized for three blocks per SM (about 74 KB at K = V = 128). Regions are reused
// across phases once their contents are dead:
//   b:  Qs, Kn (phases 2-3)            -> X (fp32, phase 4) and V (phase 5, loaded during 4)
//   ks: Ks (phases 2-5)
//   l:  segment totals (phase 1) -> L (fp32, phases 3-4; the unused upper blocks (J, 3) hold
//       the merge temporaries Y) -> T (bf16, phase 5)
//   small: beta[C], scalar G[C], Ga[4][K] (G at the 16-row anchors), Gl[K] (G at the last
//          row), F[6][K] (2^(G_aI - G_aJ))
template <Gate GATE, int K, int V>
struct PrepareLayout {
  static constexpr int LDK = K + 8, LDV = V + 8, LDL = C + 4, LDT = C + 8;
  static constexpr size_t bytes_v = size_t(C) * LDV * 2;
  static constexpr size_t bytes_krow = size_t(C) * LDK * 2;
  static constexpr size_t bytes_l = size_t(C) * LDL * 4, bytes_t = size_t(C) * LDT * 2;
  static constexpr size_t bytes_x = size_t(C) * LDL * 4;
  static constexpr size_t region_b = std::max(2 * bytes_krow, bytes_x + bytes_v);
  static constexpr size_t off_b = 0, off_ks = region_b, off_l = off_ks + bytes_krow;
  static constexpr size_t off_small = off_l + bytes_l;
  static constexpr size_t total = off_small + (2 * C + 11 * K) * 4;
  static_assert(bytes_t <= bytes_l, "T lives in L's region");
  static_assert(size_t(kThreads) * 2 * 4 <= bytes_l, "segment totals live in L's region");
};

// Phase 1-2 thread mapping: a pair of channels (2 c0, 2 c0 + 1) and kRows consecutive rows.
template <int K>
struct PairMap {
  static constexpr int kPairs = K / 2, kSegs = kThreads / kPairs, kRows = C / kSegs;
  static_assert(kRows <= 16 && 16 % kRows == 0, "a segment stays inside one 16-row block");
};

// Rows [0, C) of a [C][W] bf16 tile between global memory (row stride `stride` elements) and
// shared memory (row stride LD), 16 bytes a thread, each thread down one 16-byte column
// (copy_rows_async in device_common.cuh: the flat loops' index arithmetic was ~10 % of the Gated
// DeltaNet prepare's instructions).
template <int W, int LD>
struct TileRows {
  static constexpr int kPerRow = W / 8, kStep = kThreads / kPerRow;
  // cp.async of the rows < len (the rows past it zero-filled)
  __device__ __forceinline__ static void load(bf16* dst, const bf16* src, int64_t stride, int len,
                                              int tid) {
    copy_rows_async<W, LD, kThreads, C>(dst, src, stride, len, tid);
  }
  // every row of the tile to contiguous global rows of W elements
  __device__ __forceinline__ static void store(bf16* dst, const bf16* src, int tid) {
    const int c = (tid % kPerRow) * 8, i0 = tid / kPerRow;
    const bf16* sm = src + i0 * LD + c;
    bf16* g = dst + i0 * W + c;
#pragma unroll
    for (int i = i0; i < C; i += kStep, sm += kStep * LD, g += kStep * W)
      *reinterpret_cast<uint4*>(g) = *reinterpret_cast<const uint4*>(sm);
  }
};

// LAYER's l2norm: sNorm[r] = 1 / max(|row r|, 1e-6) of the 64 q rows (r < C) and the 64 k rows
// of the loaded tiles, two threads a row (the caller syncs before reading sNorm)
template <int K, int LDK>
__device__ __forceinline__ void row_norms(const bf16* sQs, const bf16* sKs, float* sNorm, int tid) {
  static_assert(kThreads == 4 * C, "two threads per row of q and of k");
  const int rr = tid >> 1, half = tid & 1;
  const float inv = pair_row_inv_norm<K>((rr < C ? sQs : sKs) + (rr % C) * LDK + half * (K / 2));
  if (half == 0) sNorm[rr] = inv;
}

template <Gate GATE, int K, int V, bool LAYER>
__global__ void __launch_bounds__(kThreads, 3)
    chunk_prepare_kernel(const ChunkTokens x, const ChunkWorkspace ws) {
  using L = PrepareLayout<GATE, K, V>;
  using P = PairMap<K>;
  constexpr int LDK = L::LDK, LDV = L::LDV, LDL = L::LDL, LDT = L::LDT;
  constexpr int kRows = P::kRows;
  constexpr bool kChannel = GATE == Gate::channel;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sQs = reinterpret_cast<bf16*>(smem + L::off_b);
  bf16* sKn = reinterpret_cast<bf16*>(smem + L::off_b + L::bytes_krow);
  float* sX = reinterpret_cast<float*>(smem + L::off_b);
  bf16* sV = reinterpret_cast<bf16*>(smem + L::off_b + L::bytes_x);
  bf16* sKs = reinterpret_cast<bf16*>(smem + L::off_ks);
  float* sL = reinterpret_cast<float*>(smem + L::off_l);
  float* sTot = sL;
  bf16* sT = reinterpret_cast<bf16*>(smem + L::off_l);
  float* sBeta = reinterpret_cast<float*>(smem + L::off_small);
  float* sGs = sBeta + C;
  float* sGa = sGs + C;
  float* sGl = sGa + 4 * K;
  float* sF = sGl + K;
  float* sNorm = sL + 1024;  // LAYER: 1 / |q_i|, 1 / |k_i| (phases 1-2; L's region after)
  static_assert(1024 + 2 * C <= C * LDL, "norms live in L's region");
  static_assert(kThreads / (K / 2) * K <= 1024, "segment totals below the norms");

  const int64_t chunk = blockIdx.x;
  const int hv = blockIdx.y;
  const int h = hv / (x.HV / x.H);
  const int64_t tok0 = ws.chunk_tok0[chunk];
  const int len = int(ws.chunk_len[chunk]);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gr = lane >> 2, tq = lane & 3;
  const size_t row_base = (size_t(chunk) * x.HV + hv) * C;
  const int c0 = 2 * (tid % P::kPairs), row0 = (tid / P::kPairs) * kRows;

  // ---- phase 1: q, k tiles (async, scaled in place in phase 2), beta, gate cumulative sums ----
  // q is read by phase 2 (Qt) and phase 3 (M) only: neither runs for the Gated DeltaNet forward
  // whose walk forms M (m_in_state implies raw_qk), so it is not loaded there
  const bool load_q = !ws.m_in_state;
  {
    const size_t qk0 = (size_t(tok0) * x.H + h) * K;
    const int64_t qk_stride = int64_t(x.H) * K;
    if (load_q) TileRows<K, LDK>::load(sQs, x.q + qk0, qk_stride, len, tid);
    TileRows<K, LDK>::load(sKs, x.k + qk0, qk_stride, len, tid);
  }
  cp_async_commit();
  if (tid < C) {
    float b = tid < len ? to_f32(x.beta[size_t(tok0 + tid) * x.HV + hv]) : 0.f;
    if constexpr (LAYER)
      if (x.layer.beta_sigmoid && tid < len) b = kda_beta_sigmoid(b);
    sBeta[tid] = b;
  }

  float* gC = ws.gC + (size_t(chunk) * x.HV + hv) * K;
  if constexpr (kChannel) {
    // G of this thread's channel pair and rows, in registers (rows past the end add 0)
    float g0[kRows], g1[kRows];
    {
      // all loads first (predicated, no branches around them), then the arithmetic
      uint32_t raw[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int i = row0 + r;
        raw[r] =
            i < len
                ? *reinterpret_cast<const uint32_t*>(x.g + (size_t(tok0 + i) * x.HV + hv) * K + c0)
                : 0u;
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float2 f = unpack_bf16(raw[r]);
        g0[r] = f.x;
        g1[r] = f.y;
      }
      if constexpr (LAYER) {
        if (x.layer.gate) {  // the activation; rows past the end stay 0
          const float a = x.layer.A_log ? __expf(x.layer.A_log[hv]) : 1.f;
          const float b0 = x.layer.dt_bias ? x.layer.dt_bias[size_t(hv) * K + c0] : 0.f;
          const float b1 = x.layer.dt_bias ? x.layer.dt_bias[size_t(hv) * K + c0 + 1] : 0.f;
          if (x.layer.gate_softplus) {
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
              const bool live = row0 + r < len;
              g0[r] = live ? kda_gate_softplus(a, g0[r] + b0) : 0.f;
              g1[r] = live ? kda_gate_softplus(a, g1[r] + b1) : 0.f;
            }
          } else {
            const float lb = x.layer.lower_bound;
#pragma unroll
            for (int r = 0; r < kRows; ++r) {
              const bool live = row0 + r < len;
              g0[r] = live ? kda_gate_bounded(lb, a, g0[r] + b0) : 0.f;
              g1[r] = live ? kda_gate_bounded(lb, a, g1[r] + b1) : 0.f;
            }
          }
        }
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        g0[r] *= kLog2e;
        g1[r] *= kLog2e;
      }
    }
#pragma unroll
    for (int r = 1; r < kRows; ++r) {
      g0[r] += g0[r - 1];
      g1[r] += g1[r - 1];
    }
    const int seg = row0 / kRows;
    *reinterpret_cast<float2*>(sTot + seg * K + c0) = make_float2(g0[kRows - 1], g1[kRows - 1]);
    [[maybe_unused]] const bool l2norm = LAYER && x.layer.l2norm_qk;
    // with the layer's l2norm the tiles complete before this barrier, so the row norms share the
    // barrier that publishes G's anchors instead of taking one of their own (session 18: -1 % on
    // the 8 x 2048 layer forward)
    if constexpr (LAYER)
      if (l2norm) cp_async_wait<0>();
    __syncthreads();
    float off0 = 0.f, off1 = 0.f;
    for (int s = 0; s < seg; ++s) {
      const float2 t = *reinterpret_cast<const float2*>(sTot + s * K + c0);
      off0 += t.x;
      off1 += t.y;
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      g0[r] += off0;
      g1[r] += off1;
      const int i = row0 + r;
      if ((i & 15) == 0)
        *reinterpret_cast<float2*>(sGa + (i >> 4) * K + c0) = make_float2(g0[r], g1[r]);
      if (i == len - 1) *reinterpret_cast<float2*>(sGl + c0) = make_float2(g0[r], g1[r]);
    }
    if (l2norm)  // (uniform)
      row_norms<K, LDK>(sQs, sKs, sNorm, tid);
    else
      cp_async_wait<0>();
    __syncthreads();

    // ---- phase 2: scaled operands (in place in smem) and Qt, Kd, exp(G_C) (workspace) ----
    const float2 gl = *reinterpret_cast<const float2*>(sGl + c0);
    float widest = 0.f;  // the largest 2^(G_a - G_i) exponent of this thread's rows (>= 0)
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int i = row0 + r;
      const float2 ga = *reinterpret_cast<const float2*>(sGa + (i >> 4) * K + c0);
      uint32_t* pq = reinterpret_cast<uint32_t*>(sQs + i * LDK + c0);
      uint32_t* pk = reinterpret_cast<uint32_t*>(sKs + i * LDK + c0);
      float2 q2 = unpack_bf16(*pq), k2 = unpack_bf16(*pk);
      if constexpr (LAYER) {
        if (l2norm) {
          const float nq = sNorm[i], nk = sNorm[C + i];
          q2.x *= nq, q2.y *= nq, k2.x *= nk, k2.y *= nk;
        }
      }
      const float rel0 = g0[r] - ga.x, rel1 = g1[r] - ga.y;
      widest = fmaxf(widest, fmaxf(-rel0, -rel1));
      const float es0 = fast_exp2(rel0), es1 = fast_exp2(rel1);
      *pq = pack_bf16(q2.x * es0, q2.y * es1);
      *pk = pack_bf16(k2.x * es0, k2.y * es1);
      *reinterpret_cast<uint32_t*>(sKn + i * LDK + c0) =
          pack_bf16(k2.x * fast_exp2(-rel0), k2.y * fast_exp2(-rel1));
      *reinterpret_cast<uint32_t*>(ws.Qt + (row_base + i) * K + c0) =
          pack_bf16(x.scale * q2.x * fast_exp2(g0[r]), x.scale * q2.y * fast_exp2(g1[r]));
      *reinterpret_cast<uint32_t*>(ws.Kd + (row_base + i) * K + c0) =
          pack_bf16(k2.x * fast_exp2(gl.x - g0[r]), k2.y * fast_exp2(gl.y - g1[r]));
    }
    if (ws.wide_count) {  // uniform: a kernel parameter
      // k 2^(G_a - G_j) near the top of bf16's range: chunk_prepare_exact redoes the chunk
      const bool wide = __syncthreads_or(widest > ChunkWorkspace::kWideDecayLog2);
      if (tid == 0) {
        const unsigned entry = unsigned(chunk * x.HV + hv);
        if (wide) ws.wide_list[atomicAdd(ws.wide_count, 1u)] = entry;
        ws.wide_flag[entry] = wide;
      }
    }
    for (int idx = tid; idx < 6 * K; idx += kThreads) {
      const int p = idx / K, c = idx % K;
      const int I = p < 1 ? 1 : p < 3 ? 2 : 3;
      const int J = p - I * (I - 1) / 2;
      sF[idx] = fast_exp2(sGa[I * K + c] - sGa[J * K + c]);
    }
    for (int c = tid; c < K; c += kThreads) gC[c] = fast_exp2(sGl[c]);
  } else {
    if constexpr (GATE == Gate::scalar) {
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
        sGs[i1] = scan;
        sGs[i0] = scan - x1;
      }
    } else {
      if (tid < C) sGs[tid] = 0.f;
    }
    cp_async_wait<0>();
    __syncthreads();

    // ---- phase 2: Qt, Kd, exp(G_C) (workspace); the smem operands stay as loaded ----
    const float last = sGs[len - 1];
    if (ws.raw_qk) {  // Gated DeltaNet forward: chunk_state scales q, k itself; G for it
      for (int c = tid; c < C; c += kThreads) gC[c] = sGs[c];
    } else if (ws.qt_in_state) {  // the split walk scales the q rows itself: Kd and G only
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int i = row0 + r;
        const float ed = fast_exp2(last - sGs[i]);
        const float2 k2 = unpack_bf16(*reinterpret_cast<const uint32_t*>(sKs + i * LDK + c0));
        *reinterpret_cast<uint32_t*>(ws.Kd + (row_base + i) * K + c0) =
            pack_bf16(k2.x * ed, k2.y * ed);
      }
      for (int c = tid; c < C; c += kThreads) gC[c] = sGs[c];
    } else {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int i = row0 + r;
        const float eq = x.scale * fast_exp2(sGs[i]), ed = fast_exp2(last - sGs[i]);
        const float2 q2 = unpack_bf16(*reinterpret_cast<const uint32_t*>(sQs + i * LDK + c0));
        const float2 k2 = unpack_bf16(*reinterpret_cast<const uint32_t*>(sKs + i * LDK + c0));
        *reinterpret_cast<uint32_t*>(ws.Qt + (row_base + i) * K + c0) =
            pack_bf16(q2.x * eq, q2.y * eq);
        *reinterpret_cast<uint32_t*>(ws.Kd + (row_base + i) * K + c0) =
            pack_bf16(k2.x * ed, k2.y * ed);
      }
      const float e_last = fast_exp2(last);
      for (int c = tid; c < K; c += kThreads) gC[c] = e_last;
    }
  }
  __syncthreads();

  // ---- phase 3: M = scale * masked(Q K^T decayed) -> workspace, L = beta * strict(K K^T) ----
  // 20 units spread over the 8 warps: the 10 lower 16x16 blocks (J <= I) of M and the 10 of L
  // (the backward adds A's 6 zero upper blocks). With ws.m_in_state (the state walk forms M)
  // only L's 10. M's blocks go to smem (sMstage: L's upper blocks, untouched until phase 4's
  // merges; two bf16 blocks in each fp32 one), and phase 4's idle warps store M in whole rows
  // (zeros above the diagonal blocks) while warps 0-3 invert the diagonal blocks (v28: the
  // fragments' scattered 4-byte stores wrote M at half-sector efficiency).
  const bool form_m = !ws.m_in_state;
  auto sMstage = [&](int b) {  // M block b = I (I + 1) / 2 + J, J <= I; row stride 2 LDL
    const int u = b >> 1;      // L's upper blocks (0,1) (0,2) (0,3) (1,2) (1,3): b <= 9
    const int ui = u < 3 ? 0 : 1, uj = u < 3 ? u + 1 : u - 1;
    return reinterpret_cast<bf16*>(sL + 16 * ui * LDL + 16 * uj) + 16 * (b & 1);
  };

  {
    const bf16* Bop = kChannel ? sKn : sKs;
    // units 20-25 write A's zero upper blocks (M's are written by the flush in phase 4)
    const int units = (form_m ? 20 : 10) + (ws.A ? 6 : 0);
    for (int unit = warp; unit < units; unit += 8) {
      const int u = form_m ? unit : 10 + unit;
      if (u < 20) {
        const bool is_m = u < 10;
        const int b = is_m ? u : u - 10;
        const int I = b < 1 ? 0 : b < 3 ? 1 : b < 6 ? 2 : 3;
        const int J = b - I * (I + 1) / 2;
        const bf16* A = is_m ? sQs : sKs;
        float acc[2][4] = {};
#pragma unroll
        for (int kk = 0; kk < K / 16; ++kk) {
          uint32_t a[4], bb[4];
          load_a(a, A, LDK, 16 * I, 16 * kk, lane);
          if constexpr (kChannel) {
            if (J < I) {
              const float* f = sF + (I * (I - 1) / 2 + J) * K + 16 * kk + 2 * tq;
              const float2 f0 = *reinterpret_cast<const float2*>(f);
              const float2 f1 = *reinterpret_cast<const float2*>(f + 8);
              a[0] = scale_bf16x2(a[0], f0.x, f0.y);
              a[1] = scale_bf16x2(a[1], f0.x, f0.y);
              a[2] = scale_bf16x2(a[2], f1.x, f1.y);
              a[3] = scale_bf16x2(a[3], f1.x, f1.y);
            }
          }
          load_b_nk(bb, Bop, LDK, 16 * kk, 16 * J, lane);
          mma_bf16(acc[0], a, bb[0], bb[1]);
          mma_bf16(acc[1], a, bb[2], bb[3]);
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int r = 16 * I + gr + 8 * half, j = 16 * J + 8 * nt + 2 * tq;
            float v0 = acc[nt][2 * half], v1 = acc[nt][2 * half + 1];
            if constexpr (!kChannel) {
              v0 *= j <= r ? fast_exp2(sGs[r] - sGs[j]) : 0.f;
              v1 *= j + 1 <= r ? fast_exp2(sGs[r] - sGs[j + 1]) : 0.f;
            }
            if (is_m) {
              v0 = j <= r ? v0 * x.scale : 0.f;
              v1 = j + 1 <= r ? v1 * x.scale : 0.f;
              *reinterpret_cast<uint32_t*>(sMstage(b) + (r - 16 * I) * 2 * LDL + j - 16 * J) =
                  pack_bf16(v0, v1);
            } else {
              v0 = j < r ? v0 : 0.f;
              v1 = j + 1 < r ? v1 : 0.f;
              if (ws.A)  // backward: the decayed K K^T before beta
                *reinterpret_cast<uint32_t*>(ws.A + (row_base + r) * C + j) = pack_bf16(v0, v1);
              v0 *= sBeta[r];
              v1 *= sBeta[r];
              *reinterpret_cast<float2*>(sL + r * LDL + j) = make_float2(v0, v1);
            }
          }
        }
      } else {
        const int z = u - 20;  // upper blocks (0,1) (0,2) (0,3) (1,2) (1,3) (2,3)
        const int I = z < 3 ? 0 : z < 5 ? 1 : 2;
        const int J = z < 3 ? z + 1 : z < 5 ? z - 1 : 3;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int r = 16 * I + gr + 8 * half, j = 16 * J + 8 * nt + 2 * tq;
            *reinterpret_cast<uint32_t*>(ws.A + (row_base + r) * C + j) = 0u;
          }
        }
      }
    }
  }
  __syncthreads();

  // v tile for phase 5 (async; its region held Kn until now), hidden behind the solve
  TileRows<V, LDV>::load(sV, x.v + (size_t(tok0) * x.HV + hv) * V, int64_t(x.HV) * V, len, tid);
  cp_async_commit();

  // ---- phase 4: X = (I + L)^-1 by 16 x 16 blocks, then T = X diag(beta) ----
  if (warp < 4 && lane < 16) {
    invert_diagonal_blocks<LDL>(sL, sX, warp, lane);
  } else if (form_m && warp >= 4) {
    // M out in whole rows, 16 bytes (8 columns) a thread: from the staged block of (I, J) where
    // J <= I, zeros above; before the merges below reuse L's upper blocks for Y
    for (int idx = tid - 128; idx < C * C / 8; idx += 128) {
      const int r = idx / (C / 8), c8 = (idx % (C / 8)) * 8;
      const int I = r >> 4, J = c8 >> 4;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (J <= I)
        v = *reinterpret_cast<const uint4*>(sMstage(I * (I + 1) / 2 + J) + (r & 15) * 2 * LDL +
                                            (c8 & 15));
      *reinterpret_cast<uint4*>(ws.M + (row_base + r) * C + c8) = v;
    }
  }
  __syncthreads();
  // the blocks below the diagonal (Y in L's unused upper blocks (J, 3))
  merge_inverse_blocks<LDL>(sL, sX, warp, lane);
  for (int idx = tid; idx < C * C / 4; idx += kThreads) {  // T overwrites L (dead now)
    const int i = idx / (C / 4), j = 4 * (idx % (C / 4));
    const float4 xr = *reinterpret_cast<const float4*>(sX + i * LDL + j);
    const float4 be = *reinterpret_cast<const float4*>(sBeta + j);
    // entries above the diagonal are selected away, never multiplied (they may hold garbage)
    const float x0 = j <= i ? xr.x : 0.f, x1 = j + 1 <= i ? xr.y : 0.f;
    const float x2 = j + 2 <= i ? xr.z : 0.f, x3 = j + 3 <= i ? xr.w : 0.f;
    *reinterpret_cast<uint2*>(sT + i * LDT + j) =
        make_uint2(pack_bf16(x0 * be.x, x1 * be.y), pack_bf16(x2 * be.z, x3 * be.w));
    if (ws.X)  // backward
      *reinterpret_cast<uint2*>(ws.X + (row_base + i) * C + j) =
          make_uint2(pack_bf16(x0, x1), pack_bf16(x2, x3));
  }
  cp_async_wait<0>();
  __syncthreads();

  // ---- phase 5: U = T V (warps 0-3), W = T Kt (warps 4-7); each warp a quarter of the
  // columns for all 64 rows, so every B fragment (and its decay scaling) serves the row blocks
  // I >= J, and the four warps of a product carry the same work ----
  // Stores: each warp writes its products into its own columns of the source tile (read by no
  // other warp, dead once the warp's products are done), then the block stores U and W in whole
  // rows (from the fragments, 4 lanes would write 16 bytes of a row: half of every 32-byte
  // sector; v27 measured 0.05 ms less at 8 x 2048).
  const int slice = warp & 3;
  auto lower_times = [&](auto n_const, bf16* src, int ld, bool scale_rows) {
    constexpr int N = decltype(n_const)::value;
    constexpr int kGroups = N / 64;  // 16-column groups per warp
#pragma unroll 1
    for (int gi = 0; gi < kGroups; ++gi) {
      const int np = slice * kGroups + gi;
      float acc[4][2][4] = {};
#pragma unroll
      for (int J = 0; J < 4; ++J) {
        uint32_t b[4];
        load_b_kn(b, src, ld, 16 * J, 16 * np, lane);
        if (scale_rows) {
          if constexpr (kChannel) {
            const float f0 = fast_exp2(sGa[J * K + 16 * np + gr]);
            const float f1 = fast_exp2(sGa[J * K + 16 * np + 8 + gr]);
            b[0] = scale_bf16x2(b[0], f0, f0);
            b[1] = scale_bf16x2(b[1], f0, f0);
            b[2] = scale_bf16x2(b[2], f1, f1);
            b[3] = scale_bf16x2(b[3], f1, f1);
          } else if constexpr (GATE == Gate::scalar) {
            const float e0 = fast_exp2(sGs[16 * J + 2 * tq]);
            const float e1 = fast_exp2(sGs[16 * J + 2 * tq + 1]);
            const float e8 = fast_exp2(sGs[16 * J + 2 * tq + 8]);
            const float e9 = fast_exp2(sGs[16 * J + 2 * tq + 9]);
            b[0] = scale_bf16x2(b[0], e0, e1);
            b[1] = scale_bf16x2(b[1], e8, e9);
            b[2] = scale_bf16x2(b[2], e0, e1);
            b[3] = scale_bf16x2(b[3], e8, e9);
          }
        }
#pragma unroll
        for (int I = J; I < 4; ++I) {
          uint32_t a[4];
          load_a(a, sT, LDT, 16 * I, 16 * J, lane);
          mma_bf16(acc[I][0], a, b[0], b[1]);
          mma_bf16(acc[I][1], a, b[2], b[3]);
        }
      }
      __syncwarp();  // every lane's reads of these 16 columns done
#pragma unroll
      for (int I = 0; I < 4; ++I) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const int r = 16 * I + gr, col = 16 * np + 8 * nt + 2 * tq;
          *reinterpret_cast<uint32_t*>(src + r * ld + col) =
              pack_bf16(acc[I][nt][0], acc[I][nt][1]);
          *reinterpret_cast<uint32_t*>(src + (r + 8) * ld + col) =
              pack_bf16(acc[I][nt][2], acc[I][nt][3]);
        }
      }
    }
  };
  if (warp < 4)
    lower_times(std::integral_constant<int, V>{}, sV, LDV, false);
  else
    lower_times(std::integral_constant<int, K>{}, sKs, LDK, true);
  // U (in sV) and W (in sKs) out in whole rows, 16 bytes a thread
  __syncthreads();
  TileRows<V, LDV>::store(ws.U + row_base * V, sV, tid);
  TileRows<K, LDK>::store(ws.W + row_base * K, sKs, tid);
}

template <Gate GATE, int K, int V, bool LAYER>
void launch(const ChunkTokens& x, const ChunkWorkspace& ws, cudaStream_t stream) {
  using L = PrepareLayout<GATE, K, V>;
  auto* kernel = chunk_prepare_kernel<GATE, K, V, LAYER>;
  static const bool configured = [kernel] {
    check_cuda(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(L::total)),
        "chunk_prepare shared memory limit");
    // all of the unified L1 as shared memory: three blocks per SM need 3 x 74 KB
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                    int(cudaSharedmemCarveoutMaxShared)),
               "chunk_prepare shared memory carveout");
    return true;
  }();
  (void)configured;
  const dim3 grid(unsigned(ws.num_chunks), unsigned(x.HV));
  kernel<<<grid, kThreads, L::total, stream>>>(x, ws);
  check_launch("chunk_prepare kernel");
}

template <Gate GATE, bool LAYER = false>
void launch_kv(const ChunkTokens& x, const ChunkWorkspace& ws, int K, int V, cudaStream_t stream) {
  if (K == 128 && V == 128) return launch<GATE, 128, 128, LAYER>(x, ws, stream);
  if (K == 128 && V == 64) return launch<GATE, 128, 64, LAYER>(x, ws, stream);
  if (K == 64 && V == 128) return launch<GATE, 64, 128, LAYER>(x, ws, stream);
  return launch<GATE, 64, 64, LAYER>(x, ws, stream);
}

void launch_for_gate(const ChunkTokens& x, const ChunkWorkspace& ws, Gate gate, int K, int V,
                     cudaStream_t stream) {
  if (x.layer.on) {  // chunk_forward allows it for Gate::channel only
    require(gate == Gate::channel, "chunk_prepare: KDA layer options need Gate::channel");
    return launch_kv<Gate::channel, true>(x, ws, K, V, stream);
  }
  switch (gate) {
    case Gate::channel:
      return launch_kv<Gate::channel>(x, ws, K, V, stream);
    case Gate::scalar:
      return launch_kv<Gate::scalar>(x, ws, K, V, stream);
    case Gate::none:
      return launch_kv<Gate::none>(x, ws, K, V, stream);
  }
}

// Diagnostic knob KDA_REPORT_WIDE=1: after every chunk_prepare that lists, wait for
// it and count the listed (chunk, value head) pairs; every 200 such calls one line on stderr
// with the share listed since the last line (how much of a training run takes the exact
// kernels; the wait makes the run slower, so time nothing with it)
void report_wide(const ChunkWorkspace& ws, int HV, cudaStream_t stream) {
  static const bool on = [] {
    const char* knob = std::getenv("KDA_REPORT_WIDE");
    return knob && knob[0] == '1';
  }();
  if (!on) return;
  static std::mutex mutex;
  static int64_t calls = 0, listed = 0, pairs = 0;
  unsigned count = 0;
  check_cuda(cudaMemcpyAsync(&count, ws.wide_count, sizeof count, cudaMemcpyDeviceToHost, stream),
             "wide-decay count (KDA_REPORT_WIDE)");
  check_cuda(cudaStreamSynchronize(stream), "wide-decay count (KDA_REPORT_WIDE)");
  std::lock_guard<std::mutex> lock(mutex);
  listed += count;
  pairs += ws.num_chunks * HV;
  if (++calls % 200 == 0) {
    std::fprintf(stderr,
                 "KDA_REPORT_WIDE: calls %lld-%lld: %lld of %lld chunk-heads listed (%.1f %%)\n",
                 (long long)calls - 199, (long long)calls, (long long)listed, (long long)pairs,
                 100.0 * double(listed) / double(pairs));
    listed = pairs = 0;
  }
}

}  // namespace

void launch_chunk_prepare(const ChunkTokens& x, const ChunkWorkspace& workspace, Gate gate, int K,
                          int V, cudaStream_t stream) {
  // KDA chunks whose decay leaves the split's range are redone by chunk_prepare_exact
  // (ChunkWorkspace::wide_list); a gate bounded inside that range needs no list
  ChunkWorkspace ws = workspace;
  if (gate != Gate::channel || decay_within_split(x.layer)) {
    ws.wide_count = ws.wide_list = nullptr;
    ws.wide_flag = nullptr;
  }
  if (ws.wide_count)
    check_cuda(cudaMemsetAsync(ws.wide_count, 0, sizeof(unsigned), stream), "wide-decay count");
  launch_for_gate(x, ws, gate, K, V, stream);
  if (ws.wide_count) {
    report_wide(ws, x.HV, stream);
    launch_chunk_prepare_exact(x, ws, K, V, stream);
  }
}

}  // namespace kda::ops::cuda_detail
