// Split-sequence ("flash-decoding") attention for a few queries over a long KV cache, bf16
// tensor cores, and the kernel that merges the splits.
//
// Grid (row group, split, KV head). A block's rows are (query t, head in group) pairs of one KV
// head, r = t * group + g, up to 32 rows (RB = 2 row blocks of 16; Q zero-padded), so every
// query head sharing the KV head (MLA's absorbed decode: 32 or 64 heads over one latent) reads a
// key once per step. The block walks its split's 64-key tiles, double-buffered through cp.async:
//   1. S = Q K^T: warp w takes keys [16w, 16w + 16) of the tile for all rows, full Dk;
//   2. row max of the tile through shared memory; online softmax (log2 units), P (bf16) to
//      shared memory, row sums through shared memory;
//   3. O += P V: warp w takes value columns [w DVW, (w + 1) DVW) for all rows.
// With v aliasing k (MLA: v = the first Dv values of each latent row) the V tile is the K tile.
// Each block writes (acc, m, l) of its split (see attention_kernels.cuh); attention_combine
// merges them into o.
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "ops/attention/cuda/attention_kernels.cuh"
#include "ops/common/device_attributes.h"
#include "ops/delta_rule/cuda/device_common.cuh"

namespace kda::ops::cuda_detail {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kBN = kAttentionKeyTile;  // keys per tile: 16 per warp in S = Q K^T
constexpr int kPad = 8;
constexpr int kLdp = kBN + kPad;  // P's row stride
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

static_assert(kBN == 16 * kWarps, "each warp scores 16 keys of a tile");

__device__ __forceinline__ void zero16(bf16* d) {
  *reinterpret_cast<uint4*>(d) = make_uint4(0u, 0u, 0u, 0u);
}

// RB: row blocks of 16 rows (1 or 2); DVW: value columns per warp (a multiple of 16).
template <int RB, int DVW>
__global__ void __launch_bounds__(kThreads, 1)
    attention_decode_kernel(AttentionParams p, int dkp, int dvp, bool v_alias) {
  constexpr int kRows = 16 * RB;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int ldk = dkp + kPad;
  const int ldv = v_alias ? ldk : dvp + kPad;
  bf16* Qs = reinterpret_cast<bf16*>(smem_raw);   // [kRows][ldk]
  bf16* Ks = Qs + kRows * ldk;                    // [2][kBN][ldk]
  bf16* Vs = Ks + 2 * kBN * ldk;                  // [2][kBN][ldv] (absent when aliased)
  bf16* Ps = Vs + (v_alias ? 0 : 2 * kBN * ldv);  // [kRows][kLdp]
  float* red_max = reinterpret_cast<float*>(Ps + kRows * kLdp);  // [kWarps][kRows]
  float* red_sum = red_max + kWarps * kRows;                     // [kWarps][kRows]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int kvh = blockIdx.z;
  const int split = blockIdx.y;
  const int group = p.group, Dk = p.Dk, Dv = p.Dv;
  const int64_t R = int64_t(group) * p.Tq;  // rows of this KV head
  const int64_t row0 = int64_t(blockIdx.x) * kRows;

  const KvExtent ext = kv_extent(p);
  const int64_t key_begin = int64_t(split) * p.split_len;
  const int64_t key_end = min(ext.kv_len, key_begin + p.split_len);
  if (key_begin >= key_end) {  // only past a device key count: the empty partial, acc unwritten
    write_empty_partial(p, split, kvh, row0, kRows);
    return;
  }
  const int ntiles = int((key_end - key_begin + kBN - 1) / kBN);  // >= 1

  const bf16* qbase = static_cast<const bf16*>(p.q);
  const bf16* kbase = static_cast<const bf16*>(p.k) + int64_t(kvh) * Dk;
  const bf16* vbase = static_cast<const bf16*>(p.v) + int64_t(kvh) * Dv;
  const int kchunks = dkp / 8, kchunks_valid = Dk / 8;
  const int vchunks = dvp / 8, vchunks_valid = Dv / 8;

  // Q rows: (t, head in group) -> q[t, kvh * group + gi].
  for (int idx = tid; idx < kRows * kchunks; idx += kThreads) {
    const int r = idx / kchunks, c = idx - r * kchunks;
    bf16* d = Qs + r * ldk + c * 8;
    const int64_t rr = row0 + r;
    if (rr < R && c < kchunks_valid) {
      const int64_t t = rr / group;
      const int64_t h = int64_t(kvh) * group + rr % group;
      cp_async16(d, qbase + t * p.q_stride + h * Dk + c * 8);
    } else {
      zero16(d);
    }
  }
  auto load_kv = [&](int tile, int buf) {
    const int64_t key0 = key_begin + int64_t(tile) * kBN;
    const int valid = int(min(int64_t(kBN), key_end - key0));
    bf16* Kd = Ks + buf * kBN * ldk;
    for (int idx = tid; idx < kBN * kchunks; idx += kThreads) {
      const int r = idx / kchunks, c = idx - r * kchunks;
      bf16* d = Kd + r * ldk + c * 8;
      if (r < valid && c < kchunks_valid)
        cp_async16(d, kbase + (key0 + r) * p.k_stride + c * 8);
      else
        zero16(d);
    }
    if (!v_alias) {
      bf16* Vd = Vs + buf * kBN * ldv;
      for (int idx = tid; idx < kBN * vchunks; idx += kThreads) {
        const int r = idx / vchunks, c = idx - r * vchunks;
        bf16* d = Vd + r * ldv + c * 8;
        if (r < valid && c < vchunks_valid)
          cp_async16(d, vbase + (key0 + r) * p.v_stride + c * 8);
        else
          zero16(d);
      }
    }
  };
  load_kv(0, 0);
  cp_async_commit();

  // The last visible key of this thread's rows (rb * 16 + g + 8 r2); -1 for padding rows.
  int64_t limit[RB][2];
#pragma unroll
  for (int rb = 0; rb < RB; ++rb)
#pragma unroll
    for (int r2 = 0; r2 < 2; ++r2) {
      const int64_t rr = row0 + rb * 16 + g + 8 * r2;
      limit[rb][r2] = rr < R ? ext.q_offset + rr / group : -1;
    }

  float o[RB][DVW / 8][4];
#pragma unroll
  for (int rb = 0; rb < RB; ++rb)
#pragma unroll
    for (int n = 0; n < DVW / 8; ++n) o[rb][n][0] = o[rb][n][1] = o[rb][n][2] = o[rb][n][3] = 0.f;
  float m_run[RB][2], l_run[RB][2];
#pragma unroll
  for (int rb = 0; rb < RB; ++rb) {
    m_run[rb][0] = m_run[rb][1] = -INFINITY;
    l_run[rb][0] = l_run[rb][1] = 0.f;
  }
  const float scale_log2 = p.scale * kLog2e;

  for (int j = 0; j < ntiles; ++j) {
    const int buf = j & 1;
    if (j + 1 < ntiles) {
      load_kv(j + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // tile j (and Q) in shared memory
    const bf16* Kb = Ks + buf * kBN * ldk;
    const bf16* Vb = v_alias ? Kb : Vs + buf * kBN * ldv;

    // 1. S = Q K^T for all rows x this warp's 16 keys.
    float s[RB][2][4];
#pragma unroll
    for (int rb = 0; rb < RB; ++rb)
#pragma unroll
      for (int n = 0; n < 2; ++n) s[rb][n][0] = s[rb][n][1] = s[rb][n][2] = s[rb][n][3] = 0.f;
#pragma unroll 4
    for (int ks = 0; ks < dkp / 16; ++ks) {
      uint32_t b[4];
      load_b_nk(b, Kb, ldk, ks * 16, warp * 16, lane);
#pragma unroll
      for (int rb = 0; rb < RB; ++rb) {
        uint32_t a[4];
        load_a(a, Qs, ldk, rb * 16, ks * 16, lane);
        mma_bf16(s[rb][0], a, b[0], b[1]);
        mma_bf16(s[rb][1], a, b[2], b[3]);
      }
    }

    // 2. Scale, mask, row max of the tile over the 4 warps.
    const int64_t key0 = key_begin + int64_t(j) * kBN + warp * 16;
#pragma unroll
    for (int rb = 0; rb < RB; ++rb) {
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t key = key0 + n * 8 + 2 * t4 + (e & 1);
          float val = s[rb][n][e] * scale_log2;
          if (key >= key_end || key > limit[rb][e >> 1]) val = -INFINITY;
          s[rb][n][e] = val;
          mx[e >> 1] = fmaxf(mx[e >> 1], val);
        }
#pragma unroll
      for (int r2 = 0; r2 < 2; ++r2) {
        mx[r2] = fmaxf(mx[r2], __shfl_xor_sync(0xffffffffu, mx[r2], 1));
        mx[r2] = fmaxf(mx[r2], __shfl_xor_sync(0xffffffffu, mx[r2], 2));
        if (t4 == 0) red_max[warp * kRows + rb * 16 + g + 8 * r2] = mx[r2];
      }
    }
    __syncthreads();

    float alpha[RB][2];
#pragma unroll
    for (int rb = 0; rb < RB; ++rb) {
      float m_use[2];
#pragma unroll
      for (int r2 = 0; r2 < 2; ++r2) {
        const int row = rb * 16 + g + 8 * r2;
        float mt = red_max[row];
#pragma unroll
        for (int w = 1; w < kWarps; ++w) mt = fmaxf(mt, red_max[w * kRows + row]);
        const float m_new = fmaxf(m_run[rb][r2], mt);
        m_use[r2] = m_new == -INFINITY ? 0.f : m_new;  // nothing visible yet in this row
        alpha[rb][r2] = fast_exp2(m_run[rb][r2] - m_use[r2]);
        m_run[rb][r2] = m_new;
      }
      float rowsum[2] = {0.f, 0.f};
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float pv = fast_exp2(s[rb][n][e] - m_use[e >> 1]);
          s[rb][n][e] = pv;
          rowsum[e >> 1] += pv;
        }
        const int col = warp * 16 + n * 8 + 2 * t4;
        *reinterpret_cast<uint32_t*>(Ps + (rb * 16 + g) * kLdp + col) =
            pack_bf16(s[rb][n][0], s[rb][n][1]);
        *reinterpret_cast<uint32_t*>(Ps + (rb * 16 + g + 8) * kLdp + col) =
            pack_bf16(s[rb][n][2], s[rb][n][3]);
      }
#pragma unroll
      for (int r2 = 0; r2 < 2; ++r2) {
        rowsum[r2] += __shfl_xor_sync(0xffffffffu, rowsum[r2], 1);
        rowsum[r2] += __shfl_xor_sync(0xffffffffu, rowsum[r2], 2);
        if (t4 == 0) red_sum[warp * kRows + rb * 16 + g + 8 * r2] = rowsum[r2];
      }
#pragma unroll
      for (int n = 0; n < DVW / 8; ++n) {
        o[rb][n][0] *= alpha[rb][0];
        o[rb][n][1] *= alpha[rb][0];
        o[rb][n][2] *= alpha[rb][1];
        o[rb][n][3] *= alpha[rb][1];
      }
    }
    __syncthreads();  // P and the row sums complete

#pragma unroll
    for (int rb = 0; rb < RB; ++rb)
#pragma unroll
      for (int r2 = 0; r2 < 2; ++r2) {
        const int row = rb * 16 + g + 8 * r2;
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) sum += red_sum[w * kRows + row];
        l_run[rb][r2] = l_run[rb][r2] * alpha[rb][r2] + sum;
      }

      // 3. O += P V for this warp's value columns.
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
      uint32_t a[RB][4];
#pragma unroll
      for (int rb = 0; rb < RB; ++rb) load_a(a[rb], Ps, kLdp, rb * 16, kk * 16, lane);
#pragma unroll
      for (int dn = 0; dn < DVW / 16; ++dn) {
        uint32_t b[4];
        load_b_kn(b, Vb, ldv, kk * 16, warp * DVW + dn * 16, lane);
#pragma unroll
        for (int rb = 0; rb < RB; ++rb) {
          mma_bf16(o[rb][2 * dn], a[rb], b[0], b[1]);
          mma_bf16(o[rb][2 * dn + 1], a[rb], b[2], b[3]);
        }
      }
    }
    __syncthreads();  // buffer `buf`, P and the reductions are free again
  }

  // Partials of this split: acc (unnormalised), m (natural log units), l.
  const int64_t rows_total = p.Tq * p.Hq;
#pragma unroll
  for (int rb = 0; rb < RB; ++rb)
#pragma unroll
    for (int r2 = 0; r2 < 2; ++r2) {
      const int64_t rr = row0 + rb * 16 + g + 8 * r2;
      if (rr >= R) continue;
      const int64_t t = rr / group;
      const int64_t h = int64_t(kvh) * group + rr % group;
      const int64_t prow = int64_t(split) * rows_total + t * p.Hq + h;
      float* arow = p.part_acc + prow * Dv;
#pragma unroll
      for (int n = 0; n < DVW / 8; ++n) {
        const int c = warp * DVW + n * 8 + 2 * t4;
        if (c < Dv) arow[c] = o[rb][n][2 * r2];
        if (c + 1 < Dv) arow[c + 1] = o[rb][n][2 * r2 + 1];
      }
      if (warp == 0 && t4 == 0) {
        const float m = m_run[rb][r2];
        p.part_m[prow] = m == -INFINITY ? -INFINITY : m * kLn2;
        p.part_l[prow] = l_run[rb][r2];
      }
    }
}

// Block (row, chunk of kCombineCols value columns): the split weights exp(m_s - M) and the
// normaliser once in shared memory, then warp w sums splits w, w + 8, ... for its lane's VEC
// columns (independent loads in flight), and the 8 warp sums are added in shared memory.
constexpr int kCombineWarps = 8;
constexpr int kCombineThreads = 32 * kCombineWarps;
static_assert(kCombineThreads >= kAttentionMaxSplits, "one thread per split for the weights");

// SKIP_EMPTY (with a device key count): a zero-weight split's acc is not read (empty splits
// leave it unwritten).
template <int VEC, bool SKIP_EMPTY>
__global__ void __launch_bounds__(kCombineThreads) attention_combine_kernel(AttentionParams p) {
  constexpr int kCols = 32 * VEC;
  __shared__ float weight[kAttentionMaxSplits];
  __shared__ float red[kCombineWarps];
  __shared__ float acc_s[kCombineWarps][kCols];
  const int64_t rows = p.Tq * p.Hq;
  const int64_t row = blockIdx.x;
  const int nsplit = p.nsplit, Dv = p.Dv;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched as a programmatic dependent of the decode kernel (sm_90): wait for its partials.
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif

  const float ms = tid < nsplit ? p.part_m[int64_t(tid) * rows + row] : -INFINITY;
  const float ls = tid < nsplit ? p.part_l[int64_t(tid) * rows + row] : 0.f;
  float mx = ms;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if (lane == 0) red[warp] = mx;
  __syncthreads();
  float M = red[0];
#pragma unroll
  for (int w = 1; w < kCombineWarps; ++w) M = fmaxf(M, red[w]);
  const float wt = ms == -INFINITY ? 0.f : expf(ms - M);
  if (tid < nsplit) weight[tid] = wt;
  float lw = wt != 0.f ? wt * ls : 0.f;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) lw += __shfl_xor_sync(0xffffffffu, lw, o);
  __syncthreads();  // every thread has read red (the max)
  if (lane == 0) red[warp] = lw;
  __syncthreads();
  float L = 0.f;
#pragma unroll
  for (int w = 0; w < kCombineWarps; ++w) L += red[w];
  const float inv_l = 1.f / L;  // split 0 holds key 0, visible to every row: L >= 1

  const int c = blockIdx.y * kCols + lane * VEC;
  float acc[VEC] = {};
  if (c < Dv) {
    // Every split wrote its acc (0 where it saw no key): load unconditionally so the loads
    // overlap, and let a zero weight select 0 (no 0 * inf).
#pragma unroll 4
    for (int s = warp; s < nsplit; s += kCombineWarps) {
      const float w = weight[s];
      if constexpr (SKIP_EMPTY) {
        if (w == 0.f) continue;  // warp-uniform
      }
      const float* src = p.part_acc + (int64_t(s) * rows + row) * Dv + c;
      float v[VEC];
      if constexpr (VEC == 4) {
        const float4 v4 = *reinterpret_cast<const float4*>(src);
        v[0] = v4.x, v[1] = v4.y, v[2] = v4.z, v[3] = v4.w;
      } else {
        v[0] = src[0];
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[e] += w != 0.f ? w * v[e] : 0.f;
    }
  }
#pragma unroll
  for (int e = 0; e < VEC; ++e) acc_s[warp][lane * VEC + e] = acc[e];
  __syncthreads();
  for (int i = tid; i < kCols; i += kCombineThreads) {
    const int col = blockIdx.y * kCols + i;
    if (col >= Dv) continue;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kCombineWarps; ++w) sum += acc_s[w][i];
    p.o[row * Dv + col] = sum * inv_l;
  }
}

size_t decode_smem_bytes(int rows, int dkp, int dvp, bool v_alias) {
  size_t elems = size_t(rows) * (dkp + kPad) + size_t(2 * kBN) * (dkp + kPad);
  if (!v_alias) elems += size_t(2 * kBN) * (dvp + kPad);
  elems += size_t(rows) * kLdp;
  return elems * 2 + size_t(2 * kWarps * rows) * sizeof(float);
}

template <int RB, int DVW>
bool launch(const AttentionParams& p, int dkp, bool v_alias, cudaStream_t stream) {
  constexpr int kRows = 16 * RB;
  const int dvp = DVW * kWarps;
  const size_t smem = decode_smem_bytes(kRows, dkp, dvp, v_alias);
  if (smem > size_t(device_max_smem_optin())) return false;
  auto kernel = attention_decode_kernel<RB, DVW>;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
             "cudaFuncSetAttribute (attention_decode_kernel)");
  const int64_t R = int64_t(p.group) * p.Tq;
  const dim3 grid(unsigned((R + kRows - 1) / kRows), unsigned(p.nsplit), unsigned(p.Hkv));
  kernel<<<grid, kThreads, smem, stream>>>(p, dkp, dvp, v_alias);
  check_launch("attention_decode_kernel");
  return true;
}

template <int RB>
bool launch_rows(const AttentionParams& p, int dkp, bool v_alias, cudaStream_t stream) {
  if (p.Dv <= 16 * kWarps) return launch<RB, 16>(p, dkp, v_alias, stream);
  if (p.Dv <= 32 * kWarps) return launch<RB, 32>(p, dkp, v_alias, stream);
  if (p.Dv <= 64 * kWarps) return launch<RB, 64>(p, dkp, v_alias, stream);
  return launch<RB, 128>(p, dkp, v_alias, stream);
}

}  // namespace

bool launch_attention_decode(const AttentionParams& p, cudaStream_t stream) {
  if (p.nsplit < 1 || p.nsplit > kAttentionMaxSplits || p.split_len < 1) return false;
  if (p.Dk % 8 != 0 || p.Dv % 8 != 0 || p.Dv > 128 * kWarps) return false;
  if (p.q_stride % 8 != 0 || p.k_stride % 8 != 0 || p.v_stride % 8 != 0) return false;
  if (!aligned16(p.q) || !aligned16(p.k) || !aligned16(p.v)) return false;
  const int dkp = (p.Dk + 15) / 16 * 16;
  // The value columns a warp covers, rounded up: all of them must lie inside the K tile's row
  // for the aliased V tile to be the K tile.
  const int dvw = p.Dv <= 64 ? 16 : p.Dv <= 128 ? 32 : p.Dv <= 256 ? 64 : 128;
  const bool v_alias =
      p.v == p.k && p.v_stride == p.k_stride && p.Hkv == 1 && p.Dv <= p.Dk && dvw * kWarps <= dkp;
  const int64_t R = int64_t(p.group) * p.Tq;
  if (R <= 16) return launch_rows<1>(p, dkp, v_alias, stream);
  return launch_rows<2>(p, dkp, v_alias, stream);
}

void launch_attention_combine(const AttentionParams& p, cudaStream_t stream) {
  if (p.nsplit < 1 || p.nsplit > kAttentionMaxSplits)
    throw kda::Error("attention_forward: bad split count (internal)");
  const unsigned rows = unsigned(p.Tq * p.Hq);
  const bool vec4 = p.Dv % 4 == 0 && (reinterpret_cast<uintptr_t>(p.part_acc) & 15u) == 0;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(rows, unsigned((p.Dv + (vec4 ? 127 : 31)) / (vec4 ? 128 : 32)));
  config.blockDim = dim3(kCombineThreads);
  config.stream = stream;
  // sm_90: programmatic dependent launch, so this grid is scheduled while the decode kernel
  // finishes (it waits for the partials with griddepcontrol.wait).
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  if (device_cc_major() >= 9) {
    config.attrs = &attribute;
    config.numAttrs = 1;
  }
  cudaError_t status;
  if (p.kv_len_device != nullptr)
    status = vec4 ? cudaLaunchKernelEx(&config, attention_combine_kernel<4, true>, p)
                  : cudaLaunchKernelEx(&config, attention_combine_kernel<1, true>, p);
  else
    status = vec4 ? cudaLaunchKernelEx(&config, attention_combine_kernel<4, false>, p)
                  : cudaLaunchKernelEx(&config, attention_combine_kernel<1, false>, p);
  check_cuda(status, "attention_combine_kernel launch");
  check_launch("attention_combine_kernel");
}

}  // namespace kda::ops::cuda_detail
