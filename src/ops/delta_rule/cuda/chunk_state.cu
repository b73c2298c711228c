// chunk_state: the sequential part of the chunked forward. One block of 128 threads (4 warps)
// per (sequence, value head, 32-column tile of the state) walks the sequence's chunks:
//   D = U - W S0          (warp w: chunk rows 16w..16w+15)
//   O = Qt S0 + M D       (same rows; written as bf16)
//   S = diag(exp(G_C)) S0 + Kd^T D   (warp w: state rows w*K/4 .. +K/4, fp32 in registers)
// S0 enters the products as bf16 (as in fla). The next chunk's Kd / M / exp(G_C) are fetched
// (cp.async, double-buffered) while this chunk computes; W / Qt / U are fetched once step one
// has consumed them.
#include "ops/delta_rule/cuda/chunk_kernels.cuh"
#include "ops/delta_rule/cuda/device_common.cuh"

namespace kda::ops::cuda_detail {
namespace {

using bf16 = __nv_bfloat16;
constexpr int C = kChunk;
constexpr int BV = kStateTile;  // columns per group of 4 warps

// NT groups of 4 warps share one block's W / Qt / Kd / M tiles and own NT * 32 columns.
template <int K, int NT>
struct StateLayout {
  static constexpr int LDK = K + 8, LDM = C + 8, LDS = NT * BV + 8;
  static constexpr size_t bytes_k = size_t(C) * LDK * 2, bytes_m = size_t(C) * LDM * 2;
  static constexpr size_t off_w = 0, off_q = bytes_k, off_kd = 2 * bytes_k;  // Kd: 2 buffers
  static constexpr size_t off_m = 4 * bytes_k;                               // M: 2 buffers
  static constexpr size_t off_u = off_m + 2 * bytes_m;
  static constexpr size_t off_s = off_u + size_t(C) * LDS * 2;
  static constexpr size_t off_d = off_s + size_t(K) * LDS * 2;
  static constexpr size_t off_gc = off_d + size_t(C) * LDS * 2;  // 2 buffers of K floats
  static constexpr size_t total = off_gc + 2 * K * 4;
};

template <int K, int V, int NT>
__global__ void __launch_bounds__(128 * NT, 2 / NT)
    chunk_state_kernel(const ChunkTokens x, const ChunkWorkspace ws) {
  using L = StateLayout<K, NT>;
  constexpr int kThreads = 128 * NT;
  constexpr int LDK = L::LDK, LDM = L::LDM, LDS = L::LDS;
  constexpr int MT = K / 64;  // 16-row state tiles per warp
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sW = reinterpret_cast<bf16*>(smem + L::off_w);
  bf16* sQ = reinterpret_cast<bf16*>(smem + L::off_q);
  bf16* sKd = reinterpret_cast<bf16*>(smem + L::off_kd);
  bf16* sM = reinterpret_cast<bf16*>(smem + L::off_m);
  bf16* sU = reinterpret_cast<bf16*>(smem + L::off_u);
  bf16* sS = reinterpret_cast<bf16*>(smem + L::off_s);
  bf16* sD = reinterpret_cast<bf16*>(smem + L::off_d);
  float* sGc = reinterpret_cast<float*>(smem + L::off_gc);

  const int vt = blockIdx.x, hv = blockIdx.y;
  const int64_t n = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = (tid >> 5) & 3, group = tid >> 7;
  const int gr = lane >> 2, tq = lane & 3;
  const int64_t chunk0 = ws.seq_chunk0[n], nchunks = ws.seq_nchunks[n];
  const int mrow0 = warp * (K / 4);
  const int col0 = vt * NT * BV;  // first state column of the block
  const int cg = group * BV;      // this warp group's columns within the block's tiles

  auto load_wqu = [&](int64_t chunk) {
    const size_t base = (size_t(chunk) * x.HV + hv) * C;
    for (int idx = tid; idx < C * K / 8; idx += kThreads) {
      const int i = idx / (K / 8), c = (idx % (K / 8)) * 8;
      cp_async16(sW + i * LDK + c, ws.W + (base + i) * K + c);
      cp_async16(sQ + i * LDK + c, ws.Qt + (base + i) * K + c);
    }
    for (int idx = tid; idx < C * NT * BV / 8; idx += kThreads) {
      const int i = idx / (NT * BV / 8), c = (idx % (NT * BV / 8)) * 8;
      cp_async16(sU + i * LDS + c, ws.U + (base + i) * V + col0 + c);
    }
  };
  auto load_kdm = [&](int64_t chunk, int buf) {
    const size_t base = (size_t(chunk) * x.HV + hv) * C;
    bf16* kd = sKd + buf * C * LDK;
    bf16* m = sM + buf * C * LDM;
    for (int idx = tid; idx < C * K / 8; idx += kThreads) {
      const int i = idx / (K / 8), c = (idx % (K / 8)) * 8;
      cp_async16(kd + i * LDK + c, ws.Kd + (base + i) * K + c);
    }
    for (int idx = tid; idx < C * C / 8; idx += kThreads) {
      const int i = idx / (C / 8), c = (idx % (C / 8)) * 8;
      cp_async16(m + i * LDM + c, ws.M + (base + i) * C + c);
    }
    const float* gsrc = ws.gC + (size_t(chunk) * x.HV + hv) * K;
    for (int idx = tid; idx < K / 4; idx += kThreads)
      cp_async16(sGc + buf * K + idx * 4, gsrc + idx * 4);
  };

  float S[MT][BV / 8][4];
  const size_t state_off = (size_t(n) * x.HV + hv) * size_t(K) * V + col0 + cg;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < BV / 8; ++nt) {
      const int r = mrow0 + 16 * mt + gr, c = 8 * nt + 2 * tq;
      if (x.h0) {
        const float2 a = *reinterpret_cast<const float2*>(x.h0 + state_off + size_t(r) * V + c);
        const float2 b = *reinterpret_cast<const float2*>(x.h0 + state_off + size_t(r + 8) * V + c);
        S[mt][nt][0] = a.x, S[mt][nt][1] = a.y, S[mt][nt][2] = b.x, S[mt][nt][3] = b.y;
      } else {
        S[mt][nt][0] = S[mt][nt][1] = S[mt][nt][2] = S[mt][nt][3] = 0.f;
      }
    }

  load_wqu(chunk0);
  load_kdm(chunk0, 0);
  cp_async_commit();

  for (int64_t ci = 0; ci < nchunks; ++ci) {
    const int buf = int(ci & 1);
    const int64_t chunk = chunk0 + ci;
    // S0 as bf16 for the products
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < BV / 8; ++nt) {
        const int r = mrow0 + 16 * mt + gr, c = cg + 8 * nt + 2 * tq;
        const uint32_t lo = pack_bf16(S[mt][nt][0], S[mt][nt][1]);
        const uint32_t hi = pack_bf16(S[mt][nt][2], S[mt][nt][3]);
        *reinterpret_cast<uint32_t*>(sS + r * LDS + c) = lo;
        *reinterpret_cast<uint32_t*>(sS + (r + 8) * LDS + c) = hi;
        if (ws.S0) {  // backward: the state entering the chunk, as the products saw it
          bf16* dst = ws.S0 + ((size_t(chunk) * x.HV + hv) * K + r) * V + col0 + c;
          *reinterpret_cast<uint32_t*>(dst) = lo;
          *reinterpret_cast<uint32_t*>(dst + 8 * V) = hi;
        }
      }
    cp_async_wait<0>();
    __syncthreads();
    if (ci + 1 < nchunks) {
      load_kdm(chunk + 1, buf ^ 1);
      cp_async_commit();
    }

    // D = U - W S0 and P = Qt S0 for chunk rows 16w..16w+15
    float accD[BV / 8][4] = {}, accP[BV / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
      uint32_t aw[4], aq[4];
      load_a(aw, sW, LDK, 16 * warp, 16 * kk, lane);
      load_a(aq, sQ, LDK, 16 * warp, 16 * kk, lane);
#pragma unroll
      for (int np = 0; np < BV / 16; ++np) {
        uint32_t b[4];
        load_b_kn(b, sS, LDS, 16 * kk, cg + 16 * np, lane);
        mma_bf16(accD[2 * np], aw, b[0], b[1]);
        mma_bf16(accD[2 * np + 1], aw, b[2], b[3]);
        mma_bf16(accP[2 * np], aq, b[0], b[1]);
        mma_bf16(accP[2 * np + 1], aq, b[2], b[3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < BV / 8; ++nt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 16 * warp + gr + 8 * half, c = cg + 8 * nt + 2 * tq;
        const float2 u = unpack_bf16(*reinterpret_cast<const uint32_t*>(sU + r * LDS + c));
        const uint32_t d = pack_bf16(u.x - accD[nt][2 * half], u.y - accD[nt][2 * half + 1]);
        *reinterpret_cast<uint32_t*>(sD + r * LDS + c) = d;
        if (ws.D)  // backward
          *reinterpret_cast<uint32_t*>(ws.D + ((size_t(chunk) * x.HV + hv) * C + r) * V + col0 +
                                       c) = d;
      }
    }
    __syncthreads();
    if (ci + 1 < nchunks) {
      load_wqu(chunk + 1);
      cp_async_commit();
    }

    // O = P + M D (M is lower triangular: k-steps up to the warp's own block)
    const bf16* m = sM + buf * C * LDM;
    for (int J = 0; J <= warp; ++J) {
      uint32_t a[4];
      load_a(a, m, LDM, 16 * warp, 16 * J, lane);
#pragma unroll
      for (int np = 0; np < BV / 16; ++np) {
        uint32_t b[4];
        load_b_kn(b, sD, LDS, 16 * J, cg + 16 * np, lane);
        mma_bf16(accP[2 * np], a, b[0], b[1]);
        mma_bf16(accP[2 * np + 1], a, b[2], b[3]);
      }
    }
    const int64_t tok0 = ws.chunk_tok0[chunk];
    const int len = int(ws.chunk_len[chunk]);
#pragma unroll
    for (int nt = 0; nt < BV / 8; ++nt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 16 * warp + gr + 8 * half, c = col0 + cg + 8 * nt + 2 * tq;
        if (r < len && x.o)
          *reinterpret_cast<uint32_t*>(x.o + (size_t(tok0 + r) * x.HV + hv) * V + c) =
              pack_bf16(accP[nt][2 * half], accP[nt][2 * half + 1]);
      }
    }

    // S = diag(exp(G_C)) S0 + Kd^T D
    const bf16* kd = sKd + buf * C * LDK;
    const float* gc = sGc + buf * K;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int m0 = mrow0 + 16 * mt;
      const float ga = gc[m0 + gr], gb = gc[m0 + gr + 8];
#pragma unroll
      for (int nt = 0; nt < BV / 8; ++nt) {
        S[mt][nt][0] *= ga, S[mt][nt][1] *= ga;
        S[mt][nt][2] *= gb, S[mt][nt][3] *= gb;
      }
#pragma unroll
      for (int J = 0; J < C / 16; ++J) {
        uint32_t a[4];
        load_a_trans(a, kd, LDK, m0, 16 * J, lane);
#pragma unroll
        for (int np = 0; np < BV / 16; ++np) {
          uint32_t b[4];
          load_b_kn(b, sD, LDS, 16 * J, cg + 16 * np, lane);
          mma_bf16(S[mt][2 * np], a, b[0], b[1]);
          mma_bf16(S[mt][2 * np + 1], a, b[2], b[3]);
        }
      }
    }
    __syncthreads();
  }

  if (x.ht) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < BV / 8; ++nt) {
        const int r = mrow0 + 16 * mt + gr, c = 8 * nt + 2 * tq;
        *reinterpret_cast<float2*>(x.ht + state_off + size_t(r) * V + c) =
            make_float2(S[mt][nt][0], S[mt][nt][1]);
        *reinterpret_cast<float2*>(x.ht + state_off + size_t(r + 8) * V + c) =
            make_float2(S[mt][nt][2], S[mt][nt][3]);
      }
  }
}

template <int K, int V, int NT>
void launch(const ChunkTokens& x, const ChunkWorkspace& ws, int64_t num_seqs, cudaStream_t stream) {
  using L = StateLayout<K, NT>;
  static const bool configured = [] {
    check_cuda(cudaFuncSetAttribute(chunk_state_kernel<K, V, NT>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, int(L::total)),
               "chunk_state shared memory limit");
    return true;
  }();
  (void)configured;
  const dim3 grid(unsigned(V / (NT * BV)), unsigned(x.HV), unsigned(num_seqs));
  chunk_state_kernel<K, V, NT><<<grid, 128 * NT, L::total, stream>>>(x, ws);
  check_launch("chunk_state kernel");
}

}  // namespace

void launch_chunk_state(const ChunkTokens& x, const ChunkWorkspace& ws, int64_t num_seqs, int K,
                        int V, cudaStream_t stream) {
  // Two column tiles per block halve the L2 traffic of the shared tiles; one tile per block
  // when that would leave SMs idle (few sequences x heads, e.g. one long sequence).
  const bool wide = num_seqs * x.HV * (V / (2 * BV)) >= 2 * 132;
  if (K == 128 && V == 128)
    return wide ? launch<128, 128, 2>(x, ws, num_seqs, stream)
                : launch<128, 128, 1>(x, ws, num_seqs, stream);
  if (K == 128 && V == 64)
    return wide ? launch<128, 64, 2>(x, ws, num_seqs, stream)
                : launch<128, 64, 1>(x, ws, num_seqs, stream);
  if (K == 64 && V == 128)
    return wide ? launch<64, 128, 2>(x, ws, num_seqs, stream)
                : launch<64, 128, 1>(x, ws, num_seqs, stream);
  return wide ? launch<64, 64, 2>(x, ws, num_seqs, stream)
              : launch<64, 64, 1>(x, ws, num_seqs, stream);
}

}  // namespace kda::ops::cuda_detail
