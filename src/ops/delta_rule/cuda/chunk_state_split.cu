// chunk_state_split: chunk_state's walk (one block per (sequence, value head, NT x 32 state
// columns)) with the output taken off the state chain. With one long sequence the one-role walk
// has one warp per SM sub-partition, so every latency of its chain is exposed, and a third of
// each chunk's products (P = Qt S0, O = P + M D) do not feed the next chunk. Two roles:
//   chain warps 0-3:   D = U - W S0 (chunk rows 16w..), S = diag(exp(G_C)) S0 + Kd^T D (state
//                      rows w K / 4 ..), with S in fp32 registers; W, U, Kd and exp(G_C) are
//                      theirs;
//   output warps 4-7:  O = Qt S0 + M D (chunk rows 16w..), a chunk behind at most; Qt and M are
//                      theirs.
// S0 (bf16) and D pass between the roles in buffers of the chunk's parity: the chain fills
// parity p and arrives at ready[p]; the output warps wait there, read, and arrive at done[p],
// which the chain waits at before it fills p again two chunks later. Each role's own tiles come
// by cp.async one chunk ahead (double buffered).
// Plain operands only: Gated DeltaNet's raw q / k path (chunk_state.cu's RAW) measured slower
// here (2 x 8192: 0.746 against 0.696 ms; the walk 2.28 against 2.0 ms at 1 x 65536), and so did
// forming its M on the output warps (session 22: they became the bottleneck).
// QROWS (Gated DeltaNet, ws.qt_in_state; session 23: 2 x 8192 -5 %, 1 x 65536 -6 %): the
// output warps read the q rows and G instead of Qt and scale P = q S0's rows by scale 2^G_i (a
// multiply an element, off the chain); the chain decays by 2^G_C from G. chunk_prepare then
// writes no Qt.
#include <cstdlib>

#include "ops/delta_rule/cuda/chunk_kernels.cuh"
#include "ops/delta_rule/cuda/chunk_walk_mma.cuh"
#include "ops/delta_rule/cuda/device_common.cuh"

namespace kda::ops::cuda_detail {
namespace {

using bf16 = __nv_bfloat16;
constexpr int C = kChunk;
constexpr int kRoleThreads = 128;
// named barrier ids: within a role, and the parity-indexed hand-offs between the roles
constexpr int kBarChain = 1, kBarOutput = 2, kBarReady = 3 /* 3, 4 */, kBarDone = 5 /* 5, 6 */;

template <int K, int NT, bool QROWS = false>
struct SplitLayout {
  static constexpr int BC = NT * kStateTile;  // state columns per block
  static constexpr int LDK = K + 8, LDM = C + 8, LDS = BC + 8;
  static constexpr size_t bytes_k = size_t(C) * LDK * 2, bytes_m = size_t(C) * LDM * 2;
  static constexpr size_t bytes_d = size_t(C) * LDS * 2, bytes_s = size_t(K) * LDS * 2;
  // the chain's: W, U, Kd and exp(G_C), two each
  static constexpr size_t off_w = 0;
  static constexpr size_t off_u = off_w + 2 * bytes_k;
  static constexpr size_t off_kd = off_u + 2 * bytes_d;
  static constexpr size_t off_gc = off_kd + 2 * bytes_k;
  // handed over, by parity: S0 (bf16) and D
  static constexpr size_t off_s = off_gc + 2 * size_t(K) * 4;
  static constexpr size_t off_d = off_s + 2 * bytes_s;
  // the output warps': Qt and M, two each
  static constexpr size_t off_q = off_d + 2 * bytes_d;
  static constexpr size_t off_m = off_q + 2 * bytes_k;
  // QROWS: G of the chunk's rows, the output warps' own copy, two
  static constexpr size_t off_gq = off_m + 2 * bytes_m;
  static constexpr size_t total = off_gq + (QROWS ? 2 * size_t(C) * 4 : 0);
  static_assert(total <= 227 * 1024, "one block an SM: at most 227 KB of shared memory");
};

template <int K, int V, int NT, bool QROWS>
__device__ __forceinline__ void walk_chain(const ChunkTokens& x, const ChunkWorkspace& ws,
                                           unsigned char* smem, const WalkedChunks& walk, int hv,
                                           int64_t n, int col0) {
  using L = SplitLayout<K, NT, QROWS>;
  constexpr int BC = L::BC;
  constexpr int LDK = L::LDK, LDS = L::LDS;
  constexpr int MT = K / 64;  // 16-row state tiles per warp
  bf16* sW = reinterpret_cast<bf16*>(smem + L::off_w);
  bf16* sU = reinterpret_cast<bf16*>(smem + L::off_u);
  bf16* sKd = reinterpret_cast<bf16*>(smem + L::off_kd);
  float* sGc = reinterpret_cast<float*>(smem + L::off_gc);
  bf16* sS = reinterpret_cast<bf16*>(smem + L::off_s);
  bf16* sD = reinterpret_cast<bf16*>(smem + L::off_d);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gr = lane >> 2, tq = lane & 3;
  const int mrow0 = warp * (K / 4);

  auto load_wu = [&](int64_t chunk, int buf) {
    const size_t base = (size_t(chunk) * x.HV + hv) * C;
    walk_mma::copy_rows<K, LDK, kRoleThreads>(sW + buf * C * LDK, ws.W + base * K, K, C, tid);
    walk_mma::copy_rows<BC, LDS, kRoleThreads>(sU + buf * C * LDS, ws.U + base * V + col0, V, C,
                                               tid);
  };
  auto load_kd = [&](int64_t chunk, int buf) {
    const size_t base = (size_t(chunk) * x.HV + hv) * C;
    walk_mma::copy_rows<K, LDK, kRoleThreads>(sKd + buf * C * LDK, ws.Kd + base * K, K, C, tid);
    const float* gsrc = ws.gC + (size_t(chunk) * x.HV + hv) * K;
    for (int idx = tid; idx < K / 4; idx += kRoleThreads)
      cp_async16(sGc + buf * K + idx * 4, gsrc + idx * 4);
  };

  float S[MT][BC / 8][4];
  const size_t state_off = (size_t(n) * x.HV + hv) * size_t(K) * V + col0;
  walk_mma::load_state_rows(S, x.h0 ? x.h0 + state_off : nullptr, V, mrow0, lane);

  const int64_t chunk0 = walk.first, nchunks = walk.count;
  if (nchunks > 0) {
    load_wu(chunk0, 0);
    load_kd(chunk0, 0);
  }
  cp_async_commit();

  for (int64_t ci = 0; ci < nchunks; ++ci) {
    const int buf = int(ci & 1);
    const int64_t chunk = chunk0 + ci;
    // S0 and D of this parity are free once the output warps are done with chunk ci - 2
    if (ci >= 2) named_barrier_sync(kBarDone + buf, 2 * kRoleThreads);
    bf16* s0 = sS + buf * K * LDS;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < BC / 8; ++nt) {
        const int r = mrow0 + 16 * mt + gr, c = 8 * nt + 2 * tq;
        const uint32_t lo = pack_bf16(S[mt][nt][0], S[mt][nt][1]);
        const uint32_t hi = pack_bf16(S[mt][nt][2], S[mt][nt][3]);
        *reinterpret_cast<uint32_t*>(s0 + r * LDS + c) = lo;
        *reinterpret_cast<uint32_t*>(s0 + (r + 8) * LDS + c) = hi;
        if (ws.S0) {  // backward: the state entering the chunk, as the products saw it
          bf16* dst = ws.S0 + ((size_t(chunk) * x.HV + hv) * K + r) * V + col0 + c;
          *reinterpret_cast<uint32_t*>(dst) = lo;
          *reinterpret_cast<uint32_t*>(dst + 8 * V) = hi;
        }
      }
    cp_async_wait<0>();  // W, U, Kd, exp(G_C) of this chunk
    named_barrier_sync(kBarChain, kRoleThreads);
    if (ci + 1 < nchunks) {
      load_kd(chunk + 1, buf ^ 1);
      load_wu(chunk + 1, buf ^ 1);
    }
    cp_async_commit();

    // D = U - W S0 for chunk rows 16w..16w+15
    float accD[BC / 8][4] = {};
    const bf16* w = sW + buf * C * LDK;
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
      uint32_t aw[4];
      load_a(aw, w, LDK, 16 * warp, 16 * kk, lane);
#pragma unroll
      for (int np = 0; np < BC / 16; ++np) {
        uint32_t b[4];
        load_b_kn(b, s0, LDS, 16 * kk, 16 * np, lane);
        mma_bf16(accD[2 * np], aw, b[0], b[1]);
        mma_bf16(accD[2 * np + 1], aw, b[2], b[3]);
      }
    }
    bf16* d = sD + buf * C * LDS;
    const bf16* u = sU + buf * C * LDS;
    const float* gc = sGc + buf * K;  // exp(G_C) (QROWS: G of the chunk's rows)
#pragma unroll
    for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 16 * warp + gr + 8 * half, c = 8 * nt + 2 * tq;
        const float2 uu = unpack_bf16(*reinterpret_cast<const uint32_t*>(u + r * LDS + c));
        const uint32_t dd = pack_bf16(uu.x - accD[nt][2 * half], uu.y - accD[nt][2 * half + 1]);
        *reinterpret_cast<uint32_t*>(d + r * LDS + c) = dd;
        if (ws.D)  // backward
          *reinterpret_cast<uint32_t*>(ws.D + ((size_t(chunk) * x.HV + hv) * C + r) * V + col0 +
                                       c) = dd;
      }
    named_barrier_sync(kBarChain, kRoleThreads);  // D complete; W and U consumed
    named_barrier_arrive(kBarReady + buf, 2 * kRoleThreads);

    // S = diag(exp(G_C)) S0 + Kd^T D (QROWS: the scalar decay 2^G_C from G of the last row)
    walk_mma::update_state<MT, BC / 8, LDK, LDS, QROWS>(S, sKd + buf * C * LDK, d, 0, gc, mrow0,
                                                        lane);
  }
  // the output warps' last two arrivals at done[]
  for (int64_t ci = nchunks >= 2 ? nchunks - 2 : 0; ci < nchunks; ++ci)
    named_barrier_sync(kBarDone + int(ci & 1), 2 * kRoleThreads);

  if (x.ht) walk_mma::store_state_rows(x.ht + state_off, S, V, mrow0, lane);
}

template <int K, int V, int NT, bool QROWS>
__device__ __forceinline__ void walk_output(const ChunkTokens& x, const ChunkWorkspace& ws,
                                            unsigned char* smem, const WalkedChunks& walk, int hv,
                                            int col0) {
  using L = SplitLayout<K, NT, QROWS>;
  constexpr int BC = L::BC;
  constexpr int LDK = L::LDK, LDM = L::LDM, LDS = L::LDS;
  const bf16* sS = reinterpret_cast<const bf16*>(smem + L::off_s);
  const bf16* sD = reinterpret_cast<const bf16*>(smem + L::off_d);
  bf16* sQ = reinterpret_cast<bf16*>(smem + L::off_q);
  bf16* sM = reinterpret_cast<bf16*>(smem + L::off_m);
  [[maybe_unused]] float* sGq = reinterpret_cast<float*>(smem + L::off_gq);
  const int tid = threadIdx.x - kRoleThreads, lane = tid & 31, warp = tid >> 5;
  const int gr = lane >> 2, tq = lane & 3;
  const bool with_o = x.o != nullptr;  // the backward's recompute needs no output

  auto load_qm = [&](int64_t chunk, int buf) {
    const size_t base = (size_t(chunk) * x.HV + hv) * C;
    if constexpr (QROWS) {
      walk_mma::load_raw_rows<K, LDK, kRoleThreads>(sQ + buf * C * LDK, x.q, walk, chunk, x.H,
                                                    hv / (x.HV / x.H), tid);
      const float* gsrc = ws.gC + (size_t(chunk) * x.HV + hv) * K;
      for (int idx = tid; idx < C / 4; idx += kRoleThreads)
        cp_async16(sGq + buf * C + idx * 4, gsrc + idx * 4);
    } else {
      walk_mma::copy_rows<K, LDK, kRoleThreads>(sQ + buf * C * LDK, ws.Qt + base * K, K, C, tid);
    }
    walk_mma::copy_rows<C, LDM, kRoleThreads>(sM + buf * C * LDM, ws.M + base * C, C, C, tid);
  };

  const int64_t chunk0 = walk.first, nchunks = walk.count;
  if (nchunks > 0 && with_o) load_qm(chunk0, 0);
  cp_async_commit();

  for (int64_t ci = 0; ci < nchunks; ++ci) {
    const int buf = int(ci & 1);
    const int64_t chunk = chunk0 + ci;
    cp_async_wait<0>();  // Qt, M of this chunk
    named_barrier_sync(kBarOutput, kRoleThreads);
    if (ci + 1 < nchunks && with_o) load_qm(chunk + 1, buf ^ 1);
    cp_async_commit();
    named_barrier_sync(kBarReady + buf, 2 * kRoleThreads);  // S0 and D of this chunk

    float accP[BC / 8][4] = {};
    if (with_o) {
      const bf16* s0 = sS + buf * K * LDS;
      const bf16* d = sD + buf * C * LDS;
      const bf16* q = sQ + buf * C * LDK;
      const bf16* m = sM + buf * C * LDM;
#pragma unroll
      for (int kk = 0; kk < K / 16; ++kk) {
        uint32_t aq[4];
        load_a(aq, q, LDK, 16 * warp, 16 * kk, lane);
#pragma unroll
        for (int np = 0; np < BC / 16; ++np) {
          uint32_t b[4];
          load_b_kn(b, s0, LDS, 16 * kk, 16 * np, lane);
          mma_bf16(accP[2 * np], aq, b[0], b[1]);
          mma_bf16(accP[2 * np + 1], aq, b[2], b[3]);
        }
      }
      if constexpr (QROWS) {  // P's rows by scale 2^G_i (q as loaded)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const float f = x.scale * fast_exp2(sGq[buf * C + 16 * warp + gr + 8 * half]);
#pragma unroll
          for (int nt = 0; nt < BC / 8; ++nt) {
            accP[nt][2 * half] *= f;
            accP[nt][2 * half + 1] *= f;
          }
        }
      }
      // M is lower triangular: k-steps up to the warp's own block
      for (int J = 0; J <= warp; ++J) {
        uint32_t a[4];
        load_a(a, m, LDM, 16 * warp, 16 * J, lane);
#pragma unroll
        for (int np = 0; np < BC / 16; ++np) {
          uint32_t b[4];
          load_b_kn(b, d, LDS, 16 * J, 16 * np, lane);
          mma_bf16(accP[2 * np], a, b[0], b[1]);
          mma_bf16(accP[2 * np + 1], a, b[2], b[3]);
        }
      }
    }
    named_barrier_arrive(kBarDone + buf, 2 * kRoleThreads);  // S0 and D of this parity read

    if (with_o) {
      const int64_t tok0 = walk.tok0(chunk);
      const int len = walk.len(chunk);
#pragma unroll
      for (int nt = 0; nt < BC / 8; ++nt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = 16 * warp + gr + 8 * half, c = col0 + 8 * nt + 2 * tq;
          if (r < len)
            *reinterpret_cast<uint32_t*>(x.o + (size_t(tok0 + r) * x.HV + hv) * V + c) =
                pack_bf16(accP[nt][2 * half], accP[nt][2 * half + 1]);
        }
    }
  }
}

template <int K, int V, int NT, bool QROWS>
__global__ void __launch_bounds__(2 * kRoleThreads, 1)
    chunk_state_split_kernel(const ChunkTokens x, const ChunkWorkspace ws) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int hv = blockIdx.y;
  const int64_t n = blockIdx.z;
  const int col0 = blockIdx.x * SplitLayout<K, NT>::BC;
  const WalkedChunks walk(ws, n);
  if (threadIdx.x < kRoleThreads)
    walk_chain<K, V, NT, QROWS>(x, ws, smem, walk, hv, n, col0);
  else
    walk_output<K, V, NT, QROWS>(x, ws, smem, walk, hv, col0);
}

template <int K, int V, int NT, bool QROWS>
void launch(const ChunkTokens& x, const ChunkWorkspace& ws, int64_t num_seqs, cudaStream_t stream) {
  using L = SplitLayout<K, NT, QROWS>;
  constexpr int BC = L::BC;
  const auto kernel = chunk_state_split_kernel<K, V, NT, QROWS>;
  static const bool configured = [&] {
    check_cuda(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(L::total)),
        "chunk_state_split shared memory limit");
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                    int(cudaSharedmemCarveoutMaxShared)),
               "chunk_state_split shared memory carveout");
    return true;
  }();
  (void)configured;
  const dim3 grid(unsigned(V / BC), unsigned(x.HV), unsigned(num_seqs));
  kernel<<<grid, 2 * kRoleThreads, L::total, stream>>>(x, ws);
  check_launch("chunk_state_split kernel");
}

template <int NT, bool QROWS>
void launch_kv(const ChunkTokens& x, const ChunkWorkspace& ws, int64_t num_seqs, int K, int V,
               cudaStream_t stream) {
  if (K == 128 && V == 128) return launch<128, 128, NT, QROWS>(x, ws, num_seqs, stream);
  if (K == 128 && V == 64) return launch<128, 64, NT, QROWS>(x, ws, num_seqs, stream);
  if (K == 64 && V == 128) return launch<64, 128, NT, QROWS>(x, ws, num_seqs, stream);
  return launch<64, 64, NT, QROWS>(x, ws, num_seqs, stream);
}

}  // namespace

bool chunk_state_split_on() {
  // Kernel-lab knob: KDA_STATE_SPLIT=0 keeps the one-role walk of chunk_state.cu (timing only).
  static const bool on = [] {
    const char* knob = std::getenv("KDA_STATE_SPLIT");
    return !(knob && knob[0] == '0');
  }();
  return on;
}

bool chunk_state_split_wide(int64_t num_seqs, int HV, int V) {
  // Two tiles a block (64 columns, 193 KB of shared memory at K = V = 128: one block an SM) where
  // they fit in one wave: 2 x 8192, H = 32 (128 blocks): KDA forward 0.859 -> 0.785 ms, Gated
  // DeltaNet 0.724 -> 0.696 (2026-12-03, H200). Beyond one wave the one-role blocks of
  // chunk_state.cu, two an SM, keep them. Kernel-lab knob: KDA_STATE_SPLIT_WIDE=0 never.
  static const bool allowed = [] {
    const char* knob = std::getenv("KDA_STATE_SPLIT_WIDE");
    return !(knob && knob[0] == '0');
  }();
  return allowed && chunk_state_split_on() &&
         num_seqs * HV * (V / (2 * kStateTile)) <= int64_t(device_sm_count());
}

void launch_chunk_state_split(const ChunkTokens& x, const ChunkWorkspace& ws, int64_t num_seqs,
                              int K, int V, bool wide, cudaStream_t stream) {
  require(!ws.raw_qk, "chunk_state_split: plain operands only");
  if (ws.qt_in_state)  // QROWS (Gated DeltaNet: q rows, Kd and M from chunk_prepare, G in gC)
    return wide ? launch_kv<2, true>(x, ws, num_seqs, K, V, stream)
                : launch_kv<1, true>(x, ws, num_seqs, K, V, stream);
  if (wide)
    launch_kv<2, false>(x, ws, num_seqs, K, V, stream);
  else
    launch_kv<1, false>(x, ws, num_seqs, K, V, stream);
}

}  // namespace kda::ops::cuda_detail
