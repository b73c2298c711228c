// chunk_prepare_exact: KDA chunks whose gates decay too fast for chunk_prepare's split, redone
// in fp32 with no factor above 1.
//
// chunk_prepare forms q_i^T diag(2^(G_i - G_j)) k_j as (q_i 2^(G_i - G_a)) . (k_j 2^(G_a - G_j))
// around the first row a of i's 16-row block. The right factor grows with the decay inside the
// block; past ~2^128 (about 88 nats in 16 tokens, which the softplus gate reaches in training)
// it leaves bf16's range and M, L turn to inf / NaN. chunk_prepare lists the chunks that need it
// (ChunkWorkspace::wide_list) and this kernel recomputes their M, T, W, U (and X, A for the
// backward) from the inputs as fla computes any decay: the diagonal 16 x 16 blocks pair by pair
// with exp2(G_i - G_j) <= 1, the blocks below them from operands anchored at the first row of
// the next block (both factors <= 1), so nothing overflows and underflow only drops terms below
// 2^-126. Qt, Kd and exp(G_C) from chunk_prepare are kept (their factors are <= 1 already).
//
// One block of 256 threads a listed chunk, one block an SM for its ~213 KB of shared memory; the
// products on the tensor cores in 3xTF32 (about fp32's precision). It runs only where the split
// would have failed: 27 % of the chunk-heads of a KDA model trained on MQAR 2048 with the
// softplus gate by step 3000 (session 20, KDA_REPORT_WIDE). Session 20 made it ~1.6x faster
// (the forward with every chunk listed 8.5 -> 5.3 ms at 8 x 2048): chunk_prepare's blocked solve
// in place of a forward substitution a thread a column (2,016 dependent shared-memory steps),
// U and W and the off-diagonal blocks on the tensor cores, the pairs j <= i alone.
#include <algorithm>

#include "ops/delta_rule/cuda/chunk_kernels.cuh"
#include "ops/delta_rule/cuda/chunk_solve.cuh"
#include "ops/delta_rule/cuda/device_common.cuh"
#include "ops/delta_rule/cuda/kda_layer_math.cuh"

namespace kda::ops::cuda_detail {
namespace {

using bf16 = __nv_bfloat16;
constexpr int C = kChunk;
constexpr int kThreads = 256;
constexpr float kLog2e = 1.4426950408889634f;

// fp32 tiles; rows of K + 1 so that threads walking different rows of one column hit different
// banks; C x C rows of C + 4 floats (the blocked solve's float2 stores, its banks as in
// chunk_prepare)
template <int K, int V>
struct ExactLayout {
  static constexpr int LDK = K + 1, LDV = V + 1, LDC = C + 4;
  static constexpr size_t off_q = 0, off_k = off_q + size_t(C) * LDK;
  static constexpr size_t off_g = off_k + size_t(C) * LDK, off_v = off_g + size_t(C) * LDK;
  static constexpr size_t off_m = off_v + size_t(C) * LDV, off_l = off_m + size_t(C) * LDC;
  static constexpr size_t off_x = off_l + size_t(C) * LDC, off_beta = off_x + size_t(C) * LDC;
  // the anchored operands of the blocks below the diagonal, rows of K + 4 floats (the
  // tensor-core fragments' banks)
  static constexpr int LDR = K + 4;
  static constexpr size_t off_r = off_beta + C;
  static constexpr size_t floats = off_r + size_t(C) * LDR;
  static constexpr size_t bytes = floats * 4;
};

template <int K, int V, bool LAYER>
__global__ void __launch_bounds__(kThreads, 1)
    chunk_prepare_exact_kernel(const ChunkTokens x, const ChunkWorkspace ws) {
  using L = ExactLayout<K, V>;
  constexpr int LDK = L::LDK, LDV = L::LDV, LDC = L::LDC, LDR = L::LDR;
  extern __shared__ __align__(16) float sm[];
  float* sQ = sm + L::off_q;  // q (normalised with the layer's l2norm)
  float* sK = sm + L::off_k;  // k, then k 2^G (phase 5)
  float* sG = sm + L::off_g;  // G: log2 cumulative gate from the chunk's start
  float* sV = sm + L::off_v;
  float* sM = sm + L::off_m;  // scale q_i . k_j 2^(G_i - G_j), j <= i
  float* sL = sm + L::off_l;  // A = k_i . k_j 2^(G_i - G_j), j < i; then L = beta_i A
  float* sX = sm + L::off_x;  // (I + L)^-1, then T = X diag(beta)
  float* sBeta = sm + L::off_beta;
  float* sR = sm + L::off_r;  // rows 0-15 k_j 2^(G_b - G_j), then x_i 2^(G_i - G_b)
  const int tid = threadIdx.x;
  const unsigned listed = min(*ws.wide_count, unsigned(ws.num_chunks) * unsigned(x.HV));

  for (unsigned e = blockIdx.x; e < listed; e += gridDim.x) {
    const unsigned entry = ws.wide_list[e];
    const int64_t chunk = entry / unsigned(x.HV);
    const int hv = int(entry % unsigned(x.HV));
    const int h = hv / (x.HV / x.H);
    const int64_t tok0 = ws.chunk_tok0[chunk];
    const int len = int(ws.chunk_len[chunk]);
    const size_t row_base = (size_t(chunk) * x.HV + hv) * C;

    // ---- inputs (rows past the chunk's end are zero; their gate adds nothing) ----
    for (int idx = tid; idx < C * K; idx += kThreads) {
      const int i = idx / K, c = idx % K;
      const bool live = i < len;
      const size_t qk = (size_t(tok0 + i) * x.H + h) * K + c;
      sQ[i * LDK + c] = live ? to_f32(x.q[qk]) : 0.f;
      sK[i * LDK + c] = live ? to_f32(x.k[qk]) : 0.f;
      float g = live ? to_f32(x.g[(size_t(tok0 + i) * x.HV + hv) * K + c]) : 0.f;
      if constexpr (LAYER) {
        if (x.layer.gate && live) {
          const float a = x.layer.A_log ? __expf(x.layer.A_log[hv]) : 1.f;
          const float b = x.layer.dt_bias ? x.layer.dt_bias[size_t(hv) * K + c] : 0.f;
          g = x.layer.gate_softplus ? kda_gate_softplus(a, g + b)
                                    : kda_gate_bounded(x.layer.lower_bound, a, g + b);
        }
      }
      sG[i * LDK + c] = g * kLog2e;
    }
    for (int idx = tid; idx < C * V; idx += kThreads) {
      const int i = idx / V, c = idx % V;
      sV[i * LDV + c] = i < len ? to_f32(x.v[(size_t(tok0 + i) * x.HV + hv) * V + c]) : 0.f;
    }
    if (tid < C) {
      float b = tid < len ? to_f32(x.beta[size_t(tok0 + tid) * x.HV + hv]) : 0.f;
      if constexpr (LAYER)
        if (x.layer.beta_sigmoid && tid < len) b = kda_beta_sigmoid(b);
      sBeta[tid] = b;
    }
    __syncthreads();

    // ---- G = cumulative sums down each channel; the layer's q / k row norms ----
    for (int c = tid; c < K; c += kThreads) {
      float acc = 0.f;
      for (int i = 0; i < C; ++i) {
        acc += sG[i * LDK + c];
        sG[i * LDK + c] = acc;
      }
    }
    if constexpr (LAYER) {
      if (x.layer.l2norm_qk) {  // as chunk_prepare: 1 / max(|row|, 1e-6), a thread a row
        if (tid < 2 * C) {
          float* row = (tid < C ? sQ : sK) + (tid % C) * LDK;
          float s2 = 0.f;
          for (int c = 0; c < K; ++c) s2 += row[c] * row[c];
          const float inv = 1.f / fmaxf(sqrtf(s2), 1e-6f);
          for (int c = 0; c < K; ++c) row[c] *= inv;
        }
      }
    }
    __syncthreads();

    // ---- M and A: the four diagonal 16 x 16 blocks pair by pair with 2^(G_i - G_j) <= 1 formed
    // elementwise (the pairs j <= i enumerated row by row, so that no lane of a warp idles on
    // j > i), the blocks below them on the tensor cores (below); the upper triangle is zeroed
    // apart (session 20: against every pair elementwise, the forward of a listed chunk -2.4 %) ----
    for (int p = tid; p < 4 * 136; p += kThreads) {
      const int block = p / 136, t = p % 136;
      int r = int((sqrtf(8.f * float(t) + 1.f) - 1.f) * 0.5f);
      if (r * (r + 1) / 2 > t) --r;  // sqrtf's rounding
      if ((r + 1) * (r + 2) / 2 <= t) ++r;
      const int i = 16 * block + r, j = 16 * block + t - r * (r + 1) / 2;
      const float* qi = sQ + i * LDK;
      const float* ki = sK + i * LDK;
      const float* kj = sK + j * LDK;
      const float* gi = sG + i * LDK;
      const float* gj = sG + j * LDK;
      float m = 0.f, a = 0.f;
      for (int c = 0; c < K; ++c) {
        const float d = kj[c] * exp2f(gi[c] - gj[c]);
        m += qi[c] * d;
        a += ki[c] * d;
      }
      sM[i * LDC + j] = m * x.scale;
      sL[i * LDC + j] = j < i ? a : 0.f;
    }
    {
      // The blocks (I, J), I > J (fla's way): around the first row b of block J + 1,
      // x_i 2^(G_i - G_b) (i >= b) and k_j 2^(G_b - G_j) (j < b) each carry a factor <= 1, so
      // neither overflows, and their product is the pair's term. Per J: the right operand and the
      // left one of q (M), then of k (A), each followed by its products, a warp a 16 x 8 strip.
      const int warp = tid >> 5, lane = tid & 31, gr = lane >> 2, tq = lane & 3;
      for (int J = 0; J < 3; ++J) {
        const int b = 16 * (J + 1), rows = 16 + C - b;
        for (int pass = 0; pass < 2; ++pass) {
          const float* src = pass == 0 ? sQ : sK;
          for (int idx = pass == 0 ? tid : 16 * K + tid; idx < rows * K; idx += kThreads) {
            const int rr = idx / K, c = idx % K;
            const float gb = sG[b * LDK + c];
            const int row = rr < 16 ? 16 * J + rr : b + rr - 16;
            const float g = sG[row * LDK + c];
            sR[rr * LDR + c] =
                rr < 16 ? sK[row * LDK + c] * exp2f(gb - g) : src[row * LDK + c] * exp2f(g - gb);
          }
          __syncthreads();
          for (int u = warp; u < 2 * (3 - J); u += kThreads / 32) {
            const int I = J + 1 + (u >> 1), n0 = 8 * (u & 1), lr0 = 16 * (I - J);
            float acc[4] = {};
#pragma unroll 4
            for (int k0 = 0; k0 < K; k0 += 8) {
              const float* la = sR + (lr0 + gr) * LDR + k0 + tq;
              const float* rb = sR + (n0 + gr) * LDR + k0 + tq;  // B(k, n) = right row n
              const float af[4] = {la[0], la[8 * LDR], la[4], la[8 * LDR + 4]};
              const float bf[2] = {rb[0], rb[4]};
              mma_fp32_3xtf32(acc, af, bf);
            }
            const float sc = pass == 0 ? x.scale : 1.f;
            float* dst = (pass == 0 ? sM : sL) + (16 * I + gr) * LDC + 16 * J + n0 + 2 * tq;
            dst[0] = acc[0] * sc;
            dst[1] = acc[1] * sc;
            dst[8 * LDC] = acc[2] * sc;
            dst[8 * LDC + 1] = acc[3] * sc;
          }
          __syncthreads();
        }
      }
    }
    for (int idx = tid; idx < C * C; idx += kThreads) {
      const int i = idx / C, j = idx % C;
      if (j > i) sM[i * LDC + j] = sL[i * LDC + j] = 0.f;
    }
    __syncthreads();

    // M out (zeros above the diagonal); the backward's A; then L = beta_i A in place
    for (int idx = tid; idx < C * C; idx += kThreads) {
      const int i = idx / C, j = idx % C;
      ws.M[(row_base + i) * C + j] = __float2bfloat16(sM[i * LDC + j]);
      if (ws.A) ws.A[(row_base + i) * C + j] = __float2bfloat16(sL[i * LDC + j]);
    }
    __syncthreads();
    for (int idx = tid; idx < C * C; idx += kThreads) {
      const int i = idx / C, j = idx % C;
      sL[i * LDC + j] *= sBeta[i];
    }
    // k 2^G for W (k is not read again)
    for (int idx = tid; idx < C * K; idx += kThreads) {
      const int i = idx / K, c = idx % K;
      sK[i * LDK + c] *= exp2f(sG[i * LDK + c]);
    }
    __syncthreads();

    // ---- X = (I + L)^-1 by 16 x 16 blocks (chunk_solve.cuh; L's upper blocks are scratch) ----
    if (tid < 4 * 32 && (tid & 31) < 16) invert_diagonal_blocks<LDC>(sL, sX, tid >> 5, tid & 31);
    __syncthreads();
    merge_inverse_blocks<LDC>(sL, sX, tid >> 5, tid & 31);
    // the blocks above the diagonal (never written): zeros, as the products below read them
    for (int idx = tid; idx < C * C; idx += kThreads) {
      const int i = idx / C, j = idx % C;
      if ((j >> 4) > (i >> 4)) sX[i * LDC + j] = 0.f;
    }
    __syncthreads();
    if (ws.X) {  // the backward keeps X (lower, unit diagonal, zeros above)
      for (int idx = tid; idx < C * C; idx += kThreads) {
        const int i = idx / C, j = idx % C;
        ws.X[(row_base + i) * C + j] = __float2bfloat16(sX[i * LDC + j]);
      }
      __syncthreads();
    }
    for (int idx = tid; idx < C * C; idx += kThreads) {  // T = X diag(beta)
      const int i = idx / C, j = idx % C;
      sX[i * LDC + j] *= sBeta[j];
    }
    __syncthreads();

    // ---- U = T V, W = T (k 2^G) on the tensor cores (3xTF32, about fp32's precision): a warp
    // an 8-column strip at a time, the blocks J <= I of the lower-triangular T only ----
    auto lower_times = [&](const float* src, int ld, int n, bf16* out) {
      const int warp = tid >> 5, lane = tid & 31, gr = lane >> 2, tq = lane & 3;
      for (int n0 = 8 * warp; n0 < n; n0 += 8 * (kThreads / 32)) {
        for (int I = 0; I < 4; ++I) {
          float acc[4] = {};
          for (int k0 = 0; k0 < 16 * (I + 1); k0 += 8) {
            const float* ta = sX + (16 * I + gr) * LDC + k0 + tq;
            const float* sb = src + (k0 + tq) * ld + n0 + gr;
            const float a[4] = {ta[0], ta[8 * LDC], ta[4], ta[8 * LDC + 4]};
            const float b[2] = {sb[0], sb[4 * ld]};
            mma_fp32_3xtf32(acc, a, b);
          }
          bf16* o = out + (row_base + 16 * I + gr) * n + n0 + 2 * tq;
          *reinterpret_cast<uint32_t*>(o) = pack_bf16(acc[0], acc[1]);
          *reinterpret_cast<uint32_t*>(o + 8 * size_t(n)) = pack_bf16(acc[2], acc[3]);
        }
      }
    };
    lower_times(sV, LDV, V, ws.U);
    lower_times(sK, LDK, K, ws.W);
    __syncthreads();  // the next listed chunk overwrites the tiles
  }
}

template <int K, int V, bool LAYER>
void launch(const ChunkTokens& x, const ChunkWorkspace& ws, cudaStream_t stream) {
  using L = ExactLayout<K, V>;
  auto* kernel = chunk_prepare_exact_kernel<K, V, LAYER>;
  static const bool configured = [kernel] {
    check_cuda(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(L::bytes)),
        "chunk_prepare_exact shared memory limit");
    return true;
  }();
  (void)configured;
  // the list's length is on the device: a block an SM walks it (most launches find it empty)
  const unsigned blocks = unsigned(std::max(1, device_sm_count()));
  kernel<<<blocks, kThreads, L::bytes, stream>>>(x, ws);
  check_launch("chunk_prepare_exact kernel");
}

template <bool LAYER>
void launch_kv(const ChunkTokens& x, const ChunkWorkspace& ws, int K, int V, cudaStream_t stream) {
  if (K == 128 && V == 128) return launch<128, 128, LAYER>(x, ws, stream);
  if (K == 128 && V == 64) return launch<128, 64, LAYER>(x, ws, stream);
  if (K == 64 && V == 128) return launch<64, 128, LAYER>(x, ws, stream);
  return launch<64, 64, LAYER>(x, ws, stream);
}

}  // namespace

void launch_chunk_prepare_exact(const ChunkTokens& x, const ChunkWorkspace& ws, int K, int V,
                                cudaStream_t stream) {
  if (x.layer.on) return launch_kv<true>(x, ws, K, V, stream);
  launch_kv<false>(x, ws, K, V, stream);
}

}  // namespace kda::ops::cuda_detail
