// chunk_state: the sequential part of the chunked forward. One group of 4 warps per (sequence,
// value head, 32-column tile of the state) walks the sequence's chunks (a block holds NT = 1
// or 2 groups):
//   D = U - W S0          (warp w: chunk rows 16w..16w+15)
//   O = Qt S0 + M D       (same rows; written as bf16)
//   S = diag(exp(G_C)) S0 + Kd^T D   (warp w: state rows w*K/4 .. +K/4, fp32 in registers)
// S0 enters the products as bf16 (as in fla). W / Qt / U are fetched (cp.async) once step one
// has consumed the previous chunk's. Buffering of M and Kd (used second and last):
//   NT = 1:        both double-buffered, fetched a chunk ahead (with one block per SM, as for
//                  one long sequence, nothing else hides their latency);
//   NT = 2:        M double-buffered; Kd one buffer, fetched at the top of its own chunk (106 KB
//                  of shared memory, so that two 8-warp blocks share an SM);
//   NT = 2, RAW:   both one buffer, fetched at the top of their own chunk.
// Gated DeltaNet forward (ws.raw_qk, RAW = true): Q and K are the inputs q, k (zero rows past
// the sequence end) and the chunk's G (log2 cumsum, C floats) replaces exp(G_C): P = Q S0 gets
// the row factors scale 2^G_i, and the state update uses Dk = diag(2^(G_C - G_j)) D (a second
// bf16 tile written with D) against K itself: S = 2^G_C S0 + K^T Dk.
#include <cstdlib>
#include <cstring>

#include "ops/delta_rule/cuda/chunk_kernels.cuh"
#include "ops/delta_rule/cuda/chunk_walk_mma.cuh"
#include "ops/delta_rule/cuda/device_common.cuh"

namespace kda::ops::cuda_detail {
namespace {

using bf16 = __nv_bfloat16;
constexpr int C = kChunk;
constexpr int BV = kStateTile;  // columns per group of 4 warps

// NT groups of 4 warps share one block's W / Qt / Kd / M tiles and own NT * 32 columns.
template <int K, int NT, bool RAW>
struct StateLayout {
  static constexpr int kKdBuffers = NT == 1 ? 2 : 1;
  static constexpr int kMBuffers = RAW && NT == 2 ? 1 : 2;
  static constexpr int LDK = K + 8, LDM = C + 8, LDS = NT * BV + 8;
  static constexpr size_t bytes_k = size_t(C) * LDK * 2, bytes_m = size_t(C) * LDM * 2;
  static constexpr size_t bytes_d = size_t(C) * LDS * 2;
  static constexpr size_t off_w = 0, off_q = bytes_k, off_kd = 2 * bytes_k;
  static constexpr size_t off_m = off_kd + kKdBuffers * bytes_k;
  static constexpr size_t off_u = off_m + kMBuffers * bytes_m;
  static constexpr size_t off_s = off_u + bytes_d;
  static constexpr size_t off_d = off_s + size_t(K) * LDS * 2;
  static constexpr size_t off_dk = off_d + bytes_d;  // RAW only
  static constexpr size_t off_gc = off_dk + (RAW ? bytes_d : 0);
  // exp(G_C) with Kd (kKdBuffers x K floats); RAW: G with W / Q / U (2 x C floats, K >= C)
  static constexpr size_t total = off_gc + (RAW ? 2 : kKdBuffers) * K * 4;
};

template <int K, int V, int NT, bool RAW>
__global__ void __launch_bounds__(128 * NT, 2)
    chunk_state_kernel(const ChunkTokens x, const ChunkWorkspace ws) {
  using L = StateLayout<K, NT, RAW>;
  constexpr int kThreads = 128 * NT;
  constexpr int LDK = L::LDK, LDM = L::LDM, LDS = L::LDS;
  constexpr int MT = K / 64;                     // 16-row state tiles per warp
  constexpr bool kKdAhead = L::kKdBuffers == 2;  // Kd and M a chunk ahead
  constexpr bool kMAhead = L::kMBuffers == 2;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sW = reinterpret_cast<bf16*>(smem + L::off_w);
  bf16* sQ = reinterpret_cast<bf16*>(smem + L::off_q);
  bf16* sKd = reinterpret_cast<bf16*>(smem + L::off_kd);
  bf16* sM = reinterpret_cast<bf16*>(smem + L::off_m);
  bf16* sU = reinterpret_cast<bf16*>(smem + L::off_u);
  bf16* sS = reinterpret_cast<bf16*>(smem + L::off_s);
  bf16* sD = reinterpret_cast<bf16*>(smem + L::off_d);
  bf16* sDk = RAW ? reinterpret_cast<bf16*>(smem + L::off_dk) : sD;
  float* sGc = reinterpret_cast<float*>(smem + L::off_gc);

  const int vt = blockIdx.x, hv = blockIdx.y;
  const int64_t n = blockIdx.z;
  const int h = hv / (x.HV / x.H);
  const int tid = threadIdx.x, lane = tid & 31, warp = (tid >> 5) & 3, group = tid >> 7;
  const int gr = lane >> 2, tq = lane & 3;
  const WalkedChunks walk(ws, n);
  const int64_t chunk0 = walk.first, nchunks = walk.count;
  auto chunk_tok0 = [&](int64_t chunk) { return walk.tok0(chunk); };
  auto chunk_len = [&](int64_t chunk) { return walk.len(chunk); };
  const int mrow0 = warp * (K / 4);
  const int col0 = vt * NT * BV;  // first state column of the block
  const int cg = group * BV;      // this warp group's columns within the block's tiles

  // RAW: a K-wide tile of q or k rows (token-major input), zero past the chunk's length
  auto load_raw = [&](bf16* dst, const bf16* src, int64_t chunk) {
    walk_mma::load_raw_rows<K, LDK, kThreads>(dst, src, walk, chunk, x.H, h, tid);
  };
  auto load_wqu = [&](int64_t chunk, int gbuf) {
    const size_t base = (size_t(chunk) * x.HV + hv) * C;
    if constexpr (RAW) {  // G of the chunk, needed from the D step on
      const float* gsrc = ws.gC + (size_t(chunk) * x.HV + hv) * K;
      for (int idx = tid; idx < C / 4; idx += kThreads)
        cp_async16(sGc + gbuf * K + idx * 4, gsrc + idx * 4);
    }
    for (int idx = tid; idx < C * K / 8; idx += kThreads) {
      const int i = idx / (K / 8), c = (idx % (K / 8)) * 8;
      cp_async16(sW + i * LDK + c, ws.W + (base + i) * K + c);
      if constexpr (!RAW) cp_async16(sQ + i * LDK + c, ws.Qt + (base + i) * K + c);
    }
    if constexpr (RAW) load_raw(sQ, x.q, chunk);
    for (int idx = tid; idx < C * NT * BV / 8; idx += kThreads) {
      const int i = idx / (NT * BV / 8), c = (idx % (NT * BV / 8)) * 8;
      cp_async16(sU + i * LDS + c, ws.U + (base + i) * V + col0 + c);
    }
  };
  auto load_m = [&](int64_t chunk, int buf) {
    const size_t base = (size_t(chunk) * x.HV + hv) * C;
    bf16* m = sM + buf * C * LDM;
    for (int idx = tid; idx < C * C / 8; idx += kThreads) {
      const int i = idx / (C / 8), c = (idx % (C / 8)) * 8;
      cp_async16(m + i * LDM + c, ws.M + (base + i) * C + c);
    }
  };
  // Kd (or k) and exp(G_C) (or G) of `chunk` into Kd buffer `buf`
  auto load_kd = [&](int64_t chunk, int buf) {
    const size_t base = (size_t(chunk) * x.HV + hv) * C;
    bf16* kd = sKd + buf * C * LDK;
    if constexpr (RAW) {
      load_raw(kd, x.k, chunk);
    } else {
      for (int idx = tid; idx < C * K / 8; idx += kThreads) {
        const int i = idx / (K / 8), c = (idx % (K / 8)) * 8;
        cp_async16(kd + i * LDK + c, ws.Kd + (base + i) * K + c);
      }
    }
    if constexpr (!RAW) {
      const float* gsrc = ws.gC + (size_t(chunk) * x.HV + hv) * K;
      for (int idx = tid; idx < K / 4; idx += kThreads)
        cp_async16(sGc + buf * K + idx * 4, gsrc + idx * 4);
    }
  };

  float S[MT][BV / 8][4];
  const size_t state_off = (size_t(n) * x.HV + hv) * size_t(K) * V + col0 + cg;
  walk_mma::load_state_rows(S, x.h0 ? x.h0 + state_off : nullptr, V, mrow0, lane);

  if (nchunks > 0) {
    load_wqu(chunk0, 0);
    if constexpr (kMAhead) load_m(chunk0, 0);
    if constexpr (kKdAhead) load_kd(chunk0, 0);
  }
  cp_async_commit();

  for (int64_t ci = 0; ci < nchunks; ++ci) {
    const int buf = int(ci & 1);
    const int kbuf = kKdAhead ? buf : 0, mbuf = kMAhead ? buf : 0;
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
    if constexpr (kKdAhead) {
      cp_async_wait<0>();
      __syncthreads();
      if (ci + 1 < nchunks) {
        load_m(chunk + 1, buf ^ 1);
        load_kd(chunk + 1, buf ^ 1);
      }
      cp_async_commit();
    } else if constexpr (kMAhead) {
      // this chunk's Kd into the single buffer (free since the previous chunk's last barrier);
      // wait for everything older (W / Qt / U and M of this chunk)
      load_kd(chunk, 0);
      cp_async_commit();
      cp_async_wait<1>();
      __syncthreads();
      if (ci + 1 < nchunks) load_m(chunk + 1, buf ^ 1);
      cp_async_commit();  // possibly empty: keeps the group count the waits below assume
    } else {
      // RAW: this chunk's K, G and M (needed after the D step); W / Q / U of this chunk first
      load_kd(chunk, 0);
      load_m(chunk, 0);
      cp_async_commit();
      cp_async_wait<1>();
      __syncthreads();
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
    // exp(G_C) (with Kd) or, RAW, G of this chunk (with W / Q / U: waited for above)
    const float* gc = sGc + (RAW ? buf : kbuf) * K;
    [[maybe_unused]] float dk_f[2] = {1.f, 1.f};
    if constexpr (RAW) {
      const float glast = gc[C - 1];  // rows past the end repeat G of the last token
      dk_f[0] = fast_exp2(glast - gc[16 * warp + gr]);
      dk_f[1] = fast_exp2(glast - gc[16 * warp + gr + 8]);
    }
#pragma unroll
    for (int nt = 0; nt < BV / 8; ++nt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 16 * warp + gr + 8 * half, c = cg + 8 * nt + 2 * tq;
        const float2 u = unpack_bf16(*reinterpret_cast<const uint32_t*>(sU + r * LDS + c));
        const uint32_t d = pack_bf16(u.x - accD[nt][2 * half], u.y - accD[nt][2 * half + 1]);
        *reinterpret_cast<uint32_t*>(sD + r * LDS + c) = d;
        if constexpr (RAW) {  // Dk = 2^(G_C - G_r) D for the state update
          const float2 df = unpack_bf16(d);
          *reinterpret_cast<uint32_t*>(sDk + r * LDS + c) =
              pack_bf16(df.x * dk_f[half], df.y * dk_f[half]);
        }
        if (ws.D)  // backward
          *reinterpret_cast<uint32_t*>(ws.D + ((size_t(chunk) * x.HV + hv) * C + r) * V + col0 +
                                       c) = d;
      }
    }
    if constexpr (!kKdAhead) {
      if constexpr (kMAhead)
        cp_async_wait<1>();  // this chunk's Kd (M of the next may fly)
      else
        cp_async_wait<0>();  // RAW: this chunk's K, G and M
    }
    __syncthreads();
    if (ci + 1 < nchunks) load_wqu(chunk + 1, buf ^ 1);
    cp_async_commit();

    if constexpr (RAW) {  // P rows times scale 2^G_i
      const float e0 = x.scale * fast_exp2(gc[16 * warp + gr]);
      const float e1 = x.scale * fast_exp2(gc[16 * warp + gr + 8]);
#pragma unroll
      for (int nt = 0; nt < BV / 8; ++nt) {
        accP[nt][0] *= e0, accP[nt][1] *= e0;
        accP[nt][2] *= e1, accP[nt][3] *= e1;
      }
    }

    // O = P + M D (M is lower triangular: k-steps up to the warp's own block)
    const bf16* m = sM + mbuf * C * LDM;
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
    const int64_t tok0 = chunk_tok0(chunk);
    const int len = chunk_len(chunk);
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
    walk_mma::update_state<MT, BV / 8, LDK, LDS, RAW>(S, sKd + kbuf * C * LDK, sDk, cg, gc, mrow0,
                                                      lane);
    __syncthreads();
  }

  if (x.ht) walk_mma::store_state_rows(x.ht + state_off, S, V, mrow0, lane);
}

template <int K, int V, int NT, bool RAW>
void launch(const ChunkTokens& x, const ChunkWorkspace& ws, int64_t num_seqs, cudaStream_t stream) {
  using L = StateLayout<K, NT, RAW>;
  static const bool configured = [] {
    check_cuda(cudaFuncSetAttribute(chunk_state_kernel<K, V, NT, RAW>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, int(L::total)),
               "chunk_state shared memory limit");
    // two blocks per SM need 2 x 106 KB (NT = 2) or 2 x 110 KB (NT = 1): all of L1 as smem
    check_cuda(cudaFuncSetAttribute(chunk_state_kernel<K, V, NT, RAW>,
                                    cudaFuncAttributePreferredSharedMemoryCarveout,
                                    int(cudaSharedmemCarveoutMaxShared)),
               "chunk_state shared memory carveout");
    return true;
  }();
  (void)configured;
  const dim3 grid(unsigned(V / (NT * BV)), unsigned(x.HV), unsigned(num_seqs));
  chunk_state_kernel<K, V, NT, RAW><<<grid, 128 * NT, L::total, stream>>>(x, ws);
  check_launch("chunk_state kernel");
}

template <int K, int V, bool RAW>
void launch_nt(const ChunkTokens& x, const ChunkWorkspace& ws, int64_t num_seqs,
               cudaStream_t stream) {
  if (chunk_state_wide(num_seqs, x.HV, V))
    launch<K, V, 2, RAW>(x, ws, num_seqs, stream);
  else
    launch<K, V, 1, RAW>(x, ws, num_seqs, stream);
}

template <bool RAW>
void launch_kv(const ChunkTokens& x, const ChunkWorkspace& ws, int64_t num_seqs, int K, int V,
               cudaStream_t stream) {
  if (K == 128 && V == 128) return launch_nt<128, 128, RAW>(x, ws, num_seqs, stream);
  if (K == 128 && V == 64) return launch_nt<128, 64, RAW>(x, ws, num_seqs, stream);
  if (K == 64 && V == 128) return launch_nt<64, 128, RAW>(x, ws, num_seqs, stream);
  return launch_nt<64, 64, RAW>(x, ws, num_seqs, stream);
}

}  // namespace

bool chunk_state_wide(int64_t num_seqs, int HV, int V) {
  // Two column tiles per block halve the L2 traffic of the shared tiles and, at 106 KB of
  // shared memory, two blocks still share an SM; one tile per block when two-tile blocks would
  // leave SMs idle (e.g. one long sequence: 64 blocks of 8 warps, against 128 of 4).
  // Kernel-lab knob: KDA_STATE_NT=1|2 forces the choice (timing only).
  if (const char* nt = std::getenv("KDA_STATE_NT")) return std::strcmp(nt, "2") == 0;
  return num_seqs * HV * (V / (2 * BV)) * 10 >= int64_t(device_sm_count()) * 9;
}

void launch_chunk_state(const ChunkTokens& x, const ChunkWorkspace& ws, int64_t num_seqs, int K,
                        int V, cudaStream_t stream) {
  if (chunk_state_uses_wgmma(num_seqs, x.HV, K, V))
    return launch_chunk_state_wgmma(x, ws, num_seqs, K, V, stream);
  require(!ws.m_in_state, "chunk_state: M formed in the walk needs the wgmma walk");
  if (const bool wide = chunk_state_wide(num_seqs, x.HV, V);
      !ws.raw_qk && chunk_state_split_on() && (!wide || chunk_state_split_wide(num_seqs, x.HV, V)))
    return launch_chunk_state_split(x, ws, num_seqs, K, V, wide, stream);
  require(!ws.qt_in_state, "chunk_state: q rows scaled in the walk need the split walk");
  if (ws.raw_qk)
    launch_kv<true>(x, ws, num_seqs, K, V, stream);
  else
    launch_kv<false>(x, ws, num_seqs, K, V, stream);
}

}  // namespace kda::ops::cuda_detail
