// Tensor-core causal flash attention for bf16 prefill (FlashAttention-2 style).
//
// A block of 4 warps owns 64 queries of one head (each warp 16 query rows) and walks the key
// tiles (64 keys) that any of its queries sees, K/V tiles double-buffered through cp.async.
// Per tile: S = Q K^T (mma.sync m16n8k16, fp32 accumulators), scaled into log2 units and masked
// (causal with q_offset, keys past Tk), online softmax on the rows each thread holds (the max
// reduced over the quad of lanes sharing a row), P repacked from the S accumulators straight
// into A fragments (bf16), O += P V. Head dims are zero-padded inside: Dk to a multiple of 16
// (zero Q / K columns add nothing), Dv to the instantiation's DVP (pad columns are not written).
// Query tiles run heaviest (last) first so the causal triangle balances over the SMs.
// Grid: (query tiles, Hq, batch); sequence b = blockIdx.z reads and writes at its batch strides.
//
// Fast-path requirements (else the caller falls back to the generic kernel): Dk, Dv and the
// three row strides (and batch strides) multiples of 8 elements, q / k / v 16-byte aligned, the
// shared memory fits.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "ops/attention/cuda/attention_kernels.cuh"
#include "ops/delta_rule/cuda/device_common.cuh"

namespace kda::ops::cuda_detail {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kBM = 16 * kWarps;        // queries per block
constexpr int kBN = kAttentionKeyTile;  // keys per tile
constexpr int kPad = 8;                 // bf16 elements of row padding (ldmatrix bank spread)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// Copies `rows` rows of `chunks` 16-byte chunks into smem (row stride ld); rows >= rows_valid
// and chunks >= chunks_valid are zero-filled. src points at row 0 (stride src_stride elements).
__device__ __forceinline__ void load_tile(bf16* dst, int ld, const bf16* src, int64_t src_stride,
                                          int rows, int rows_valid, int chunks, int chunks_valid,
                                          int tid) {
  const int total = rows * chunks;
  for (int idx = tid; idx < total; idx += kThreads) {
    const int r = idx / chunks, c = idx - r * chunks;
    bf16* d = dst + r * ld + c * 8;
    if (r < rows_valid && c < chunks_valid)
      cp_async16(d, src + int64_t(r) * src_stride + c * 8);
    else
      *reinterpret_cast<uint4*>(d) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// DKQ > 0: Dk padded is exactly DKQ and the warp's Q fragments stay in registers; DKQ == 0: any
// padded Dk (dkp, a multiple of 16), Q fragments re-read from shared memory per key tile.
// DVP: padded Dv (a multiple of 16).
template <int DKQ, int DVP>
__global__ void __launch_bounds__(kThreads) attention_prefill_kernel(AttentionParams p, int dkp) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int ldk = dkp + kPad, ldv = DVP + kPad;
  bf16* Qs = reinterpret_cast<bf16*>(smem_raw);  // [kBM][ldk]
  bf16* Ks = Qs + kBM * ldk;                     // [2][kBN][ldk]
  bf16* Vs = Ks + 2 * kBN * ldk;                 // [2][kBN][ldv]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int64_t q0 = int64_t(gridDim.x - 1 - blockIdx.x) * kBM;  // heaviest tiles first
  const int h = blockIdx.y;
  const int64_t b = blockIdx.z;  // the sequence
  const int kvh = h / p.group;
  const int Dk = p.Dk, Dv = p.Dv;

  const int64_t q_rows = min(int64_t(kBM), p.Tq - q0);  // >= 1
  const int64_t kv_end = min(p.Tk, p.q_offset + q0 + q_rows);
  const int ntiles = int((kv_end + kBN - 1) / kBN);

  const bf16* qsrc =
      static_cast<const bf16*>(p.q) + b * p.q_bstride + q0 * p.q_stride + int64_t(h) * Dk;
  const bf16* kbase = static_cast<const bf16*>(p.k) + b * p.k_bstride + int64_t(kvh) * Dk;
  const bf16* vbase = static_cast<const bf16*>(p.v) + b * p.v_bstride + int64_t(kvh) * Dv;
  const int kchunks = dkp / 8, kchunks_valid = Dk / 8;
  const int vchunks = DVP / 8, vchunks_valid = Dv / 8;

  auto load_kv = [&](int tile, int buf) {
    const int64_t key0 = int64_t(tile) * kBN;
    const int valid = int(min(int64_t(kBN), p.Tk - key0));
    load_tile(Ks + buf * kBN * ldk, ldk, kbase + key0 * p.k_stride, p.k_stride, kBN, valid, kchunks,
              kchunks_valid, tid);
    load_tile(Vs + buf * kBN * ldv, ldv, vbase + key0 * p.v_stride, p.v_stride, kBN, valid, vchunks,
              vchunks_valid, tid);
  };

  load_tile(Qs, ldk, qsrc, p.q_stride, kBM, int(q_rows), kchunks, kchunks_valid, tid);
  load_kv(0, 0);
  cp_async_commit();

  // Q (and tile 0) in place before the loop; the Q fragments of DKQ > 0 go to registers.
  cp_async_wait<0>();
  __syncthreads();
  constexpr int kQFrags = DKQ > 0 ? DKQ / 16 : 1;
  uint32_t qf[kQFrags][4];
  if constexpr (DKQ > 0) {
#pragma unroll
    for (int ks = 0; ks < kQFrags; ++ks) load_a(qf[ks], Qs, ldk, warp * 16, ks * 16, lane);
  }

  float o[DVP / 8][4];
#pragma unroll
  for (int n = 0; n < DVP / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY};  // rows g and g + 8 of the warp (log2 units)
  float l_run[2] = {0.f, 0.f};              // this thread's share of the row sums
  const float scale_log2 = p.scale * kLog2e;
  // Query positions of this thread's two rows (padded rows past Tq see every key: harmless,
  // they are never written).
  const int64_t qpos0 = p.q_offset + q0 + warp * 16 + g;
  const int64_t qpos1 = qpos0 + 8;

  for (int j = 0; j < ntiles; ++j) {
    const int buf = j & 1;
    if (j + 1 < ntiles) {
      load_kv(j + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    const bf16* Kb = Ks + buf * kBN * ldk;
    const bf16* Vb = Vs + buf * kBN * ldv;

    // S = Q K^T for this warp's 16 rows x 64 keys.
    float s[kBN / 8][4];
#pragma unroll
    for (int n = 0; n < kBN / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
    if constexpr (DKQ > 0) {
#pragma unroll
      for (int ks = 0; ks < kQFrags; ++ks) {
#pragma unroll
        for (int np = 0; np < kBN / 16; ++np) {
          uint32_t b[4];
          load_b_nk(b, Kb, ldk, ks * 16, np * 16, lane);
          mma_bf16(s[2 * np], qf[ks], b[0], b[1]);
          mma_bf16(s[2 * np + 1], qf[ks], b[2], b[3]);
        }
      }
    } else {
      for (int ks = 0; ks < dkp / 16; ++ks) {
        uint32_t a[4];
        load_a(a, Qs, ldk, warp * 16, ks * 16, lane);
#pragma unroll
        for (int np = 0; np < kBN / 16; ++np) {
          uint32_t b[4];
          load_b_nk(b, Kb, ldk, ks * 16, np * 16, lane);
          mma_bf16(s[2 * np], a, b[0], b[1]);
          mma_bf16(s[2 * np + 1], a, b[2], b[3]);
        }
      }
    }

    // Scale into log2 units; mask keys past a row's position (and past Tk).
    const int64_t key0 = int64_t(j) * kBN;
    const bool need_mask = key0 + kBN - 1 > p.q_offset + q0 || key0 + kBN > p.Tk;
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < kBN / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float val = s[n][e] * scale_log2;
        if (need_mask) {
          const int64_t key = key0 + n * 8 + 2 * t4 + (e & 1);
          const int64_t qpos = (e < 2) ? qpos0 : qpos1;
          if (key > qpos || key >= p.Tk) val = -INFINITY;
        }
        s[n][e] = val;
        mx[e >> 1] = fmaxf(mx[e >> 1], val);
      }
    }
    float alpha[2], m_use[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      const float m_new = fmaxf(m_run[r], mx[r]);
      m_use[r] = m_new == -INFINITY ? 0.f : m_new;  // a row with nothing visible yet
      alpha[r] = fast_exp2(m_run[r] - m_use[r]);
      m_run[r] = m_new;
    }
    float rowsum[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < kBN / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pv = fast_exp2(s[n][e] - m_use[e >> 1]);
        s[n][e] = pv;
        rowsum[e >> 1] += pv;
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) l_run[r] = l_run[r] * alpha[r] + rowsum[r];
#pragma unroll
    for (int n = 0; n < DVP / 8; ++n) {
      o[n][0] *= alpha[0];
      o[n][1] *= alpha[0];
      o[n][2] *= alpha[1];
      o[n][3] *= alpha[1];
    }

    // O += P V: the S accumulators of key n-tiles 2kk, 2kk+1 are the A fragment of keys
    // [16kk, 16kk + 16) (C layout (g, 2t | 2t+1), (g+8, ...) matches A's (g, 2t), (g+8, 2t),
    // (g, 2t+8), (g+8, 2t+8)).
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
      uint32_t a[4];
      a[0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
      a[1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
      a[2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      a[3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int dn = 0; dn < DVP / 16; ++dn) {
        uint32_t b[4];
        load_b_kn(b, Vb, ldv, kk * 16, dn * 16, lane);
        mma_bf16(o[2 * dn], a, b[0], b[1]);
        mma_bf16(o[2 * dn + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();  // everyone is done with buffer `buf` before it is refilled
  }

  // Row sums over the quad, normalise, write the valid rows and columns.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
  }
  const float inv[2] = {1.f / l_run[0], 1.f / l_run[1]};
  // lse in natural units: l_run is relative to m_run (log2 units), finite for every row.
  if (p.lse != nullptr && t4 == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t qi = q0 + warp * 16 + g + r * 8;
      if (qi < p.Tq) p.lse[b * p.lse_bstride + qi * p.Hq + h] = (m_run[r] + log2f(l_run[r])) * kLn2;
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t qi = q0 + warp * 16 + g + r * 8;
    if (qi >= p.Tq) continue;
    float* orow = p.o + b * p.o_bstride + (qi * p.Hq + h) * int64_t(Dv);
#pragma unroll
    for (int n = 0; n < DVP / 8; ++n) {
      const int c = n * 8 + 2 * t4;
      if (c < Dv) orow[c] = o[n][2 * r] * inv[r];
      if (c + 1 < Dv) orow[c + 1] = o[n][2 * r + 1] * inv[r];
    }
  }
}

size_t prefill_smem_bytes(int dkp, int dvp) {
  return size_t(kBM + 2 * kBN) * size_t(dkp + kPad) * 2 + size_t(2 * kBN) * size_t(dvp + kPad) * 2;
}

template <int DKQ, int DVP>
bool launch(const AttentionParams& p, int dkp, cudaStream_t stream) {
  const size_t smem = prefill_smem_bytes(dkp, DVP);
  if (smem > size_t(attention_max_smem())) return false;
  auto kernel = attention_prefill_kernel<DKQ, DVP>;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
             "cudaFuncSetAttribute (attention_prefill_kernel)");
  const dim3 grid(unsigned((p.Tq + kBM - 1) / kBM), unsigned(p.Hq), unsigned(p.batch));
  kernel<<<grid, kThreads, smem, stream>>>(p, dkp);
  check_launch("attention_prefill_kernel");
  return true;
}

}  // namespace

bool launch_attention_prefill(const AttentionParams& p, cudaStream_t stream) {
  if (p.Dk % 8 != 0 || p.Dv % 8 != 0 || p.Dk > 256 || p.Dv > 256) return false;
  if (p.q_stride % 8 != 0 || p.k_stride % 8 != 0 || p.v_stride % 8 != 0) return false;
  if (p.batch > 1 && (p.q_bstride % 8 != 0 || p.k_bstride % 8 != 0 || p.v_bstride % 8 != 0))
    return false;
  if (!aligned16(p.q) || !aligned16(p.k) || !aligned16(p.v)) return false;
  const int dkp = (p.Dk + 15) / 16 * 16;
  if (dkp == 192 && p.Dv <= 128) return launch<192, 128>(p, dkp, stream);
  if (dkp == 128 && p.Dv <= 128) return launch<128, 128>(p, dkp, stream);
  if (dkp == 64 && p.Dv <= 64) return launch<64, 64>(p, dkp, stream);
  if (p.Dv <= 32) return launch<0, 32>(p, dkp, stream);
  if (p.Dv <= 64) return launch<0, 64>(p, dkp, stream);
  if (p.Dv <= 128) return launch<0, 128>(p, dkp, stream);
  return launch<0, 256>(p, dkp, stream);
}

}  // namespace kda::ops::cuda_detail
