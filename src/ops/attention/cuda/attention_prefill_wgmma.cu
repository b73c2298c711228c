// Causal flash attention forward for bf16 with head dims 128 / 128 on wgmma (sm_90a): the
// FlashAttention-3 route without its producer warpgroup (work in progress: selected only with
// KDA_ATTENTION_WGMMA=1 until the H200 has checked it; attention_prefill.cu is the default).
//
// A block of two warpgroups owns 128 queries of one head (warpgroup w: rows 64 w .. 64 w + 63)
// and walks the key tiles of 64 keys its queries see, double-buffered:
//   S = Q K^T      8 x wgmma m64n64k16, Q and K from shared memory (K-major, 128-byte swizzle)
//   online softmax on the S accumulators (the mma.sync C layout: rows g, g + 8 of each warp)
//   O += P V       4 x wgmma m64n128k16, P from registers (the accumulators repacked to bf16),
//                  V^T from shared memory (K-major: V is transposed on its way in)
// Q and K arrive by cp.async into their swizzled places; V is read into registers a tile ahead
// and stored transposed (a 32-bit store holds two keys of one head dim) after this tile's
// products. Every tile: wait for its copies, fence.proxy.async (generic writes -> wgmma reads),
// one barrier; one more barrier at its end before its buffers are refilled.
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

constexpr int kD = 128;   // Dk = Dv
constexpr int kBM = 128;  // queries a block
constexpr int kBN = 64;   // keys a tile
constexpr int kThreads = 256;
constexpr uint32_t kRowBytes = 128;          // a swizzled row: 64 bf16
constexpr uint32_t kQCol = kBM * kRowBytes;  // one 64-wide column tile of Q
constexpr uint32_t kKCol = kBN * kRowBytes;  // one 64-wide column tile of K
constexpr uint32_t kKBuf = 2 * kKCol;        // K of one tile (128 dims)
constexpr uint32_t kVtBuf = kD * kRowBytes;  // V^T of one tile: 128 dim rows x 64 keys
constexpr uint32_t kSmemBytes = 2 * kQCol + 2 * kKBuf + 2 * kVtBuf;
constexpr size_t kSmemLaunch = kSmemBytes + 1024;  // + room to align the base to 1024
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Keeps the compiler from moving reads of an accumulator above the wgmma wait.
__device__ __forceinline__ void fence_operand(float& x) {
  asm volatile("" : "+f"(x)::"memory");
}

__global__ void __launch_bounds__(kThreads, 1) attention_prefill_wgmma_kernel(AttentionParams p) {
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

  // rows x 16 chunks of 16 bytes into swizzled column tiles `col_bytes` apart; rows >= valid
  // are zero-filled
  const auto load_rows = [&](unsigned char* dst, uint32_t col_bytes, const bf16* src,
                             int64_t stride, int rows, int valid) {
    for (int idx = tid; idx < rows * 16; idx += kThreads) {
      const int r = idx >> 4, c = idx & 15;
      unsigned char* d = dst + (c >> 3) * col_bytes + sw128_offset(r, (c & 7) * 8);
      if (r < valid)
        cp_async16(d, src + int64_t(r) * stride + c * 8);
      else
        *reinterpret_cast<uint4*>(d) = make_uint4(0u, 0u, 0u, 0u);
    }
  };
  const auto load_k = [&](int tile, int buf) {
    const int64_t key0 = int64_t(tile) * kBN;
    load_rows(Ks + buf * kKBuf, kKCol, kbase + key0 * p.k_stride, p.k_stride, kBN,
              int(min(int64_t(kBN), p.Tk - key0)));
  };
  // V of a tile into registers: thread t holds keys 2 (t % 32) and 2 (t % 32) + 1, head-dim
  // chunks t / 32 and t / 32 + 8 (8 dims each)
  const int vpair = tid & 31, vchunk = tid >> 5;
  uint4 vreg[2][2];
  const auto load_v = [&](int tile) {
    const int64_t key0 = int64_t(tile) * kBN;
    const int valid = int(min(int64_t(kBN), p.Tk - key0));
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int key = 2 * vpair + k;
        vreg[i][k] = key < valid ? *reinterpret_cast<const uint4*>(
                                       vbase + (key0 + key) * p.v_stride + (vchunk + 8 * i) * 8)
                                 : make_uint4(0u, 0u, 0u, 0u);
      }
  };
  // ... stored transposed: V^T row = head dim, column = key; one 32-bit store per dim holds
  // both keys (a warp's 32 stores fill one 128-byte row: no bank conflicts)
  const auto store_vt = [&](int buf) {
    unsigned char* dst = Vt + buf * kVtBuf;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint32_t* lo = reinterpret_cast<const uint32_t*>(&vreg[i][0]);
      const uint32_t* hi = reinterpret_cast<const uint32_t*>(&vreg[i][1]);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const uint32_t a = (lo[e >> 1] >> (16 * (e & 1))) & 0xFFFFu;
        const uint32_t c = (hi[e >> 1] >> (16 * (e & 1))) & 0xFFFFu;
        const int dim = (vchunk + 8 * i) * 8 + e;
        *reinterpret_cast<uint32_t*>(dst + sw128_offset(dim, 2 * vpair)) = a | (c << 16);
      }
    }
  };

  load_rows(Qs, kQCol, qsrc, p.q_stride, kBM, q_rows);
  load_k(0, 0);
  cp_async_commit();
  load_v(0);
  store_vt(0);

  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  const float scale_log2 = p.scale * kLog2e;
  const int row_in_block = wg * 64 + wq * 16 + g;  // this thread's rows: + 0 and + 8
  const int64_t qpos_base = p.q_offset + q0 + row_in_block;
  const unsigned char* q_wg = Qs + wg * 64 * kRowBytes;

  for (int j = 0; j < ntiles; ++j) {
    const int buf = j & 1;
    if (j + 1 < ntiles) {
      load_k(j + 1, buf ^ 1);
      cp_async_commit();
      load_v(j + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    fence_proxy_async();
    __syncthreads();

    // S = Q K^T (64 rows of this warpgroup x 64 keys)
    float s[32];
    const unsigned char* k_buf = Ks + buf * kKBuf;
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      const uint32_t off = (ks & 3) * 32, col = (ks >> 2);
      wgmma_m64n64k16_ss(s, sw128_desc(q_wg + col * kQCol + off),
                         sw128_desc(k_buf + col * kKCol + off), ks > 0);
    }
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < 32; ++i) fence_operand(s[i]);

    // mask, online softmax in log2 units (max over raw scores; one FMA per probability)
    const int64_t key0 = int64_t(j) * kBN;
    const bool need_mask = key0 + kBN - 1 > p.q_offset + q0 || key0 + kBN > p.Tk;
    int last[2] = {kBN, kBN};
    if (need_mask) {
#pragma unroll
      for (int r = 0; r < 2; ++r)
        last[r] = int(max(int64_t(-1), min(int64_t(kBN), min(qpos_base + 8 * r, p.Tk - 1) - key0)));
    }
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < kBN / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (need_mask && n * 8 + 2 * t4 + (e & 1) > last[e >> 1]) s[4 * n + e] = -INFINITY;
        mx[e >> 1] = fmaxf(mx[e >> 1], s[4 * n + e]);
      }
    float alpha[2], m_use[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      const float m_new = fmaxf(m_run[r], mx[r] * scale_log2);
      m_use[r] = m_new == -INFINITY ? 0.f : m_new;
      alpha[r] = fast_exp2(m_run[r] - m_use[r]);
      m_run[r] = m_new;
    }
    float rowsum[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < kBN / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pv = fast_exp2(fmaf(s[4 * n + e], scale_log2, -m_use[e >> 1]));
        s[4 * n + e] = pv;
        rowsum[e >> 1] += pv;
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) l_run[r] = l_run[r] * alpha[r] + rowsum[r];
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int n = 0; n < kD / 8; ++n) {
        o[4 * n + 0] *= alpha[0];
        o[4 * n + 1] *= alpha[0];
        o[4 * n + 2] *= alpha[1];
        o[4 * n + 3] *= alpha[1];
      }
    }

    // O += P V: P's A fragment for keys [16 kk, 16 kk + 16) is n8 blocks 2 kk and 2 kk + 1,
    // all packed before the fence (registers written between wgmmas cost an injected arrive)
    uint32_t pa[kBN / 16][4];
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
      pa[kk][0] = pack_bf16(s[8 * kk + 0], s[8 * kk + 1]);
      pa[kk][1] = pack_bf16(s[8 * kk + 2], s[8 * kk + 3]);
      pa[kk][2] = pack_bf16(s[8 * kk + 4], s[8 * kk + 5]);
      pa[kk][3] = pack_bf16(s[8 * kk + 6], s[8 * kk + 7]);
    }
    const unsigned char* vt_buf = Vt + buf * kVtBuf;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk)
      wgmma_m64n128k16_rs(o, pa[kk], sw128_desc(vt_buf + kk * 32));
    wgmma_commit();
    wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < 64; ++i) fence_operand(o[i]);

    if (j + 1 < ntiles) store_vt(buf ^ 1);
    __syncthreads();  // every warpgroup is done with buffer `buf` before it is refilled
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

bool wgmma_requested() {
  const char* env = std::getenv("KDA_ATTENTION_WGMMA");
  return env != nullptr && std::string_view(env) == "1";
}

}  // namespace

bool launch_attention_prefill_wgmma(const AttentionParams& p, cudaStream_t stream) {
  if (!wgmma_requested() || attention_cc_major() != 9) return false;
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
