// chunk_state_bwd on Hopper's warpgroup tensor cores (sm_90a): the same reverse walk as
// chunk_state_bwd.cu, carrying dS (the gradient of the state leaving the chunk, fp32),
//   dD = Kd dS + M^T dO,   dS <- diag(exp(G_C)) dS + Qt^T dO - W^T dD,
// by one warpgroup (128 threads) per (sequence, value head, 64 state columns), with the operand
// forms of chunk_state_wgmma.cu (the ones the attention kernels verify on the H200):
//   Kd [C][K]:              A of Kd dS, K-major as stored (cp.async into swizzled tiles)
//   dS^T [64 cols][K]:      B of Kd dS, written transposed from the fp32 dS (stmatrix .trans)
//   M^T, Qt^T, W^T:         register A fragments (ldmatrix .trans of M, Qt, W as stored)
//   dO^T [64 cols][C]:      B of M^T dO and Qt^T dO: dO's tile turned around once a chunk
//                           (ldmatrix, then stmatrix .trans)
//   -dD^T [64 cols][C]:     B of -W^T dD, written from the dD accumulators (it takes dS^T's
//                           space: dS^T is dead once Kd dS is done)
// M and Qt carry the output scale, so dO enters unscaled. Writes dS (bf16, as the products saw
// it) and dD for every chunk, dh0 after the first. Loads: M, Kd and dO of the chunk before are
// fetched once this chunk's dD is formed; Qt, W and exp(G_C) once its dS update is done (each is
// waited for only where it is used). 90 KB of shared memory at K = V = 128: two blocks per SM.
//
// Taken by launch_chunk_state_bwd on compute capability 9 where the grid has at least 3/4 of a
// block per SM (chunk_state_bwd_uses_wgmma, measured there); kda_gpu_check's backward checks run
// with it forced (KDA_STATE_BWD_WGMMA=1) as well, since their shapes are below that.
#include <cstdlib>
#include <cstring>

#include "ops/delta_rule/cuda/chunk_wgmma.cuh"

namespace kda::ops::cuda_detail {
namespace {

using bf16 = __nv_bfloat16;
using namespace walk_wgmma;
constexpr int C = kChunk;

template <int K>
struct WgmmaStateBwdLayout {
  static constexpr uint32_t bytes_k = (K / 64) * kTile;  // a [C][K] operand, or dS^T
  static constexpr uint32_t off_w = 0, off_q = bytes_k, off_kd = 2 * bytes_k;
  static constexpr uint32_t off_m = 3 * bytes_k, off_do = off_m + kTile, off_dot = off_do + kTile;
  static constexpr uint32_t off_ds = off_dot + kTile;   // dS^T, then -dD^T (one tile)
  static constexpr uint32_t off_gc = off_ds + bytes_k;  // K floats
  static constexpr uint32_t total = off_gc + K * 4;
  static constexpr size_t launch_bytes = total + 1024;  // + the 1024-byte alignment of the base
};

template <int K, int V>
__global__ void __launch_bounds__(kThreads, 2)
    chunk_state_bwd_wgmma_kernel(const ChunkTokens x, const ChunkWorkspace ws,
                                 const ChunkGrads gd) {
#ifdef KDA_WGMMA
  using L = WgmmaStateBwdLayout<K>;
  constexpr int MT = K / 64;  // m64 tiles of the state
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  unsigned char* sW = smem + L::off_w;
  unsigned char* sQ = smem + L::off_q;
  unsigned char* sKd = smem + L::off_kd;
  unsigned char* sM = smem + L::off_m;
  unsigned char* sO = smem + L::off_do;
  unsigned char* sOT = smem + L::off_dot;
  unsigned char* sST = smem + L::off_ds;  // dS^T (phase 1), then -dD^T (phase 2)
  unsigned char* sNDT = sST;
  float* sGc = reinterpret_cast<float*>(smem + L::off_gc);

  const int vt = blockIdx.x, hv = blockIdx.y;
  const int64_t n = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const WalkedChunks walk(ws, n);
  const int64_t chunk0 = walk.first, nchunks = walk.count;
  const int col0 = vt * kCols;

  // Qt, W and exp(G_C) of `chunk` (used by the dS update)
  auto load_qwg = [&](int64_t chunk) {
    const size_t base = (size_t(chunk) * x.HV + hv) * C;
    load_sw128<K>(sW, ws.W + base * K, K, C, tid);
    load_sw128<K>(sQ, ws.Qt + base * K, K, C, tid);
    const float* gsrc = ws.gC + (size_t(chunk) * x.HV + hv) * K;
    if (tid < K / 4) cp_async16(sGc + tid * 4, gsrc + tid * 4);
  };
  // M, Kd and dO of `chunk` (used by dD; dO again, transposed, by the dS update)
  auto load_mkdo = [&](int64_t chunk) {
    const size_t base = (size_t(chunk) * x.HV + hv) * C;
    load_sw128<C>(sM, ws.M + base * C, C, C, tid);
    load_sw128<K>(sKd, ws.Kd + base * K, K, C, tid);
    load_sw128<kCols>(sO, gd.dO + size_t(walk.tok0(chunk)) * x.HV * V + size_t(hv) * V + col0,
                      int64_t(x.HV) * V, walk.len(chunk), tid);
  };

  // dS (fp32, accumulator layout): dS[mt][4 j + e] is row 64 mt + 16 warp + g + 8 (e >> 1),
  // column col0 + 8 j + 2 t + (e & 1)
  float dS[MT][32];
  const size_t state_off = (size_t(n) * x.HV + hv) * size_t(K) * V + col0;
  load_state_tile(dS, gd.dht ? gd.dht + state_off : nullptr, V, warp, lane);

  // two cp.async groups in flight at every wait below: {M, Kd, dO} then {Qt, W, exp(G_C)}
  if (nchunks > 0) load_mkdo(chunk0 + nchunks - 1);
  cp_async_commit();
  if (nchunks > 0) load_qwg(chunk0 + nchunks - 1);
  cp_async_commit();

  for (int64_t ci = nchunks - 1; ci >= 0; --ci) {
    const int64_t chunk = chunk0 + ci;
    const size_t chunk_head = size_t(chunk) * x.HV + hv;

    // dS leaving this chunk as bf16: dS^T for the products, dS for chunk_bwd_local
    store_state_bf16(sST, gd.dS + chunk_head * K * V + col0, V, dS, warp, lane);
    cp_async_wait<1>();  // M, Kd, dO of this chunk (Qt, W, exp(G_C) may still fly)
    __syncthreads();
    // dO^T: this warp's 16 chunk rows, four 16 x 16 blocks
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      uint32_t fr[4];
      const int r = 16 * warp + (lane & 7) + ((lane >> 3) & 1) * 8, c = 16 * kk + (lane >> 4) * 8;
      ldmatrix_x4(fr, sO + sw128_offset(r, c));
      store_fragment_transposed(sOT, fr, 16 * warp, 16 * kk, lane);
    }
    fence_proxy_async();
    __syncthreads();  // dS^T, dO^T and the cp.async'd Kd visible to wgmma

    // dD = Kd dS + M^T dO (64 chunk rows x 64 columns)
    uint32_t am[C / 16][4];
#pragma unroll
    for (int J = 0; J < C / 16; ++J) load_a_trans_sw128(am[J], sM, 16 * warp, 16 * J, lane);
    fence_operands(am);
    float accD[32];
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < K / 16; ++ks) {
      const uint32_t off = (ks >> 2) * kTile + (ks & 3) * 32;
      wgmma_m64n64k16_ss(accD, sw128_desc(sKd + off), sw128_desc(sST + off), ks > 0);
    }
#pragma unroll
    for (int J = 0; J < C / 16; ++J) wgmma_m64n64k16_rs(accD, am[J], sw128_desc(sOT + J * 32));
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(accD);
    __syncthreads();  // M, Kd, dO and dS^T read by every warp's products
    if (ci > 0) load_mkdo(chunk - 1);
    cp_async_commit();

    // dD (bf16) for chunk_bwd_local; -dD^T into dS^T's space for the dS update
    {
      uint32_t npairs[8][2];
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = 16 * warp + g + 8 * half, c = 8 * j + 2 * t;
          const float d0 = accD[4 * j + 2 * half], d1 = accD[4 * j + 2 * half + 1];
          *reinterpret_cast<uint32_t*>(gd.dD + (chunk_head * C + r) * V + col0 + c) =
              pack_bf16(d0, d1);
          npairs[j][half] = pack_bf16(-d0, -d1);
        }
      store_transposed(sNDT, npairs, warp, lane);
    }
    cp_async_wait<1>();  // Qt, W, exp(G_C) of this chunk (M, Kd, dO of the next may fly)
    fence_proxy_async();
    __syncthreads();  // -dD^T complete; Qt, W, exp(G_C) visible

    // dS <- diag(exp(G_C)) dS + Qt^T dO + W^T (-dD)
    uint32_t aq[MT][C / 16][4], aw[MT][C / 16][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int m0 = 64 * mt + 16 * warp;
      const float ga = sGc[m0 + g], gb = sGc[m0 + g + 8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        dS[mt][4 * j] *= ga, dS[mt][4 * j + 1] *= ga;
        dS[mt][4 * j + 2] *= gb, dS[mt][4 * j + 3] *= gb;
      }
#pragma unroll
      for (int J = 0; J < C / 16; ++J) {
        load_a_trans_sw128(aq[mt][J], sQ, m0, 16 * J, lane);
        load_a_trans_sw128(aw[mt][J], sW, m0, 16 * J, lane);
      }
      fence_operands(dS[mt]);
      fence_operands(aq[mt]);
      fence_operands(aw[mt]);
    }
    wgmma_fence();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int J = 0; J < C / 16; ++J) {
        wgmma_m64n64k16_rs(dS[mt], aq[mt][J], sw128_desc(sOT + J * 32));
        wgmma_m64n64k16_rs(dS[mt], aw[mt][J], sw128_desc(sNDT + J * 32));
      }
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) fence_operands(dS[mt]);
    __syncthreads();  // Qt, W, dO^T and -dD^T read by every warp before they are replaced
    if (ci > 0) load_qwg(chunk - 1);
    cp_async_commit();
  }

  if (gd.dh0) store_state_tile(gd.dh0 + state_off, dS, V, warp, lane);
#else
  __trap();
#endif
}

template <int K, int V>
void launch(const ChunkTokens& x, const ChunkWorkspace& ws, const ChunkGrads& gd, int64_t num_seqs,
            cudaStream_t stream) {
  using L = WgmmaStateBwdLayout<K>;
  const auto kernel = chunk_state_bwd_wgmma_kernel<K, V>;
  static const bool configured = [&] {
    configure_walk_kernel(kernel, L::launch_bytes, "chunk_state_bwd_wgmma shared memory");
    return true;
  }();
  (void)configured;
  const dim3 grid(unsigned(V / kCols), unsigned(x.HV), unsigned(num_seqs));
  kernel<<<grid, kThreads, L::launch_bytes, stream>>>(x, ws, gd);
  check_launch("chunk_state_bwd_wgmma kernel");
}

}  // namespace

bool chunk_state_bwd_uses_wgmma(int64_t num_seqs, int HV, int K, int V) {
  if (!((K == 64 || K == 128) && (V == 64 || V == 128) && device_cc_major() == 9)) return false;
  // Kernel-lab knob: KDA_STATE_BWD_WGMMA=1 always, =0 never (timing only).
  static const int forced = [] {
    const char* knob = std::getenv("KDA_STATE_BWD_WGMMA");
    return knob ? (std::strcmp(knob, "1") == 0 ? 1 : 0) : -1;
  }();
  if (forced >= 0) return forced == 1;
  // Measured (2026-12-02, H200, H = 32, K = V = 128): 8 x 2048 (512 blocks of one warpgroup)
  // 0.500 -> 0.413 ms, 2 x 8192 (128) 0.536 -> 0.506, 1 x 65536 (64) 2.90 -> 4.07: the longer
  // chunk step loses once half the SMs or more would sit idle.
  const int64_t blocks = num_seqs * HV * (V / 64);
  return 4 * blocks >= 3 * int64_t(device_sm_count());
}

void launch_chunk_state_bwd_wgmma(const ChunkTokens& x, const ChunkWorkspace& ws,
                                  const ChunkGrads& gd, int64_t num_seqs, int K, int V,
                                  cudaStream_t stream) {
  if (K == 128 && V == 128) return launch<128, 128>(x, ws, gd, num_seqs, stream);
  if (K == 128 && V == 64) return launch<128, 64>(x, ws, gd, num_seqs, stream);
  if (K == 64 && V == 128) return launch<64, 128>(x, ws, gd, num_seqs, stream);
  return launch<64, 64>(x, ws, gd, num_seqs, stream);
}

}  // namespace kda::ops::cuda_detail
