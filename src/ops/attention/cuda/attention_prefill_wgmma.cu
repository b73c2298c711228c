// Causal flash attention forward for bf16 with head dims 128 / 128 on wgmma (sm_90a): the
// FlashAttention-3 route without its producer warpgroup. Opt-in (KDA_ATTENTION_WGMMA_FORWARD=1):
// on the H200 it is slower than attention_prefill.cu's mma.sync kernel (T = 2048, H = 32:
// 0.172 against 0.167 ms; T = 8192: 2.225 against 2.050 ms): one block of 8 warps an SM, the
// loads and V's transpose on the same warps as the products and one barrier a tile keep the
// tensor cores idle; the step that pays is a producer warp with TMA and mbarriers.
//
// A block of two warpgroups owns 128 queries of one head (warpgroup w: rows 64 w .. 64 w + 63)
// and walks the key tiles of 64 keys its queries see, double-buffered:
//   S = Q K^T      8 x wgmma m64n64k16, Q and K from shared memory (K-major, 128-byte swizzle)
//   online softmax on the S accumulators (the mma.sync C layout: rows g, g + 8 of each warp)
//   O += P V       4 x wgmma m64n128k16, P from registers (the accumulators repacked to bf16),
//                  V^T from shared memory (K-major: V is transposed on its way in)
// S of tile j + 1 and O += P_j V_j are issued together and the softmax of tile j + 1 runs while
// the second product does (FlashAttention-3's intra-warpgroup overlap).
// Q and K arrive by cp.async into their swizzled places two tiles ahead; V is read into
// registers two tiles ahead and stored transposed (a 32-bit store holds two keys of one head dim)
// one tile ahead. One barrier a tile (after fence.proxy.async: generic writes -> wgmma reads).
// Query tiles run heaviest first over the whole grid (attention_tile_grid).
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "ops/attention/cuda/attention_kernels.cuh"
#include "ops/attention/cuda/wgmma.cuh"

namespace kda::ops::cuda_detail {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kD = 128;  // Dk = Dv
constexpr int kWarpgroups = 2;
constexpr int kBM = 64 * kWarpgroups;  // queries a block
constexpr int kBN = 64;                // keys a tile
constexpr int kThreads = 128 * kWarpgroups;
constexpr int kVChunks = 16 * 32 / kThreads;  // 8-dim chunks of V a thread loads (2 keys each)
constexpr uint32_t kRowBytes = 128;           // a swizzled row: 64 bf16
constexpr uint32_t kQCol = kBM * kRowBytes;   // one 64-wide column tile of Q
constexpr uint32_t kKCol = kBN * kRowBytes;   // one 64-wide column tile of K
constexpr uint32_t kKBuf = 2 * kKCol;         // K of one tile (128 dims)
constexpr uint32_t kVtBuf = kD * kRowBytes;   // V^T of one tile: 128 dim rows x 64 keys
constexpr uint32_t kSmemBytes = 2 * kQCol + 2 * kKBuf + 2 * kVtBuf;
constexpr size_t kSmemLaunch = kSmemBytes + 1024;  // + room to align the base to 1024
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__global__ void __launch_bounds__(kThreads, 2 / kWarpgroups)
    attention_prefill_wgmma_kernel(AttentionParams p) {
#ifdef KDA_WGMMA
  extern __shared__ unsigned char smem_raw[];
  // the shared-window address 1024-byte aligned (the descriptors and the swizzle see it)
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  unsigned char* Qs = smem;            // [2 column tiles][128 rows]
  unsigned char* Ks = Qs + 2 * kQCol;  // [2 buffers][2 column tiles][64 rows]
  unsigned char* Vt = Ks + 2 * kKBuf;  // [2 buffers][128 dim rows][64 keys]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2, wq = warp & 3;  // warpgroup, warp within it
  const int g = lane >> 2, t4 = lane & 3;
  const AttentionBlockTile at = attention_block_tile(p.Hq, p.batch);
  const int64_t tiles = (p.Tq + kBM - 1) / kBM;
  const int64_t q0 = (tiles - 1 - at.rank) * kBM;  // the last query tile is the heaviest
  const int h = at.head;
  const int64_t b = at.seq;
  const int kvh = h / p.group;

  const int q_rows = int(min(int64_t(kBM), p.Tq - q0));
  const int64_t kv_end = min(p.Tk, p.q_offset + q0 + q_rows);
  const int ntiles = int((kv_end + kBN - 1) / kBN);

  const bf16* qsrc =
      static_cast<const bf16*>(p.q) + b * p.q_bstride + q0 * p.q_stride + int64_t(h) * kD;
  const bf16* kbase = static_cast<const bf16*>(p.k) + b * p.k_bstride + int64_t(kvh) * kD;
  const bf16* vbase = static_cast<const bf16*>(p.v) + b * p.v_bstride + int64_t(kvh) * kD;

  const auto load_rows = [&](unsigned char* dst, uint32_t col_bytes, const bf16* src,
                             int64_t stride, int rows, int valid) {
    load_rows_sw128<kThreads>(dst, col_bytes, src, stride, rows, valid, tid);
  };
  const auto load_k = [&](int tile, int buf) {
    const int64_t key0 = int64_t(tile) * kBN;
    load_rows(Ks + buf * kKBuf, kKCol, kbase + key0 * p.k_stride, p.k_stride, kBN,
              int(min(int64_t(kBN), p.Tk - key0)));
  };
  // V of a tile into registers: thread t holds keys 2 (t % 32) and 2 (t % 32) + 1, head-dim
  // chunks t / 32 + (kThreads / 32) i (8 dims each)
  const int vpair = tid & 31, vchunk = tid >> 5;
  uint4 vreg[kVChunks][2];
  const auto load_v = [&](int tile) {
    const int64_t key0 = int64_t(tile) * kBN;
    const int valid = int(min(int64_t(kBN), p.Tk - key0));
#pragma unroll
    for (int i = 0; i < kVChunks; ++i)
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int key = 2 * vpair + k;
        vreg[i][k] = key < valid
                         ? *reinterpret_cast<const uint4*>(vbase + (key0 + key) * p.v_stride +
                                                           (vchunk + (kThreads / 32) * i) * 8)
                         : make_uint4(0u, 0u, 0u, 0u);
      }
  };
  // ... stored transposed: V^T row = head dim, column = key; one 32-bit store per dim holds
  // both keys (a warp's 32 stores fill one 128-byte row: no bank conflicts)
  const auto store_vt = [&](int buf) {
    unsigned char* dst = Vt + buf * kVtBuf;
#pragma unroll
    for (int i = 0; i < kVChunks; ++i) {
      const uint32_t* lo = reinterpret_cast<const uint32_t*>(&vreg[i][0]);
      const uint32_t* hi = reinterpret_cast<const uint32_t*>(&vreg[i][1]);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const uint32_t a = (lo[e >> 1] >> (16 * (e & 1))) & 0xFFFFu;
        const uint32_t c = (hi[e >> 1] >> (16 * (e & 1))) & 0xFFFFu;
        const int dim = (vchunk + (kThreads / 32) * i) * 8 + e;
        *reinterpret_cast<uint32_t*>(dst + sw128_offset(dim, 2 * vpair)) = a | (c << 16);
      }
    }
  };

  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  const float scale_log2 = p.scale * kLog2e;
  const int row_in_block = wg * 64 + wq * 16 + g;  // this thread's rows: + 0 and + 8
  const int64_t qpos_base = p.q_offset + q0 + row_in_block;
  const unsigned char* q_wg = Qs + wg * 64 * kRowBytes;

  // S = Q K^T of tile `tile` (64 rows of this warpgroup x 64 keys), issued and committed
  const auto issue_s = [&](float(&s)[32], int tile) {
    const unsigned char* k_buf = Ks + (tile & 1) * kKBuf;
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      const uint32_t off = (ks & 3) * 32, col = (ks >> 2);
      wgmma_m64n64k16_ss(s, sw128_desc(q_wg + col * kQCol + off),
                         sw128_desc(k_buf + col * kKCol + off), ks > 0);
    }
    wgmma_commit();
  };
  // Mask, online softmax in log2 units (max over raw scores; one FMA per probability); P packed
  // into the A fragments of O += P V (keys [16 kk, 16 kk + 16): n8 blocks 2 kk, 2 kk + 1).
  // Returns the factor the O accumulated so far must take.
  // Mask, online softmax in log2 units (max over raw scores; one FMA per probability); P packed
  // into the A fragments of O += P V (keys [16 kk, 16 kk + 16): n8 blocks 2 kk, 2 kk + 1). S is
  // only read: writing an accumulator while another product is in flight serializes the wgmmas.
  // Sets the factor the O accumulated so far must take.
  const auto softmax = [&](const float(&s)[32], int tile, uint32_t(&pa)[kBN / 16][4],
                           float(&alpha)[2]) {
    const int64_t key0 = int64_t(tile) * kBN;
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
      if (!masked(i)) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
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
      pv[i] = masked(i) ? 0.f : fast_exp2(fmaf(s[i], scale_log2, -m_use[(i >> 1) & 1]));
      rowsum[(i >> 1) & 1] += pv[i];
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) l_run[r] = l_run[r] * alpha[r] + rowsum[r];
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) pa[kk][e] = pack_bf16(pv[8 * kk + 2 * e], pv[8 * kk + 2 * e + 1]);
  };

  // Prologue: Q, K of tiles 0 and 1, V^T of tile 0 stored, V of tile 1 in registers; S and P of
  // tile 0.
  load_rows(Qs, kQCol, qsrc, p.q_stride, kBM, q_rows);
  load_k(0, 0);
  if (ntiles > 1) load_k(1, 1);
  cp_async_commit();
  load_v(0);
  store_vt(0);
  if (ntiles > 1) load_v(1);
  cp_async_wait<0>();
  fence_proxy_async();
  __syncthreads();
  uint32_t pa[kBN / 16][4];
  {
    float s[32], alpha[2];
    wgmma_fence();
    issue_s(s, 0);
    wgmma_wait<0>();
    fence_operands(s);
    softmax(s, 0, pa, alpha);  // alpha = 0 against the empty O
  }
  __syncthreads();  // every warpgroup done with K of tile 0 before tile 2 replaces it

  // Tile j (FlashAttention-3's intra-warpgroup overlap): S of tile j + 1 and O += P_j V_j go to
  // the tensor cores together; the softmax of tile j + 1 runs while the second one does. At the
  // top of the iteration K of tile j + 1 and V^T of tile j are in shared memory, P_j in pa.
  for (int j = 0; j < ntiles; ++j) {
    const bool has_next = j + 1 < ntiles;
    // refill the buffers the last iteration finished with (every warpgroup is past its barrier)
    if (has_next) store_vt((j + 1) & 1);
    if (j + 2 < ntiles) {
      load_k(j + 2, j & 1);
      cp_async_commit();
      load_v(j + 2);
    }
    float s[32];
    fence_operands(s);
    fence_operands(o);
    fence_operands(pa);
    wgmma_fence();
    if (has_next) issue_s(s, j + 1);
    const unsigned char* vt_buf = Vt + (j & 1) * kVtBuf;
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk)
      wgmma_m64n128k16_rs(o, pa[kk], sw128_desc(vt_buf + kk * 32));
    wgmma_commit();
    if (has_next) {
      wgmma_wait<1>();  // S of tile j + 1
      fence_operands(s);
      uint32_t pa_next[kBN / 16][4];
      float alpha[2];
      softmax(s, j + 1, pa_next, alpha);
      wgmma_wait<0>();  // O += P_j V_j
      fence_operands(o);
      // P_j stays live until the product reading it is done (else its registers take P_j+1)
      fence_operands(pa);
      if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int n = 0; n < kD / 8; ++n) {
          o[4 * n + 0] *= alpha[0];
          o[4 * n + 1] *= alpha[0];
          o[4 * n + 2] *= alpha[1];
          o[4 * n + 3] *= alpha[1];
        }
      }
#pragma unroll
      for (int kk = 0; kk < kBN / 16; ++kk)
#pragma unroll
        for (int e = 0; e < 4; ++e) pa[kk][e] = pa_next[kk][e];
    } else {
      wgmma_wait<0>();
      fence_operands(o);
    }
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();  // copies and V^T stores visible; every warpgroup done with this tile's
                      // buffers
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

}  // namespace

bool launch_attention_prefill_wgmma(const AttentionParams& p, cudaStream_t stream) {
  static const bool requested = [] {
    const char* env = std::getenv("KDA_ATTENTION_WGMMA_FORWARD");
    return env != nullptr && std::string_view(env) == "1";
  }();
  if (!requested || !attention_wgmma_enabled()) return false;
  if (p.Dk != kD || p.Dv != kD) return false;
  // 16-byte rows for cp.async / uint4 loads, 8-byte o pairs
  if (p.q_stride % 8 != 0 || p.k_stride % 8 != 0 || p.v_stride % 8 != 0) return false;
  if (p.batch > 1 && (p.q_bstride % 8 != 0 || p.k_bstride % 8 != 0 || p.v_bstride % 8 != 0 ||
                      p.o_bstride % 2 != 0))
    return false;
  const auto aligned = [](const void* x, uintptr_t n) {
    return reinterpret_cast<uintptr_t>(x) % n == 0;
  };
  if (!aligned(p.q, 16) || !aligned(p.k, 16) || !aligned(p.v, 16)) return false;
  if (p.o_bf16 != nullptr ? !aligned(p.o_bf16, 4) : !aligned(p.o, 8)) return false;
  if (kSmemLaunch > size_t(attention_max_smem())) return false;
  check_cuda(cudaFuncSetAttribute(attention_prefill_wgmma_kernel,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmemLaunch)),
             "cudaFuncSetAttribute (attention_prefill_wgmma_kernel)");
  const dim3 grid = attention_tile_grid((p.Tq + kBM - 1) / kBM, p.Hq, p.batch);
  attention_prefill_wgmma_kernel<<<grid, kThreads, kSmemLaunch, stream>>>(p);
  check_launch("attention_prefill_wgmma_kernel");
  return true;
}

}  // namespace kda::ops::cuda_detail
