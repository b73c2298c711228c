// Causal flash attention forward for bf16 with head dims 128 / 128 on wgmma with a producer warp
// (sm_90a; FlashAttention-3's warp specialisation, without its ping-pong). The default forward
// for those shapes on compute capability 9 (H200, 2026-12-01: T = 2048, H = 32 0.166 -> 0.109
// ms against the mma.sync forward of attention_prefill.cu, T = 8192 2.066 -> 1.288 ms, 427
// TFLOP/s; a plain wgmma forward, whose copies and V transpose ran on the computing warps, was
// slower than mma.sync and is gone: docs/GPU_NOTES.md). KDA_ATTENTION_TMA_FORWARD picks the
// variant: 2 (default) issues S of the next tile beside P V of this one and runs the next
// softmax while the second product does (FlashAttention-3's intra-warpgroup overlap), 1 runs one
// product at a time, 0 turns the kernel off.
//
// A block of three warpgroups owns 128 queries of one head. Warpgroup 0 produces: one thread
// issues every copy by TMA (Q once; K and V tiles of 64 keys into a kStages ring, K and V of each
// stage with a "full" mbarrier counting the bytes and an "empty" one the consumers arrive on).
// Warpgroups 1 and 2 consume 64 queries each, never meeting at a block barrier:
//   S = Q K^T      8 x wgmma m64n64k16, Q and K as TMA left them (128-byte swizzle, K-major)
//   online softmax on the S accumulators (masks only on tiles crossing the diagonal or Tk)
//   O += P V       4 x wgmma m64n128k16, P from registers, V read as stored ([keys][dims]:
//                  MN-major descriptor, trans-b; no transpose)
// The tensor maps are 4-D (head dim, head, token, sequence), so a box never crosses into the
// next head or sequence and rows past Tq / Tk arrive as zeros. Query tiles run heaviest first
// over the whole grid (attention_tile_grid).
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "ops/attention/cuda/attention_kernels.cuh"
#include "ops/attention/cuda/tma.cuh"
#include "ops/common/device_attributes.h"
#include "ops/common/wgmma.cuh"

namespace kda::ops::cuda_detail {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kD = 128;   // Dk = Dv
constexpr int kBM = 128;  // queries a block (two consumer warpgroups of 64)
constexpr int kBN = 64;   // keys a tile
constexpr int kStages = 2;
constexpr int kThreads = 384;
constexpr int kConsumers = 256;
constexpr uint32_t kRowBytes = 128;           // a swizzled row: 64 bf16
constexpr uint32_t kQCol = kBM * kRowBytes;   // one 64-wide column tile of Q (16 KB)
constexpr uint32_t kKVCol = kBN * kRowBytes;  // one 64-wide column tile of K or V (8 KB)
constexpr uint32_t kKVTile = 2 * kKVCol;      // K or V of one tile (128 dims)
constexpr uint32_t kOffK = 2 * kQCol;
constexpr uint32_t kOffV = kOffK + kStages * kKVTile;
constexpr uint32_t kOffBars = kOffV + kStages * kKVTile;
constexpr uint32_t kSmemBytes = kOffBars + 8 * (1 + 4 * kStages);
constexpr size_t kSmemLaunch = kSmemBytes + 1024;  // + room to align the base to 1024
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Register budgets after the split (setmaxnreg): the producer warpgroup gives registers back so
// that the consumers can hold S of the next tile beside O (FlashAttention-3's 24 / 240 split).
constexpr int kProducerRegs = 40, kConsumerRegs = 232;
static_assert(kProducerRegs * 128 + kConsumerRegs * 256 <= 65536, "register file");

template <bool kOverlap>
__global__ void __launch_bounds__(kThreads, 1)
    attention_prefill_tma_kernel(AttentionParams p, const __grid_constant__ CUtensorMap map_q,
                                 const __grid_constant__ CUtensorMap map_k,
                                 const __grid_constant__ CUtensorMap map_v) {
#ifdef KDA_WGMMA
  extern __shared__ unsigned char smem_raw[];
  // the shared-window address 1024-byte aligned (TMA's swizzle and the descriptors see it)
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  unsigned char* Qs = smem;          // [2 column tiles][128 rows]
  unsigned char* Ks = smem + kOffK;  // [stage][2 column tiles][64 rows]
  unsigned char* Vs = smem + kOffV;  // [stage][2 column tiles][64 rows]
  // full: the stage's bytes landed (the producer's expect_tx is the one arrival); empty: every
  // consumer thread is done with it. K and V separately, so K of a stage is refilled as soon as
  // S of its tile is done, before P V of that tile.
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + kOffBars);
  uint64_t* q_full = bars;
  uint64_t* k_full = bars + 1;
  uint64_t* v_full = k_full + kStages;
  uint64_t* k_empty = v_full + kStages;
  uint64_t* v_empty = k_empty + kStages;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2, wq = warp & 3;
  const int g = lane >> 2, t4 = lane & 3;
  const AttentionBlockTile at = attention_block_tile(p.Hq, p.batch);
  const int64_t tiles = (p.Tq + kBM - 1) / kBM;
  const int64_t q0 = (tiles - 1 - at.rank) * kBM;  // the last query tile is the heaviest
  const int h = at.head;
  const int b = int(at.seq);
  const int kvh = h / p.group;
  const int q_rows = int(min(int64_t(kBM), p.Tq - q0));
  const int64_t kv_end = min(p.Tk, p.q_offset + q0 + q_rows);
  const int ntiles = int((kv_end + kBN - 1) / kBN);

  if (tid == 0) {
    mbar_init(q_full, 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&k_full[s], 1);
      mbar_init(&v_full[s], 1);
      mbar_init(&k_empty[s], kConsumers);
      mbar_init(&v_empty[s], kConsumers);
    }
    mbar_init_fence();
  }
  __syncthreads();  // the barriers initialised before anyone waits on them

  if (wg == 0) {  // the producer: one thread issues every copy
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    if (tid == 0) {
      mbar_expect_tx(q_full, 2 * kQCol);
      for (int col = 0; col < 2; ++col)
        tma_load_4d(Qs + col * kQCol, &map_q, 64 * col, h, int(q0), b, q_full);
      for (int j = 0; j < ntiles; ++j) {
        const int s = j % kStages;
        const uint32_t reuse = uint32_t((j / kStages - 1) & 1);  // tile j - kStages's release
        if (j >= kStages) mbar_wait(&k_empty[s], reuse);
        mbar_expect_tx(&k_full[s], kKVTile);
        for (int col = 0; col < 2; ++col)
          tma_load_4d(Ks + s * kKVTile + col * kKVCol, &map_k, 64 * col, kvh, j * kBN, b,
                      &k_full[s]);
        if (j >= kStages) mbar_wait(&v_empty[s], reuse);
        mbar_expect_tx(&v_full[s], kKVTile);
        for (int col = 0; col < 2; ++col)
          tma_load_4d(Vs + s * kKVTile + col * kKVCol, &map_v, 64 * col, kvh, j * kBN, b,
                      &v_full[s]);
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));

  // consumers: warpgroup cw owns query rows 64 cw .. 64 cw + 63 of the block
  const int cw = wg - 1;
  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  const float scale_log2 = p.scale * kLog2e;
  const int row_in_block = cw * 64 + wq * 16 + g;  // this thread's rows: + 0 and + 8
  const int64_t qpos_base = p.q_offset + q0 + row_in_block;
  const unsigned char* q_wg = Qs + cw * 64 * kRowBytes;
  const auto phase = [](int j) { return uint32_t((j / kStages) & 1); };

  // S = Q K^T of tile j (64 rows of this warpgroup x 64 keys), issued and committed
  const auto issue_s = [&](float(&sc)[32], int j) {
    const unsigned char* k_buf = Ks + (j % kStages) * kKVTile;
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      const uint32_t off = (ks & 3) * 32, col = ks >> 2;
      wgmma_m64n64k16_ss(sc, sw128_desc(q_wg + col * kQCol + off),
                         sw128_desc(k_buf + col * kKVCol + off), ks > 0);
    }
    wgmma_commit();
  };
  // O += P V of tile j: V as stored, 16 keys (16 rows of 128 bytes) a k-step; the second 64 head
  // dims are the next column tile (LBO), 8-key groups 1024 bytes apart (SBO). Issued, committed.
  const auto issue_pv = [&](const uint32_t(&pa)[kBN / 16][4], int j) {
    const unsigned char* v_buf = Vs + (j % kStages) * kKVTile;
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk)
      wgmma_m64n128k16_rs<1>(o, pa[kk], sw128_desc_mn(v_buf + kk * 16 * kRowBytes, kKVCol, 1024));
    wgmma_commit();
  };
  // Mask, online softmax in log2 units (max over raw scores; one FMA per probability), P packed
  // into the A fragments of O += P V (keys [16 kk, 16 kk + 16): n8 blocks 2 kk, 2 kk + 1). S is
  // only read (an accumulator written while another product is in flight serializes the
  // wgmmas). Sets the factor the O accumulated so far must take.
  const auto softmax = [&](const float(&sc)[32], int j, uint32_t(&pa)[kBN / 16][4],
                           float(&alpha)[2]) {
    const int64_t key0 = int64_t(j) * kBN;
    const bool need_mask = key0 + kBN - 1 > p.q_offset + q0 || key0 + kBN > p.Tk;
    int last[2] = {kBN, kBN};
    if (need_mask) {
#pragma unroll
      for (int r = 0; r < 2; ++r)
        last[r] = int(max(int64_t(-1), min(int64_t(kBN), min(qpos_base + 8 * r, p.Tk - 1) - key0)));
    }
    const auto masked = [&](int i) {
      return need_mask && (i >> 2) * 8 + 2 * t4 + (i & 1) > last[(i >> 1) & 1];
    };
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int i = 0; i < 32; ++i)
      if (!masked(i)) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], sc[i]);
    float m_use[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      const float m_new = fmaxf(m_run[r], mx[r] * scale_log2);
      m_use[r] = m_new == -INFINITY ? 0.f : m_new;
      alpha[r] = fast_exp2(m_run[r] - m_use[r]);
      m_run[r] = m_new;
    }
    float pv[32], rowsum[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      pv[i] = masked(i) ? 0.f : fast_exp2(fmaf(sc[i], scale_log2, -m_use[(i >> 1) & 1]));
      rowsum[(i >> 1) & 1] += pv[i];
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) l_run[r] = l_run[r] * alpha[r] + rowsum[r];
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) pa[kk][e] = pack_bf16(pv[8 * kk + 2 * e], pv[8 * kk + 2 * e + 1]);
  };
  const auto rescale = [&](const float(&alpha)[2]) {
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int n = 0; n < kD / 8; ++n) {
        o[4 * n + 0] *= alpha[0];
        o[4 * n + 1] *= alpha[0];
        o[4 * n + 2] *= alpha[1];
        o[4 * n + 3] *= alpha[1];
      }
    }
  };

  mbar_wait(q_full, 0);
  uint32_t pa[kBN / 16][4];
  if constexpr (!kOverlap) {
    for (int j = 0; j < ntiles; ++j) {
      const int s = j % kStages;
      mbar_wait(&k_full[s], phase(j));
      float sc[32], alpha[2];
      fence_operands(sc);
      wgmma_fence();
      issue_s(sc, j);
      wgmma_wait<0>();
      fence_operands(sc);
      mbar_arrive(&k_empty[s]);  // this thread is done with the stage's K
      softmax(sc, j, pa, alpha);
      rescale(alpha);
      mbar_wait(&v_full[s], phase(j));
      fence_operands(o);
      fence_operands(pa);
      wgmma_fence();
      issue_pv(pa, j);
      wgmma_wait<0>();
      fence_operands(o);
      fence_operands(pa);
      mbar_arrive(&v_empty[s]);  // ... and with its V
    }
  } else {
    // S of tile j + 1 goes to the tensor cores with O += P_j V_j, and the softmax of tile j + 1
    // runs while the second product does (FlashAttention-3's intra-warpgroup overlap).
    {
      float sc[32], alpha[2];
      mbar_wait(&k_full[0], 0);
      fence_operands(sc);
      wgmma_fence();
      issue_s(sc, 0);
      wgmma_wait<0>();
      fence_operands(sc);
      mbar_arrive(&k_empty[0]);
      softmax(sc, 0, pa, alpha);  // alpha = 0 against the empty O
    }
    for (int j = 0; j < ntiles; ++j) {
      const bool has_next = j + 1 < ntiles;
      float sc[32];
      if (has_next) mbar_wait(&k_full[(j + 1) % kStages], phase(j + 1));
      mbar_wait(&v_full[j % kStages], phase(j));
      fence_operands(sc);
      fence_operands(o);
      fence_operands(pa);
      wgmma_fence();
      if (has_next) issue_s(sc, j + 1);
      issue_pv(pa, j);
      if (has_next) {
        wgmma_wait<1>();  // S of tile j + 1
        fence_operands(sc);
        uint32_t pa_next[kBN / 16][4];
        float alpha[2];
        softmax(sc, j + 1, pa_next, alpha);
        wgmma_wait<0>();  // O += P_j V_j
        fence_operands(o);
        fence_operands(pa);  // P_j stays live until the product reading it is done
        rescale(alpha);
        // K of tile j + 1 released here, not between the two waits: an mbarrier arrive there
        // made ptxas serialize every wgmma (C7513)
        mbar_arrive(&k_empty[(j + 1) % kStages]);
#pragma unroll
        for (int kk = 0; kk < kBN / 16; ++kk)
#pragma unroll
          for (int e = 0; e < 4; ++e) pa[kk][e] = pa_next[kk][e];
      } else {
        wgmma_wait<0>();
        fence_operands(o);
        fence_operands(pa);
      }
      mbar_arrive(&v_empty[j % kStages]);
    }
  }

  // Row sums over the quad, normalise, write lse and the rows.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t qi = q0 + row_in_block + 8 * r;
    if (qi >= p.Tq) continue;
    const float inv = 1.f / l_run[r];
    if (p.lse != nullptr && t4 == 0)
      p.lse[b * p.lse_bstride + qi * p.Hq + h] = (m_run[r] + log2f(l_run[r])) * kLn2;
    const int64_t orow = b * p.o_bstride + (qi * p.Hq + h) * int64_t(kD);
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) {
      const int c = n * 8 + 2 * t4;
      const float x0 = o[4 * n + 2 * r] * inv, x1 = o[4 * n + 2 * r + 1] * inv;
      if (p.o_bf16 != nullptr)
        *reinterpret_cast<__nv_bfloat162*>(static_cast<bf16*>(p.o_bf16) + orow + c) =
            __floats2bfloat162_rn(x0, x1);
      else
        *reinterpret_cast<float2*>(p.o + orow + c) = make_float2(x0, x1);
    }
  }
#else
  __trap();  // sm_90a only (the launcher checks the device)
#endif
}

// A 4-D map over (head dim, head, token, sequence) of q, k or v.
bool head_map(CUtensorMap* map, const void* base, int heads, int64_t tokens, int64_t stride,
              int64_t bstride, int batch, uint32_t box_tokens) {
  const uint64_t dims[4] = {uint64_t(kD), uint64_t(heads), uint64_t(tokens), uint64_t(batch)};
  const uint64_t strides[3] = {uint64_t(kD) * 2, uint64_t(stride) * 2,
                               uint64_t(batch > 1 ? bstride : tokens * stride) * 2};
  const uint32_t box[4] = {64, 1, box_tokens, 1};
  return encode_tensor_map_bf16(map, base, 4, dims, strides, box);
}

}  // namespace

bool launch_attention_prefill_tma(const AttentionParams& p, cudaStream_t stream) {
  // 2 (default): S of the next tile beside P V of this one; 1: one product at a time; 0: off
  static const int mode = [] {
    const char* env = std::getenv("KDA_ATTENTION_TMA_FORWARD");
    if (env == nullptr) return 2;
    const std::string_view v(env);
    return v == "1" ? 1 : v == "0" ? 0 : 2;
  }();
  if (mode == 0 || !attention_wgmma_enabled()) return false;
  if (p.Dk != kD || p.Dv != kD || p.kv_len_device != nullptr) return false;
  // TMA: 16-byte strides and base addresses; bf16 o written in pairs
  if (p.q_stride % 8 != 0 || p.k_stride % 8 != 0 || p.v_stride % 8 != 0) return false;
  if (p.batch > 1 && (p.q_bstride % 8 != 0 || p.k_bstride % 8 != 0 || p.v_bstride % 8 != 0 ||
                      p.o_bstride % 2 != 0))
    return false;
  const auto aligned = [](const void* x, uintptr_t n) {
    return reinterpret_cast<uintptr_t>(x) % n == 0;
  };
  if (!aligned(p.q, 16) || !aligned(p.k, 16) || !aligned(p.v, 16)) return false;
  if (p.o_bf16 != nullptr ? !aligned(p.o_bf16, 4) : !aligned(p.o, 8)) return false;
  if (kSmemLaunch > size_t(device_max_smem_optin())) return false;
  CUtensorMap map_q, map_k, map_v;
  if (!head_map(&map_q, p.q, p.Hq, p.Tq, p.q_stride, p.q_bstride, p.batch, kBM) ||
      !head_map(&map_k, p.k, p.Hkv, p.Tk, p.k_stride, p.k_bstride, p.batch, kBN) ||
      !head_map(&map_v, p.v, p.Hkv, p.Tk, p.v_stride, p.v_bstride, p.batch, kBN)) {
    return false;  // (the driver refused the maps: the mma.sync forward runs instead)
  }
  auto kernel =
      mode == 2 ? attention_prefill_tma_kernel<true> : attention_prefill_tma_kernel<false>;
  static const bool configured = [kernel] {  // once (the mode is fixed for the process)
    check_cuda(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemLaunch)),
        "cudaFuncSetAttribute (attention_prefill_tma_kernel)");
    return true;
  }();
  (void)configured;
  const dim3 grid = attention_tile_grid((p.Tq + kBM - 1) / kBM, p.Hq, p.batch);
  kernel<<<grid, kThreads, kSmemLaunch, stream>>>(p, map_q, map_k, map_v);
  check_launch("attention_prefill_tma_kernel");
  return true;
}

}  // namespace kda::ops::cuda_detail
