// chunk_state_bwd: the sequential part of the chunked backward, chunk_state run in reverse.
// One block of 128 * NT threads per (sequence, value head, NT * 32 state columns) walks the
// sequence's chunks from the last to the first carrying dS, the gradient of the state leaving
// the chunk (fp32 in registers, layout of chunk_state's S):
//   dD = M^T dO + Kd dS                        (warp w: chunk rows 16w..16w+15)
//   dS <- diag(exp(G_C)) dS + Qt^T dO - W^T dD (warp w: state rows w*K/4 .. +K/4)
// M and Qt carry the output scale, so dO enters unscaled. Writes dS (bf16, as the products saw
// it) and dD for every chunk: chunk_bwd_local needs both; dS after the first chunk is dh0.
// M / Kd and dO of the previous chunk are fetched (cp.async) once this chunk's dD is done;
// Qt / W / exp(G_C) once its dS update is done.
#include "ops/delta_rule/cuda/chunk_kernels.cuh"
#include "ops/delta_rule/cuda/device_common.cuh"

namespace kda::ops::cuda_detail {
namespace {

using bf16 = __nv_bfloat16;
constexpr int C = kChunk;
constexpr int BV = kStateTile;

template <int K, int NT>
struct StateBwdLayout {
  static constexpr int LDK = K + 8, LDM = C + 8, LDS = NT * BV + 8;
  static constexpr size_t bytes_k = size_t(C) * LDK * 2, bytes_m = size_t(C) * LDM * 2;
  static constexpr size_t bytes_o = size_t(C) * LDS * 2;
  static constexpr size_t off_w = 0, off_q = bytes_k, off_kd = 2 * bytes_k, off_m = 3 * bytes_k;
  static constexpr size_t off_do = off_m + bytes_m;             // 2 buffers
  static constexpr size_t off_s = off_do + 2 * bytes_o;         // dS (bf16), K rows
  static constexpr size_t off_d = off_s + size_t(K) * LDS * 2;  // -dD (bf16)
  static constexpr size_t off_gc = off_d + bytes_o;             // K floats
  static constexpr size_t total = off_gc + K * 4;
};

template <int K, int V, int NT>
__global__ void __launch_bounds__(128 * NT, 2 / NT)
    chunk_state_bwd_kernel(const ChunkTokens x, const ChunkWorkspace ws, const ChunkGrads gd) {
  using L = StateBwdLayout<K, NT>;
  constexpr int kThreads = 128 * NT;
  constexpr int LDK = L::LDK, LDM = L::LDM, LDS = L::LDS;
  constexpr int MT = K / 64;   // 16-row state tiles per warp
  constexpr int TW = NT * BV;  // columns of the block
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sW = reinterpret_cast<bf16*>(smem + L::off_w);
  bf16* sQ = reinterpret_cast<bf16*>(smem + L::off_q);
  bf16* sKd = reinterpret_cast<bf16*>(smem + L::off_kd);
  bf16* sM = reinterpret_cast<bf16*>(smem + L::off_m);
  bf16* sO = reinterpret_cast<bf16*>(smem + L::off_do);
  bf16* sS = reinterpret_cast<bf16*>(smem + L::off_s);
  bf16* sDn = reinterpret_cast<bf16*>(smem + L::off_d);
  float* sGc = reinterpret_cast<float*>(smem + L::off_gc);

  const int vt = blockIdx.x, hv = blockIdx.y;
  const int64_t n = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = (tid >> 5) & 3, group = tid >> 7;
  const int gr = lane >> 2, tq = lane & 3;
  const int64_t chunk0 = ws.seq_chunk0[n], nchunks = ws.seq_nchunks[n];
  const int64_t seq_bos = ws.seq_bos[n], seq_len = ws.seq_len[n];
  const int mrow0 = warp * (K / 4);
  const int col0 = vt * TW;   // first state column of the block
  const int cg = group * BV;  // this warp group's columns within the block's tiles

  auto load_qwg = [&](int64_t chunk) {
    const size_t base = (size_t(chunk) * x.HV + hv) * C;
    for (int idx = tid; idx < C * K / 8; idx += kThreads) {
      const int i = idx / (K / 8), c = (idx % (K / 8)) * 8;
      cp_async16(sW + i * LDK + c, ws.W + (base + i) * K + c);
      cp_async16(sQ + i * LDK + c, ws.Qt + (base + i) * K + c);
    }
    const float* gsrc = ws.gC + (size_t(chunk) * x.HV + hv) * K;
    for (int idx = tid; idx < K / 4; idx += kThreads) cp_async16(sGc + idx * 4, gsrc + idx * 4);
  };
  auto load_mkd = [&](int64_t chunk, int buf) {
    const size_t base = (size_t(chunk) * x.HV + hv) * C;
    for (int idx = tid; idx < C * K / 8; idx += kThreads) {
      const int i = idx / (K / 8), c = (idx % (K / 8)) * 8;
      cp_async16(sKd + i * LDK + c, ws.Kd + (base + i) * K + c);
    }
    for (int idx = tid; idx < C * C / 8; idx += kThreads) {
      const int i = idx / (C / 8), c = (idx % (C / 8)) * 8;
      cp_async16(sM + i * LDM + c, ws.M + (base + i) * C + c);
    }
    // first token and length as chunk_plan lays them out: computed, since a table load here
    // would stall the chunk's chain for an L2 round trip
    const int64_t tok0 = seq_bos + (chunk - chunk0) * C;
    const int len = int(seq_len - (chunk - chunk0) * C < C ? seq_len - (chunk - chunk0) * C : C);
    bf16* o = sO + buf * C * LDS;
    for (int idx = tid; idx < C * TW / 8; idx += kThreads) {
      const int i = idx / (TW / 8), c = (idx % (TW / 8)) * 8;
      if (i < len)
        cp_async16(o + i * LDS + c, gd.dO + (size_t(tok0 + i) * x.HV + hv) * V + col0 + c);
      else
        *reinterpret_cast<uint4*>(o + i * LDS + c) = make_uint4(0, 0, 0, 0);
    }
  };

  float dS[MT][BV / 8][4];
  const size_t state_off = (size_t(n) * x.HV + hv) * size_t(K) * V + col0 + cg;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < BV / 8; ++nt) {
      const int r = mrow0 + 16 * mt + gr, c = 8 * nt + 2 * tq;
      if (gd.dht) {
        const float2 a = *reinterpret_cast<const float2*>(gd.dht + state_off + size_t(r) * V + c);
        const float2 b =
            *reinterpret_cast<const float2*>(gd.dht + state_off + size_t(r + 8) * V + c);
        dS[mt][nt][0] = a.x, dS[mt][nt][1] = a.y, dS[mt][nt][2] = b.x, dS[mt][nt][3] = b.y;
      } else {
        dS[mt][nt][0] = dS[mt][nt][1] = dS[mt][nt][2] = dS[mt][nt][3] = 0.f;
      }
    }

  load_qwg(chunk0 + nchunks - 1);
  load_mkd(chunk0 + nchunks - 1, 0);
  cp_async_commit();

  for (int64_t ci = nchunks - 1; ci >= 0; --ci) {
    const int buf = int((nchunks - 1 - ci) & 1);
    const int64_t chunk = chunk0 + ci;
    const size_t chunk_head = size_t(chunk) * x.HV + hv;
    // dS leaving this chunk as bf16: smem for the products, workspace for chunk_bwd_local
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < BV / 8; ++nt) {
        const int r = mrow0 + 16 * mt + gr, c = cg + 8 * nt + 2 * tq;
        const uint32_t lo = pack_bf16(dS[mt][nt][0], dS[mt][nt][1]);
        const uint32_t hi = pack_bf16(dS[mt][nt][2], dS[mt][nt][3]);
        *reinterpret_cast<uint32_t*>(sS + r * LDS + c) = lo;
        *reinterpret_cast<uint32_t*>(sS + (r + 8) * LDS + c) = hi;
        bf16* dst = gd.dS + (chunk_head * K + r) * V + col0 + c;
        *reinterpret_cast<uint32_t*>(dst) = lo;
        *reinterpret_cast<uint32_t*>(dst + 8 * V) = hi;
      }
    cp_async_wait<0>();
    __syncthreads();

    // dD = M^T dO + Kd dS for chunk rows 16w..16w+15 (M[i][j] = 0 for i < j)
    const bf16* o = sO + buf * C * LDS;
    float acc[BV / 8][4] = {};
    for (int I = warp; I < C / 16; ++I) {
      uint32_t a[4];
      load_a_trans(a, sM, LDM, 16 * warp, 16 * I, lane);
#pragma unroll
      for (int np = 0; np < BV / 16; ++np) {
        uint32_t b[4];
        load_b_kn(b, o, LDS, 16 * I, cg + 16 * np, lane);
        mma_bf16(acc[2 * np], a, b[0], b[1]);
        mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
      uint32_t a[4];
      load_a(a, sKd, LDK, 16 * warp, 16 * kk, lane);
#pragma unroll
      for (int np = 0; np < BV / 16; ++np) {
        uint32_t b[4];
        load_b_kn(b, sS, LDS, 16 * kk, cg + 16 * np, lane);
        mma_bf16(acc[2 * np], a, b[0], b[1]);
        mma_bf16(acc[2 * np + 1], a, b[2], b[3]);
      }
    }
#pragma unroll
    for (int nt = 0; nt < BV / 8; ++nt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 16 * warp + gr + 8 * half, c = cg + 8 * nt + 2 * tq;
        const float d0 = acc[nt][2 * half], d1 = acc[nt][2 * half + 1];
        *reinterpret_cast<uint32_t*>(sDn + r * LDS + c) = pack_bf16(-d0, -d1);
        *reinterpret_cast<uint32_t*>(gd.dD + (chunk_head * C + r) * V + col0 + c) =
            pack_bf16(d0, d1);
      }
    }
    __syncthreads();
    if (ci > 0) {
      load_mkd(chunk - 1, buf ^ 1);
      cp_async_commit();
    }

    // dS <- diag(exp(G_C)) dS + Qt^T dO + W^T (-dD)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int m0 = mrow0 + 16 * mt;
      const float ga = sGc[m0 + gr], gb = sGc[m0 + gr + 8];
#pragma unroll
      for (int nt = 0; nt < BV / 8; ++nt) {
        dS[mt][nt][0] *= ga, dS[mt][nt][1] *= ga;
        dS[mt][nt][2] *= gb, dS[mt][nt][3] *= gb;
      }
#pragma unroll
      for (int J = 0; J < C / 16; ++J) {
        uint32_t aq[4], aw[4];
        load_a_trans(aq, sQ, LDK, m0, 16 * J, lane);
        load_a_trans(aw, sW, LDK, m0, 16 * J, lane);
#pragma unroll
        for (int np = 0; np < BV / 16; ++np) {
          uint32_t b[4], bd[4];
          load_b_kn(b, o, LDS, 16 * J, cg + 16 * np, lane);
          load_b_kn(bd, sDn, LDS, 16 * J, cg + 16 * np, lane);
          mma_bf16(dS[mt][2 * np], aq, b[0], b[1]);
          mma_bf16(dS[mt][2 * np + 1], aq, b[2], b[3]);
          mma_bf16(dS[mt][2 * np], aw, bd[0], bd[1]);
          mma_bf16(dS[mt][2 * np + 1], aw, bd[2], bd[3]);
        }
      }
    }
    __syncthreads();
    if (ci > 0) {
      load_qwg(chunk - 1);
      cp_async_commit();
    }
  }

  if (gd.dh0) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < BV / 8; ++nt) {
        const int r = mrow0 + 16 * mt + gr, c = 8 * nt + 2 * tq;
        *reinterpret_cast<float2*>(gd.dh0 + state_off + size_t(r) * V + c) =
            make_float2(dS[mt][nt][0], dS[mt][nt][1]);
        *reinterpret_cast<float2*>(gd.dh0 + state_off + size_t(r + 8) * V + c) =
            make_float2(dS[mt][nt][2], dS[mt][nt][3]);
      }
  }
}

template <int K, int V, int NT>
void launch(const ChunkTokens& x, const ChunkWorkspace& ws, const ChunkGrads& gd, int64_t num_seqs,
            cudaStream_t stream) {
  using L = StateBwdLayout<K, NT>;
  static const bool configured = [] {
    check_cuda(cudaFuncSetAttribute(chunk_state_bwd_kernel<K, V, NT>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, int(L::total)),
               "chunk_state_bwd shared memory limit");
    return true;
  }();
  (void)configured;
  const dim3 grid(unsigned(V / (NT * BV)), unsigned(x.HV), unsigned(num_seqs));
  chunk_state_bwd_kernel<K, V, NT><<<grid, 128 * NT, L::total, stream>>>(x, ws, gd);
  check_launch("chunk_state_bwd kernel");
}

}  // namespace

void launch_chunk_state_bwd(const ChunkTokens& x, const ChunkWorkspace& ws, const ChunkGrads& gd,
                            int64_t num_seqs, int K, int V, cudaStream_t stream) {
  if (chunk_state_bwd_uses_wgmma(num_seqs, x.HV, K, V))
    return launch_chunk_state_bwd_wgmma(x, ws, gd, num_seqs, K, V, stream);
  // As chunk_state: two column tiles per block when there are enough blocks to fill the chip.
  const bool wide = num_seqs * x.HV * (V / (2 * BV)) >= 2 * int64_t(device_sm_count());
  if (K == 128 && V == 128)
    return wide ? launch<128, 128, 2>(x, ws, gd, num_seqs, stream)
                : launch<128, 128, 1>(x, ws, gd, num_seqs, stream);
  require(K == 64 && V == 64, "chunk_state_bwd: K = V = 64 or 128");
  return wide ? launch<64, 64, 2>(x, ws, gd, num_seqs, stream)
              : launch<64, 64, 1>(x, ws, gd, num_seqs, stream);
}

}  // namespace kda::ops::cuda_detail
