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
#include <algorithm>
#include <type_traits>

#include "ops/delta_rule/cuda/chunk_kernels.cuh"
#include "ops/delta_rule/cuda/device_common.cuh"

namespace kda::ops::cuda_detail {
namespace {

using bf16 = __nv_bfloat16;
constexpr int C = kChunk;
constexpr int kThreads = 256;
constexpr float kLog2e = 1.4426950408889634f;

template <Gate GATE, int K, int V>
struct PrepareLayout {
  static constexpr int LDK = K + 8, LDV = V + 8, LDG = K + 4, LDL = C + 4, LDT = C + 8;
  static constexpr size_t bytes_v = size_t(C) * LDV * 2;
  static constexpr size_t bytes_krow = size_t(C) * LDK * 2;
  static constexpr size_t bytes_g = GATE == Gate::channel ? size_t(C) * LDG * 4 : 0;
  static constexpr size_t bytes_l = size_t(C) * LDL * 4, bytes_t = size_t(C) * LDT * 2;
  static constexpr size_t bytes_x = size_t(C) * LDL * 4, bytes_y = 3 * 16 * 16 * 4;
  static constexpr size_t region_a = std::max(bytes_g, bytes_l + bytes_t);         // G, then L + T
  static constexpr size_t region_b = std::max(2 * bytes_krow, bytes_x + bytes_y);  // Qs Kn, X Y
  static constexpr size_t off_v = 0, off_b = bytes_v, off_ks = off_b + region_b;
  static constexpr size_t off_a = off_ks + bytes_krow, off_small = off_a + region_a;
  // small: beta[64], scalar G[64], F[6][K] (2^(G_aI - G_aJ)), E[4][K] (2^(G_aJ))
  static constexpr size_t total = off_small + (2 * C + 10 * K) * 4;
};

template <Gate GATE, int K, int V>
__global__ void __launch_bounds__(kThreads, 2)
    chunk_prepare_kernel(const ChunkTokens x, const ChunkWorkspace ws) {
  using L = PrepareLayout<GATE, K, V>;
  constexpr int LDK = L::LDK, LDV = L::LDV, LDG = L::LDG, LDL = L::LDL, LDT = L::LDT;
  constexpr bool kChannel = GATE == Gate::channel;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sV = reinterpret_cast<bf16*>(smem + L::off_v);
  bf16* sQs = reinterpret_cast<bf16*>(smem + L::off_b);
  bf16* sKn = reinterpret_cast<bf16*>(smem + L::off_b + L::bytes_krow);
  float* sX = reinterpret_cast<float*>(smem + L::off_b);
  float* sY = reinterpret_cast<float*>(smem + L::off_b + L::bytes_x);
  bf16* sKs = reinterpret_cast<bf16*>(smem + L::off_ks);
  float* sG = reinterpret_cast<float*>(smem + L::off_a);
  float* sL = reinterpret_cast<float*>(smem + L::off_a);
  bf16* sT = reinterpret_cast<bf16*>(smem + L::off_a + L::bytes_l);
  float* sBeta = reinterpret_cast<float*>(smem + L::off_small);
  float* sGs = sBeta + C;
  float* sF = sGs + C;
  float* sE = sF + 6 * K;

  const int64_t chunk = blockIdx.x;
  const int hv = blockIdx.y;
  const int h = hv / (x.HV / x.H);
  const int64_t tok0 = ws.chunk_tok0[chunk];
  const int len = int(ws.chunk_len[chunk]);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gr = lane >> 2, tq = lane & 3;
  const size_t row_base = (size_t(chunk) * x.HV + hv) * C;

  // q, k rows for phase 2, fetched now so their latency hides behind phase 1
  constexpr int kItems = C * K / 8 / kThreads;
  uint4 q_raw[kItems], k_raw[kItems];
#pragma unroll
  for (int it = 0; it < kItems; ++it) {
    const int idx = tid + it * kThreads, i = idx / (K / 8), c = (idx % (K / 8)) * 8;
    q_raw[it] = k_raw[it] = make_uint4(0, 0, 0, 0);
    if (i < len) {
      q_raw[it] = *reinterpret_cast<const uint4*>(x.q + (size_t(tok0 + i) * x.H + h) * K + c);
      k_raw[it] = *reinterpret_cast<const uint4*>(x.k + (size_t(tok0 + i) * x.H + h) * K + c);
    }
  }

  // ---- phase 1: v tile (async), beta, gate cumulative sums ----
  for (int idx = tid; idx < C * V / 8; idx += kThreads) {
    const int i = idx / (V / 8), c = (idx % (V / 8)) * 8;
    bf16* dst = sV + i * LDV + c;
    if (i < len)
      cp_async16(dst, x.v + (size_t(tok0 + i) * x.HV + hv) * V + c);
    else
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
  }
  cp_async_commit();
  if (tid < C) sBeta[tid] = tid < len ? to_f32(x.beta[size_t(tok0 + tid) * x.HV + hv]) : 0.f;

  if constexpr (kChannel) {
    constexpr int kSegs = kThreads / K, kRows = C / kSegs;
    const int c = tid % K, seg = tid / K;
    float gl[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int i = seg * kRows + r;
      gl[r] = i < len ? to_f32(x.g[(size_t(tok0 + i) * x.HV + hv) * K + c]) * kLog2e : 0.f;
    }
    float run = 0.f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      run += gl[r];
      sG[(seg * kRows + r) * LDG + c] = run;
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
      sGs[i1] = scan;
      sGs[i0] = scan - x1;
    }
  } else {
    if (tid < C) sGs[tid] = 0.f;
  }
  __syncthreads();

  // ---- phase 2: scaled operands (smem) and Qt, Kd, exp(G_C) (workspace) ----
#pragma unroll
  for (int it = 0; it < kItems; ++it) {
    const int idx = tid + it * kThreads, i = idx / (K / 8), c = (idx % (K / 8)) * 8;
    float q8[8], k8[8];
    load8(reinterpret_cast<const bf16*>(&q_raw[it]), q8);
    load8(reinterpret_cast<const bf16*>(&k_raw[it]), k8);
    float qs[8], ks[8], kn[8], qt[8], kd[8];
    if constexpr (kChannel) {
      const float* gi = sG + i * LDG + c;
      const float* ga = sG + (i & ~15) * LDG + c;
      const float* gl = sG + (len - 1) * LDG + c;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float rel = gi[e] - ga[e];
        const float es = fast_exp2(rel);
        qs[e] = q8[e] * es;
        ks[e] = k8[e] * es;
        kn[e] = k8[e] * fast_exp2(-rel);
        qt[e] = x.scale * q8[e] * fast_exp2(gi[e]);
        kd[e] = k8[e] * fast_exp2(gl[e] - gi[e]);
      }
    } else {
      const float eq = x.scale * fast_exp2(sGs[i]), ed = fast_exp2(sGs[len - 1] - sGs[i]);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        qs[e] = q8[e];
        ks[e] = kn[e] = k8[e];
        qt[e] = q8[e] * eq;
        kd[e] = k8[e] * ed;
      }
    }
    store8_bf16(sQs + i * LDK + c, qs);
    store8_bf16(sKs + i * LDK + c, ks);
    store8_bf16(sKn + i * LDK + c, kn);
    store8_bf16(ws.Qt + (row_base + i) * K + c, qt);
    store8_bf16(ws.Kd + (row_base + i) * K + c, kd);
  }
  float* gC = ws.gC + (size_t(chunk) * x.HV + hv) * K;
  if constexpr (kChannel) {
    for (int idx = tid; idx < 6 * K; idx += kThreads) {
      const int p = idx / K, c = idx % K;
      const int I = p < 1 ? 1 : p < 3 ? 2 : 3;
      const int J = p - I * (I - 1) / 2;
      sF[idx] = fast_exp2(sG[16 * I * LDG + c] - sG[16 * J * LDG + c]);
    }
    for (int idx = tid; idx < 4 * K; idx += kThreads)
      sE[idx] = fast_exp2(sG[16 * (idx / K) * LDG + idx % K]);
    for (int c = tid; c < K; c += kThreads) gC[c] = fast_exp2(sG[(len - 1) * LDG + c]);
  } else {
    const float last = fast_exp2(sGs[len - 1]);
    for (int c = tid; c < K; c += kThreads) gC[c] = last;
  }
  cp_async_wait<0>();
  __syncthreads();

  // ---- phase 3: M = scale * masked(Q K^T decayed) -> workspace, L = beta * strict(K K^T) ----
  {
    const bool is_m = warp < 4;
    const int I = warp & 3;
    const bf16* A = is_m ? sQs : sKs;
    for (int J = 0; J < 4; ++J) {
      float acc[2][4] = {};
      if (J <= I) {
#pragma unroll
        for (int kk = 0; kk < K / 16; ++kk) {
          uint32_t a[4], b[4];
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
          load_b_nk(b, sKn, LDK, 16 * kk, 16 * J, lane);
          mma_bf16(acc[0], a, b[0], b[1]);
          mma_bf16(acc[1], a, b[2], b[3]);
        }
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
            *reinterpret_cast<uint32_t*>(ws.M + (row_base + r) * C + j) = pack_bf16(v0, v1);
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
    }
  }
  __syncthreads();

  // ---- phase 4: X = (I + L)^-1 by 16 x 16 blocks, then T = X diag(beta) ----
  if (warp < 4 && lane < 16) {
    const int I = warp, c = lane;
    const float* Lb = sL + 16 * I * LDL + 16 * I;
    float col[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      float s = r == c ? 1.f : 0.f;
#pragma unroll
      for (int m = 0; m < r; ++m) s -= Lb[r * LDL + m] * col[m];
      col[r] = s;
    }
#pragma unroll
    for (int r = 0; r < 16; ++r) sX[(16 * I + r) * LDL + 16 * I + c] = col[r];
  }
  __syncthreads();
  for (int d = 1; d < 4; ++d) {
    const int blocks = 4 - d;
    for (int idx = tid; idx < blocks * 256; idx += kThreads) {
      const int J = idx >> 8, r = (idx >> 4) & 15, c = idx & 15, I = J + d;
      float y = 0.f;
      for (int kb = J; kb < I; ++kb) {
#pragma unroll
        for (int m = 0; m < 16; ++m)
          y += sL[(16 * I + r) * LDL + 16 * kb + m] * sX[(16 * kb + m) * LDL + 16 * J + c];
      }
      sY[idx] = y;
    }
    __syncthreads();
    for (int idx = tid; idx < blocks * 256; idx += kThreads) {
      const int J = idx >> 8, r = (idx >> 4) & 15, c = idx & 15, I = J + d;
      float v = 0.f;
#pragma unroll
      for (int m = 0; m < 16; ++m)
        v -= sX[(16 * I + r) * LDL + 16 * I + m] * sY[(J << 8) + m * 16 + c];
      sX[(16 * I + r) * LDL + 16 * J + c] = v;
    }
    __syncthreads();
  }
  for (int idx = tid; idx < C * C; idx += kThreads) {
    const int i = idx / C, j = idx % C;
    const float xv = j <= i ? sX[i * LDL + j] : 0.f;
    sT[i * LDT + j] = __float2bfloat16_rn(xv * sBeta[j]);
    if (ws.X) ws.X[(row_base + i) * C + j] = __float2bfloat16_rn(xv);  // backward
  }
  __syncthreads();

  // ---- phase 5: U = T V (warps 0-3), W = T Kt (warps 4-7); 16 rows per warp ----
  const int I = warp & 3;
  auto lower_times = [&](auto n_const, const bf16* src, int ld, bool scale_rows, bf16* out) {
    constexpr int N = decltype(n_const)::value;
    float acc[N / 8][4] = {};
    for (int J = 0; J <= I; ++J) {
      uint32_t a[4];
      load_a(a, sT, LDT, 16 * I, 16 * J, lane);
      float e0 = 1.f, e1 = 1.f, e8 = 1.f, e9 = 1.f;
      if (!kChannel && GATE != Gate::none && scale_rows) {
        e0 = fast_exp2(sGs[16 * J + 2 * tq]);
        e1 = fast_exp2(sGs[16 * J + 2 * tq + 1]);
        e8 = fast_exp2(sGs[16 * J + 2 * tq + 8]);
        e9 = fast_exp2(sGs[16 * J + 2 * tq + 9]);
      }
#pragma unroll
      for (int np = 0; np < N / 16; ++np) {
        uint32_t b[4];
        load_b_kn(b, src, ld, 16 * J, 16 * np, lane);
        if (scale_rows) {
          if constexpr (kChannel) {
            const float f0 = sE[J * K + 16 * np + gr], f1 = sE[J * K + 16 * np + 8 + gr];
            b[0] = scale_bf16x2(b[0], f0, f0);
            b[1] = scale_bf16x2(b[1], f0, f0);
            b[2] = scale_bf16x2(b[2], f1, f1);
            b[3] = scale_bf16x2(b[3], f1, f1);
          } else if constexpr (GATE == Gate::scalar) {
            b[0] = scale_bf16x2(b[0], e0, e1);
            b[1] = scale_bf16x2(b[1], e8, e9);
            b[2] = scale_bf16x2(b[2], e0, e1);
            b[3] = scale_bf16x2(b[3], e8, e9);
          }
        }
        mma_bf16(acc[2 * np], a, b[0], b[1]);
        mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < N / 8; ++nt) {
      const int r = 16 * I + gr, col = 8 * nt + 2 * tq;
      *reinterpret_cast<uint32_t*>(out + (row_base + r) * N + col) =
          pack_bf16(acc[nt][0], acc[nt][1]);
      *reinterpret_cast<uint32_t*>(out + (row_base + r + 8) * N + col) =
          pack_bf16(acc[nt][2], acc[nt][3]);
    }
  };
  if (warp < 4)
    lower_times(std::integral_constant<int, V>{}, sV, LDV, false, ws.U);
  else
    lower_times(std::integral_constant<int, K>{}, sKs, LDK, true, ws.W);
}

template <Gate GATE, int K, int V>
void launch(const ChunkTokens& x, const ChunkWorkspace& ws, cudaStream_t stream) {
  using L = PrepareLayout<GATE, K, V>;
  static const bool configured = [] {
    check_cuda(cudaFuncSetAttribute(chunk_prepare_kernel<GATE, K, V>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, int(L::total)),
               "chunk_prepare shared memory limit");
    return true;
  }();
  (void)configured;
  const dim3 grid(unsigned(ws.num_chunks), unsigned(x.HV));
  chunk_prepare_kernel<GATE, K, V><<<grid, kThreads, L::total, stream>>>(x, ws);
  check_launch("chunk_prepare kernel");
}

template <Gate GATE>
void launch_kv(const ChunkTokens& x, const ChunkWorkspace& ws, int K, int V, cudaStream_t stream) {
  if (K == 128 && V == 128) return launch<GATE, 128, 128>(x, ws, stream);
  if (K == 128 && V == 64) return launch<GATE, 128, 64>(x, ws, stream);
  if (K == 64 && V == 128) return launch<GATE, 64, 128>(x, ws, stream);
  return launch<GATE, 64, 64>(x, ws, stream);
}

}  // namespace

void launch_chunk_prepare(const ChunkTokens& x, const ChunkWorkspace& ws, Gate gate, int K, int V,
                          cudaStream_t stream) {
  switch (gate) {
    case Gate::channel:
      return launch_kv<Gate::channel>(x, ws, K, V, stream);
    case Gate::scalar:
      return launch_kv<Gate::scalar>(x, ws, K, V, stream);
    case Gate::none:
      return launch_kv<Gate::none>(x, ws, K, V, stream);
  }
}

}  // namespace kda::ops::cuda_detail
