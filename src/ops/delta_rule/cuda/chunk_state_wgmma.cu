// chunk_state on Hopper's warpgroup tensor cores (sm_90a): the same walk as chunk_state.cu,
//   D = U - W S0,   P = Qt S0,   O = P + M D,   S = diag(exp(G_C)) S0 + Kd^T D,
// by one warpgroup (128 threads) per (sequence, value head, 64-column state tile). An m64 wgmma
// covers a whole chunk (C = 64 rows), so each product is one asynchronous chain of K / 16 or
// C / 16 k-steps instead of mma.sync fragments spread over warps and joined by barriers.
//
// Operand layouts are only those the attention kernels already use (and the wgmma probe checks):
// 128-byte-swizzled K-major tiles (wgmma.cuh) for both operands from shared memory, and register
// A fragments (the m16k16 mma.sync fragment of a warp's 16 rows).
//   W, Qt [C][K], M [C][C]:   A operands, K-major as stored (cp.async into swizzled tiles)
//   S0^T [64 cols][K]:        B of W S0 and Qt S0, written transposed from the fp32 state
//                             (stmatrix .trans) at the top of each chunk
//   D^T [64 cols][C]:         B of M D and Kd^T D, written transposed from the D accumulators
//   Kd^T:                     register A of the state update, ldmatrix .trans from Kd [C][K]
// S0^T and D^T share one region (S0^T is dead once W S0 and Qt S0 are done).
// Buffering: M and Kd (with exp(G_C)) double-buffered a chunk ahead; W, Qt and U refilled for the
// next chunk as soon as this chunk's D is formed. 106 KB of shared memory at K = V = 128, so two
// warpgroups share an SM.
// Gated DeltaNet (ws.raw_qk, RAW): Q and K are the inputs' q, k rows and G replaces exp(G_C), as in
// chunk_state.cu: P rows scaled by scale 2^G_i, the state update against Dk = 2^(G_C - G_j) D.
// With ws.m_in_state (FORM_M, RAW only) M = scale 2^(G_i - G_j) (Q K^T)_ij (j <= i) is formed here,
// a third product of phase 1 on the q / k tiles already held, and enters O += M D as register A
// fragments (the attention forward's P V): chunk_prepare then skips M, and no M tile is loaded.
// Backward recompute: S0 and D (bf16, as the products saw them) written when ws.S0 / ws.D are set.
//
// Taken by launch_chunk_state on compute capability 9 where the grid is at least two blocks per
// SM (chunk_state_uses_wgmma below, measured there); kda_gpu_check's checks run with it forced
// (KDA_STATE_WGMMA=1) as well, since their shapes are below that.
#include <cstdlib>
#include <cstring>

#include "ops/delta_rule/cuda/chunk_wgmma.cuh"

namespace kda::ops::cuda_detail {
namespace {

using bf16 = __nv_bfloat16;
using namespace walk_wgmma;
constexpr int C = kChunk;

template <int K, bool RAW>
struct WgmmaStateLayout {
  static constexpr uint32_t kKTiles = K / 64;           // 64-wide tiles across K
  static constexpr uint32_t bytes_k = kKTiles * kTile;  // a [C][K] operand (W, Qt, Kd)
  static constexpr uint32_t off_w = 0, off_q = bytes_k, off_u = 2 * bytes_k;
  static constexpr uint32_t off_m = off_u + kTile;       // 2 buffers
  static constexpr uint32_t off_kd = off_m + 2 * kTile;  // 2 buffers
  static constexpr uint32_t off_sd = off_kd + 2 * bytes_k;
  // S0^T (kKTiles tiles) or, later in the chunk, D^T (+ Dk^T for RAW)
  static constexpr uint32_t bytes_sd = bytes_k > (RAW ? 2 : 1) * kTile ? bytes_k
                                                                       : (RAW ? 2 : 1) * kTile;
  static constexpr uint32_t off_dk = off_sd + kTile;     // RAW: Dk^T beside D^T
  static constexpr uint32_t off_gc = off_sd + bytes_sd;  // 2 x K floats
  static constexpr uint32_t total = off_gc + 2 * K * 4;
  static constexpr size_t launch_bytes = total + 1024;  // + the 1024-byte alignment of the base
};

template <int K, int V, bool RAW, bool FORM_M>
__global__ void __launch_bounds__(kThreads, 2)
    chunk_state_wgmma_kernel(const ChunkTokens x, const ChunkWorkspace ws) {
#ifdef KDA_WGMMA
  static_assert(RAW || !FORM_M, "M is formed in the walk on the raw path only");
  using L = WgmmaStateLayout<K, RAW>;
  constexpr int MT = K / 64;  // m64 tiles of the state
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  unsigned char* sW = smem + L::off_w;
  unsigned char* sQ = smem + L::off_q;
  unsigned char* sU = smem + L::off_u;
  unsigned char* sM = smem + L::off_m;
  unsigned char* sKd = smem + L::off_kd;
  unsigned char* sS0T = smem + L::off_sd;
  unsigned char* sDT = smem + L::off_sd;
  unsigned char* sDkT = RAW ? smem + L::off_dk : sDT;
  float* sGc = reinterpret_cast<float*>(smem + L::off_gc);

  const int vt = blockIdx.x, hv = blockIdx.y;
  const int64_t n = blockIdx.z;
  const int h = hv / (x.HV / x.H);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const WalkedChunks walk(ws, n);
  const int64_t chunk0 = walk.first, nchunks = walk.count;
  auto chunk_tok0 = [&](int64_t chunk) { return walk.tok0(chunk); };
  auto chunk_len = [&](int64_t chunk) { return walk.len(chunk); };
  const int col0 = vt * kCols;

  // W, Qt (RAW: q rows, and G) and U of `chunk`; G into buffer `buf`
  auto load_wqu = [&](int64_t chunk, int buf) {
    const size_t base = (size_t(chunk) * x.HV + hv) * C;
    load_sw128<K>(sW, ws.W + base * K, K, C, tid);
    if constexpr (RAW) {
      const float* gsrc = ws.gC + (size_t(chunk) * x.HV + hv) * K;
      if (tid < C / 4) cp_async16(sGc + buf * K + tid * 4, gsrc + tid * 4);
      load_sw128<K>(sQ, x.q + (size_t(chunk_tok0(chunk)) * x.H + h) * K, int64_t(x.H) * K,
                    chunk_len(chunk), tid);
    } else {
      load_sw128<K>(sQ, ws.Qt + base * K, K, C, tid);
    }
    load_sw128<kCols>(sU, ws.U + base * V + col0, V, C, tid);
  };
  // M and Kd (RAW: k rows) of `chunk` into buffer `buf`, with exp(G_C) (not RAW)
  auto load_mkd = [&](int64_t chunk, int buf) {
    const size_t base = (size_t(chunk) * x.HV + hv) * C;
    if constexpr (!FORM_M) load_sw128<C>(sM + buf * kTile, ws.M + base * C, C, C, tid);
    unsigned char* kd = sKd + buf * L::bytes_k;
    if constexpr (RAW) {
      load_sw128<K>(kd, x.k + (size_t(chunk_tok0(chunk)) * x.H + h) * K, int64_t(x.H) * K,
                    chunk_len(chunk), tid);
    } else {
      load_sw128<K>(kd, ws.Kd + base * K, K, C, tid);
      const float* gsrc = ws.gC + (size_t(chunk) * x.HV + hv) * K;
      if (tid < K / 4) cp_async16(sGc + buf * K + tid * 4, gsrc + tid * 4);
    }
  };

  // The state (fp32, accumulator layout): S[mt][4 j + e] is row 64 mt + 16 warp + g + 8 (e >> 1),
  // column col0 + 8 j + 2 t + (e & 1).
  float S[MT][32];
  const size_t state_off = (size_t(n) * x.HV + hv) * size_t(K) * V + col0;
  load_state_tile(S, x.h0 ? x.h0 + state_off : nullptr, V, warp, lane);

  if (nchunks > 0) {
    load_wqu(chunk0, 0);
    load_mkd(chunk0, 0);
  }
  cp_async_commit();

  for (int64_t ci = 0; ci < nchunks; ++ci) {
    const int buf = int(ci & 1);
    const int64_t chunk = chunk0 + ci;
    const size_t head_chunk = size_t(chunk) * x.HV + hv;

    // S0^T (bf16) for this chunk's products; the backward keeps S0 as they see it
    store_state_bf16(sS0T, ws.S0 ? ws.S0 + head_chunk * K * V + col0 : nullptr, V, S, warp, lane);
    cp_async_wait<0>();  // W / Qt / U and M / Kd of this chunk
    fence_proxy_async();
    __syncthreads();
    if (ci + 1 < nchunks) load_mkd(chunk + 1, buf ^ 1);
    cp_async_commit();

    // D = W S0, P = Qt S0 (64 chunk rows x 64 columns each); FORM_M: Q K^T (64 x 64) too
    float accD[32], accP[32];
    [[maybe_unused]] float accM[FORM_M ? 32 : 1];
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < K / 16; ++ks) {
      const uint32_t off = (ks >> 2) * kTile + (ks & 3) * 32;
      wgmma_m64n64k16_ss(accD, sw128_desc(sW + off), sw128_desc(sS0T + off), ks > 0);
    }
#pragma unroll
    for (int ks = 0; ks < K / 16; ++ks) {
      const uint32_t off = (ks >> 2) * kTile + (ks & 3) * 32;
      wgmma_m64n64k16_ss(accP, sw128_desc(sQ + off), sw128_desc(sS0T + off), ks > 0);
    }
    wgmma_commit();
    if constexpr (FORM_M) {  // its own group: Q K^T runs on while D is formed below
      const unsigned char* k_tile = sKd + buf * L::bytes_k;  // RAW: the k rows
#pragma unroll
      for (int ks = 0; ks < K / 16; ++ks) {
        const uint32_t off = (ks >> 2) * kTile + (ks & 3) * 32;
        wgmma_m64n64k16_ss(accM, sw128_desc(sQ + off), sw128_desc(k_tile + off), ks > 0);
      }
      wgmma_commit();
      wgmma_wait<1>();  // D and P
    } else {
      wgmma_wait<0>();
    }
    fence_operands(accD);
    fence_operands(accP);
    __syncthreads();  // every warp past the products before S0^T's space takes D^T

    // D = U - W S0 (bf16) -> D^T; RAW: Dk = 2^(G_C - G_r) D -> Dk^T and P rows times scale 2^G_r
    const float* gc = sGc + buf * K;
    [[maybe_unused]] float dk_f[2] = {1.f, 1.f}, p_f[2] = {1.f, 1.f};
    if constexpr (RAW) {
      const float glast = gc[C - 1];  // rows past the end repeat G of the last token
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float gr = gc[16 * warp + g + 8 * half];
        dk_f[half] = fast_exp2(glast - gr);
        p_f[half] = x.scale * fast_exp2(gr);
      }
    }
    {
      uint32_t dpairs[8][2];
      [[maybe_unused]] uint32_t dkpairs[8][2];
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = 16 * warp + g + 8 * half, c = 8 * j + 2 * t;
          const float2 u = unpack_bf16(*reinterpret_cast<const uint32_t*>(sU + sw128_offset(r, c)));
          const uint32_t d =
              pack_bf16(u.x - accD[4 * j + 2 * half], u.y - accD[4 * j + 2 * half + 1]);
          dpairs[j][half] = d;
          if (ws.D)  // backward
            *reinterpret_cast<uint32_t*>(ws.D + (head_chunk * C + r) * V + col0 + c) = d;
          if constexpr (RAW) {
            const float2 df = unpack_bf16(d);
            dkpairs[j][half] = pack_bf16(df.x * dk_f[half], df.y * dk_f[half]);
            accP[4 * j + 2 * half] *= p_f[half];
            accP[4 * j + 2 * half + 1] *= p_f[half];
          }
        }
      store_transposed(sDT, dpairs, warp, lane);
      if constexpr (RAW) store_transposed(sDkT, dkpairs, warp, lane);
    }
    // FORM_M: M (rows i = 16 warp + g (+ 8), columns j) masked and decayed, as register A
    // fragments of O += M D: afm[J] covers columns 16 J .. 16 J + 15
    [[maybe_unused]] uint32_t afm[FORM_M ? C / 16 : 1][4];
    if constexpr (FORM_M) {
      wgmma_wait<0>();  // Q K^T (before the barrier below: sQ is refilled after it)
      fence_operands(accM);
      float gi[2];
#pragma unroll
      for (int half = 0; half < 2; ++half) gi[half] = gc[16 * warp + g + 8 * half];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int col = 8 * j + 2 * t;
        const float gj0 = gc[col], gj1 = gc[col + 1];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int row = 16 * warp + g + 8 * half;
          float& m0 = accM[4 * j + 2 * half];
          float& m1 = accM[4 * j + 2 * half + 1];
          m0 = col <= row ? x.scale * fast_exp2(gi[half] - gj0) * m0 : 0.f;
          m1 = col + 1 <= row ? x.scale * fast_exp2(gi[half] - gj1) * m1 : 0.f;
        }
      }
#pragma unroll
      for (int J = 0; J < C / 16; ++J)
#pragma unroll
        for (int i = 0; i < 4; ++i)
          afm[J][i] = pack_bf16(accM[8 * J + 2 * i], accM[8 * J + 2 * i + 1]);
    }
    fence_proxy_async();
    __syncthreads();  // D^T complete; W / Qt / U of this chunk consumed
    if (ci + 1 < nchunks) load_wqu(chunk + 1, buf ^ 1);
    cp_async_commit();

    // S0 decayed in place, then S += Kd^T D and O = P + M D in one wgmma group
    const unsigned char* kd = sKd + buf * L::bytes_k;
    uint32_t akd[MT][C / 16][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int m0 = 64 * mt + 16 * warp;
      float ga, gb;
      if constexpr (RAW) {
        ga = gb = fast_exp2(gc[C - 1]);
      } else {
        ga = gc[m0 + g], gb = gc[m0 + g + 8];
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        S[mt][4 * j] *= ga, S[mt][4 * j + 1] *= ga;
        S[mt][4 * j + 2] *= gb, S[mt][4 * j + 3] *= gb;
      }
#pragma unroll
      for (int J = 0; J < C / 16; ++J) load_a_trans_sw128(akd[mt][J], kd, m0, 16 * J, lane);
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      fence_operands(S[mt]);
      fence_operands(akd[mt]);
    }
    fence_operands(accP);
    if constexpr (FORM_M) fence_operands(afm);
    wgmma_fence();
    if constexpr (FORM_M) {
#pragma unroll
      for (int J = 0; J < C / 16; ++J) wgmma_m64n64k16_rs(accP, afm[J], sw128_desc(sDT + J * 32));
    } else {
      const unsigned char* m = sM + buf * kTile;
#pragma unroll
      for (int J = 0; J < C / 16; ++J)
        wgmma_m64n64k16_ss(accP, sw128_desc(m + J * 32), sw128_desc(sDT + J * 32), 1);
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int J = 0; J < C / 16; ++J)
        wgmma_m64n64k16_rs(S[mt], akd[mt][J], sw128_desc(sDkT + J * 32));
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(accP);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) fence_operands(S[mt]);

    if (x.o) {
      const int64_t tok0 = chunk_tok0(chunk);
      const int len = chunk_len(chunk);
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = 16 * warp + g + 8 * half;
          if (r < len)
            *reinterpret_cast<uint32_t*>(x.o + (size_t(tok0 + r) * x.HV + hv) * V + col0 + 8 * j +
                                         2 * t) =
                pack_bf16(accP[4 * j + 2 * half], accP[4 * j + 2 * half + 1]);
        }
    }
    __syncthreads();  // D^T read by every warp's products before the next S0^T overwrites it
  }

  if (x.ht) store_state_tile(x.ht + state_off, S, V, warp, lane);
#else
  __trap();
#endif
}

template <int K, int V, bool RAW, bool FORM_M>
void launch(const ChunkTokens& x, const ChunkWorkspace& ws, int64_t num_seqs, cudaStream_t stream) {
  using L = WgmmaStateLayout<K, RAW>;
  const auto kernel = chunk_state_wgmma_kernel<K, V, RAW, FORM_M>;
  static const bool configured = [&] {
    configure_walk_kernel(kernel, L::launch_bytes, "chunk_state_wgmma shared memory");
    return true;
  }();
  (void)configured;
  const dim3 grid(unsigned(V / kCols), unsigned(x.HV), unsigned(num_seqs));
  kernel<<<grid, kThreads, L::launch_bytes, stream>>>(x, ws);
  check_launch("chunk_state_wgmma kernel");
}

template <bool RAW, bool FORM_M = false>
void launch_kv(const ChunkTokens& x, const ChunkWorkspace& ws, int64_t num_seqs, int K, int V,
               cudaStream_t stream) {
  if (K == 128 && V == 128) return launch<128, 128, RAW, FORM_M>(x, ws, num_seqs, stream);
  if (K == 128 && V == 64) return launch<128, 64, RAW, FORM_M>(x, ws, num_seqs, stream);
  if (K == 64 && V == 128) return launch<64, 128, RAW, FORM_M>(x, ws, num_seqs, stream);
  return launch<64, 64, RAW, FORM_M>(x, ws, num_seqs, stream);
}

}  // namespace

bool chunk_state_uses_wgmma(int64_t num_seqs, int HV, int K, int V) {
  if (!((K == 64 || K == 128) && (V == 64 || V == 128) && device_cc_major() == 9)) return false;
  // Kernel-lab knob: KDA_STATE_WGMMA=1 always, =0 never (timing only).
  static const int forced = [] {
    const char* knob = std::getenv("KDA_STATE_WGMMA");
    return knob ? (std::strcmp(knob, "1") == 0 ? 1 : 0) : -1;
  }();
  if (forced >= 0) return forced == 1;
  // One warpgroup per 64 columns wins where the grid fills the chip twice (8 x 2048, H = 32:
  // 512 blocks, state 0.347 -> 0.300 ms) and loses where a few blocks each walk a long chain
  // (2 x 8192: 128 blocks, 0.418 -> 0.442 ms; 1 x 65536: 64 blocks, 2.23 -> 3.19 ms): its
  // chunk step is longer than the mma.sync walk's (2026-12-02, H200).
  return num_seqs * HV * (V / kCols) >= 2 * int64_t(device_sm_count());
}

void launch_chunk_state_wgmma(const ChunkTokens& x, const ChunkWorkspace& ws, int64_t num_seqs,
                              int K, int V, cudaStream_t stream) {
  if (ws.raw_qk && ws.m_in_state)
    launch_kv<true, true>(x, ws, num_seqs, K, V, stream);
  else if (ws.raw_qk)
    launch_kv<true>(x, ws, num_seqs, K, V, stream);
  else
    launch_kv<false>(x, ws, num_seqs, K, V, stream);
}

}  // namespace kda::ops::cuda_detail
