// Split-sequence decode attention (bf16, sm_90) fed by bulk copies: the bandwidth path for a few
// queries over a long KV cache, above all MLA's absorbed decode (32 query heads over one 576-wide
// latent, v = its first 512 values).
//
// Grid (row group, split, KV head); 8 warps; a block's rows are (query t, head in group) pairs
// of one KV head, r = t * group + g, up to 32 (RB row blocks of 16, zero-padded), so every head
// sharing the KV head reads a key once. The block walks its split's 32-key tiles through a
// kStages-deep ring of shared-memory buffers that warp 0 fills with one cp.async.bulk per key
// row (completion on an mbarrier; no per-thread copy instructions), so several tiles are in
// flight while the block computes. Per tile:
//   1. S = Q K^T on tensor cores: warp w takes keys [16 (w / 4), +16) and a quarter of Dk, with
//      its Q fragments held in registers for the whole walk; partial sums go to shared memory;
//   2. softmax: each row is spread over 8 or 16 lanes (2 or 4 keys each): they sum the four
//      partials, keep the row's running max and sum (log2 units), write P (bf16) and the
//      rescale factor;
//   3. O += P V on tensor cores: warp w owns value columns [w DVP / 8, (w + 1) DVP / 8).
// Keys past the split's end are clamped to its last key (finite data, zero weight), so a short
// tile needs no zero fill; padding columns (Dk < DKP, Dv < DVP) are zeroed once.
// Each block writes (acc, m, l) of its split (see attention_kernels.cuh).
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "ops/attention/cuda/attention_kernels.cuh"
#include "ops/common/async_copy.cuh"
#include "ops/common/device_attributes.h"
#include "ops/delta_rule/cuda/device_common.cuh"

namespace kda::ops::cuda_detail {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kBN = kAttentionBulkKeyTile;  // keys per tile (one bulk copy per lane of warp 0)
constexpr int kStages = 4;
constexpr int kDimGroups = 4;  // warps splitting Dk in S = Q K^T
constexpr int kKeyGroups = kWarps / kDimGroups;
constexpr int kLds = kBN + 8;  // row stride (floats) of the partial scores
constexpr int kLdp = kBN + 8;  // row stride (bf16) of P
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

static_assert(kBN == 32, "one key row per lane of the issuing warp; one key per lane in softmax");
static_assert(kBN == 16 * kKeyGroups, "each key group scores 16 keys");

template <int RB, int DKP, int DVP, bool VA>
struct BulkShape {
  static constexpr int kRows = 16 * RB;
  static constexpr int kLdk = DKP + 8;  // odd multiple of 16 bytes: conflict-free ldmatrix
  static constexpr int kLdv = VA ? kLdk : DVP + 8;
  static constexpr int kStageElems = kBN * kLdk + (VA ? 0 : kBN * kLdv);
  static constexpr int kKs = DKP / (16 * kDimGroups);  // k16 steps of a dim group
  static constexpr int kDvw = DVP / kWarps;            // value columns per warp
  static constexpr size_t kStageOffset = 128;          // mbarriers first
  static constexpr size_t kSmem = kStageOffset + size_t(kStages) * kStageElems * 2 +
                                  size_t(kDimGroups) * kRows * kLds * 4 + size_t(kRows) * kLdp * 2 +
                                  size_t(kRows) * 4;
  static_assert(DKP % (16 * kDimGroups) == 0, "DKP must split into 4 groups of k16 steps");
  static_assert(kDvw % 16 == 0, "each warp's value columns must be whole n16 blocks");
  static_assert(!VA || DVP <= DKP, "an aliased V tile lies inside the K tile");
};

template <int RB, int DKP, int DVP, bool VA>
__global__ void __launch_bounds__(kThreads, 1) attention_decode_bulk_kernel(AttentionParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using S = BulkShape<RB, DKP, DVP, VA>;
  constexpr int kRows = S::kRows;
  constexpr int kKpt = kRows * kBN / kThreads;  // softmax keys per thread (2 or 4)
  constexpr int kLpr = kBN / kKpt;              // softmax lanes per row (16 or 8)
  static_assert(kKpt % 2 == 0 && kLpr <= 32, "softmax mapping");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem_raw);  // [kStages]
  bf16* stages = reinterpret_cast<bf16*>(smem_raw + S::kStageOffset);
  float* sred = reinterpret_cast<float*>(stages + kStages * S::kStageElems);  // [4][kRows][kLds]
  bf16* ps = reinterpret_cast<bf16*>(sred + kDimGroups * kRows * kLds);       // [kRows][kLdp]
  float* alpha_s = reinterpret_cast<float*>(ps + kRows * kLdp);               // [kRows]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int dgroup = warp % kDimGroups, kgroup = warp / kDimGroups;
  const int kvh = blockIdx.z, split = blockIdx.y;
  const int group = p.group, Dk = p.Dk, Dv = p.Dv;
  const int64_t R = int64_t(group) * p.Tq;
  const int64_t row0 = int64_t(blockIdx.x) * kRows;

  const KvExtent ext = kv_extent(p);
  const int64_t key_begin = int64_t(split) * p.split_len;
  const int64_t key_end = min(ext.kv_len, key_begin + p.split_len);

  const bf16* kbase = static_cast<const bf16*>(p.k) + int64_t(kvh) * Dk;
  const bf16* vbase = static_cast<const bf16*>(p.v) + int64_t(kvh) * Dv;
  const uint32_t tile_bytes = uint32_t(kBN) * uint32_t(2 * Dk + (VA ? 0 : 2 * Dv));

  // The combine kernel may launch now (programmatic dependent launch); it waits for this grid.
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  if (key_begin >= key_end) {  // only past a device key count: the empty partial, acc unwritten
    write_empty_partial(p, split, kvh, row0, kRows);
    return;
  }
  const int ntiles = int((key_end - key_begin + kBN - 1) / kBN);  // >= 1
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) mbar_init(&full[s], 1);
    mbar_init_fence();
  }
  // Padding columns the copies never write; P and alpha of padding rows stay finite.
  if (Dk < DKP) {
    for (int idx = tid; idx < kStages * kBN * (DKP - Dk); idx += kThreads) {
      const int c = Dk + idx % (DKP - Dk), r = idx / (DKP - Dk);
      stages[(r / kBN) * S::kStageElems + (r % kBN) * S::kLdk + c] = __float2bfloat16_rn(0.f);
    }
  }
  if (!VA && Dv < DVP) {
    for (int idx = tid; idx < kStages * kBN * (DVP - Dv); idx += kThreads) {
      const int c = Dv + idx % (DVP - Dv), r = idx / (DVP - Dv);
      stages[(r / kBN) * S::kStageElems + kBN * S::kLdk + (r % kBN) * S::kLdv + c] =
          __float2bfloat16_rn(0.f);
    }
  }
  for (int idx = tid; idx < kRows * kLdp; idx += kThreads) ps[idx] = __float2bfloat16_rn(0.f);
  if (tid < kRows) alpha_s[tid] = 0.f;
  __syncthreads();

  // Warp 0 fills stage tile % kStages with tile `tile`: one key row per lane. The stage's
  // previous reads finished before the __syncthreads that precedes its refill (as in CUTLASS's
  // TMA pipelines, no proxy fence; measured: one here changed nothing).
  auto issue = [&](int tile) {
    const int s = tile % kStages;
    if (lane == 0) mbar_expect_tx(&full[s], tile_bytes);
    __syncwarp();
    const int64_t key = min(key_begin + int64_t(tile) * kBN + lane, key_end - 1);
    bf16* dst = stages + s * S::kStageElems;
    bulk_copy(dst + lane * S::kLdk, kbase + key * p.k_stride, uint32_t(2 * Dk), &full[s]);
    if (!VA)
      bulk_copy(dst + kBN * S::kLdk + lane * S::kLdv, vbase + key * p.v_stride, uint32_t(2 * Dv),
                &full[s]);
  };
  if (warp == 0)
    for (int t = 0; t < min(kStages, ntiles); ++t) issue(t);

  // Q fragments of this warp's dim group, straight from global memory (read once per block).
  uint32_t qf[RB][S::kKs][4];
  {
    const bf16* qbase = static_cast<const bf16*>(p.q);
#pragma unroll
    for (int rb = 0; rb < RB; ++rb)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t rr = row0 + rb * 16 + g + 8 * half;
        const bf16* qrow = nullptr;
        if (rr < R)
          qrow = qbase + (rr / group) * p.q_stride + (int64_t(kvh) * group + rr % group) * Dk;
#pragma unroll
        for (int ks = 0; ks < S::kKs; ++ks)
#pragma unroll
          for (int hi = 0; hi < 2; ++hi) {
            const int col = (dgroup * S::kKs + ks) * 16 + 2 * t4 + 8 * hi;
            uint32_t v = 0;
            if (qrow != nullptr && col < Dk) v = *reinterpret_cast<const uint32_t*>(qrow + col);
            qf[rb][ks][half + 2 * hi] = v;
          }
      }
  }

  // Softmax: thread tid owns keys [kKpt * (tid % kLpr), +kKpt) of row tid / kLpr; its row's
  // last visible key (-1 for padding rows) and running max and sum.
  const int srow = tid / kLpr, skey = (tid % kLpr) * kKpt;
  const int64_t srr = row0 + srow;
  const int64_t limit = srr < R ? ext.q_offset + srr / group : -1;
  float m_run = -INFINITY, l_run = 0.f;
  float o[RB][S::kDvw / 8][4];
#pragma unroll
  for (int rb = 0; rb < RB; ++rb)
#pragma unroll
    for (int n = 0; n < S::kDvw / 8; ++n)
      o[rb][n][0] = o[rb][n][1] = o[rb][n][2] = o[rb][n][3] = 0.f;
  const float scale_log2 = p.scale * kLog2e;

  for (int j = 0; j < ntiles; ++j) {
    const int s = j % kStages;
    mbar_wait(&full[s], uint32_t((j / kStages) & 1));
    const bf16* Kb = stages + s * S::kStageElems;
    const bf16* Vb = VA ? Kb : Kb + kBN * S::kLdk;

    // 1. Partial S over this warp's dims for its 16 keys.
    float sc[RB][2][4];
#pragma unroll
    for (int rb = 0; rb < RB; ++rb)
#pragma unroll
      for (int n = 0; n < 2; ++n) sc[rb][n][0] = sc[rb][n][1] = sc[rb][n][2] = sc[rb][n][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < S::kKs; ++ks) {
      uint32_t b[4];
      load_b_nk(b, Kb, S::kLdk, (dgroup * S::kKs + ks) * 16, kgroup * 16, lane);
#pragma unroll
      for (int rb = 0; rb < RB; ++rb) {
        mma_bf16(sc[rb][0], qf[rb][ks], b[0], b[1]);
        mma_bf16(sc[rb][1], qf[rb][ks], b[2], b[3]);
      }
    }
#pragma unroll
    for (int rb = 0; rb < RB; ++rb)
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const int key = kgroup * 16 + n * 8 + 2 * t4;
        float* d = sred + (dgroup * kRows + rb * 16 + g) * kLds + key;
        *reinterpret_cast<float2*>(d) = make_float2(sc[rb][n][0], sc[rb][n][1]);
        *reinterpret_cast<float2*>(d + 8 * kLds) = make_float2(sc[rb][n][2], sc[rb][n][3]);
      }
    __syncthreads();  // partial scores complete; every warp is done with tile j - 1

    if (warp == 0 && j >= 1 && j - 1 + kStages < ntiles) issue(j - 1 + kStages);

    // 2. Online softmax; the kLpr lanes of a row reduce through shuffles.
    {
      float sv[kKpt];
#pragma unroll
      for (int e = 0; e < kKpt; e += 2) {
        float2 acc = make_float2(0.f, 0.f);
#pragma unroll
        for (int dg = 0; dg < kDimGroups; ++dg) {
          const float2 v =
              *reinterpret_cast<const float2*>(sred + (dg * kRows + srow) * kLds + skey + e);
          acc.x += v.x;
          acc.y += v.y;
        }
        sv[e] = acc.x;
        sv[e + 1] = acc.y;
      }
      const int64_t key0 = key_begin + int64_t(j) * kBN + skey;
      float mt = -INFINITY;
#pragma unroll
      for (int e = 0; e < kKpt; ++e) {
        const int64_t key = key0 + e;
        sv[e] = key >= key_end || key > limit ? -INFINITY : sv[e] * scale_log2;
        mt = fmaxf(mt, sv[e]);
      }
#pragma unroll
      for (int o = kLpr / 2; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, o));
      const float m_new = fmaxf(m_run, mt);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;  // nothing visible yet in this row
      const float alpha = fast_exp2(m_run - m_use);
      float sum = 0.f;
      uint32_t packed[kKpt / 2];
#pragma unroll
      for (int e = 0; e < kKpt; e += 2) {
        const float p0 = fast_exp2(sv[e] - m_use), p1 = fast_exp2(sv[e + 1] - m_use);
        sum += p0 + p1;
        packed[e / 2] = pack_bf16(p0, p1);
      }
#pragma unroll
      for (int o = kLpr / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      l_run = l_run * alpha + sum;
      m_run = m_new;
      bf16* pd = ps + srow * kLdp + skey;
      if constexpr (kKpt == 2) {
        *reinterpret_cast<uint32_t*>(pd) = packed[0];
      } else {
#pragma unroll
        for (int e = 0; e < kKpt / 4; ++e)
          *reinterpret_cast<uint2*>(pd + 4 * e) = make_uint2(packed[2 * e], packed[2 * e + 1]);
      }
      if (skey == 0) alpha_s[srow] = alpha;
    }
    __syncthreads();  // P and alpha complete

    // 3. O = alpha O + P V for this warp's value columns.
#pragma unroll
    for (int rb = 0; rb < RB; ++rb) {
      const float a0 = alpha_s[rb * 16 + g], a1 = alpha_s[rb * 16 + g + 8];
#pragma unroll
      for (int n = 0; n < S::kDvw / 8; ++n) {
        o[rb][n][0] *= a0;
        o[rb][n][1] *= a0;
        o[rb][n][2] *= a1;
        o[rb][n][3] *= a1;
      }
    }
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
      uint32_t a[RB][4];
#pragma unroll
      for (int rb = 0; rb < RB; ++rb) load_a(a[rb], ps, kLdp, rb * 16, kk * 16, lane);
#pragma unroll
      for (int dn = 0; dn < S::kDvw / 16; ++dn) {
        uint32_t b[4];
        load_b_kn(b, Vb, S::kLdv, kk * 16, warp * S::kDvw + dn * 16, lane);
#pragma unroll
        for (int rb = 0; rb < RB; ++rb) {
          mma_bf16(o[rb][2 * dn], a[rb], b[0], b[1]);
          mma_bf16(o[rb][2 * dn + 1], a[rb], b[2], b[3]);
        }
      }
    }
  }

  // Partials of this split: acc (unnormalised), m (natural log units), l.
  const int64_t rows_total = p.Tq * p.Hq;
#pragma unroll
  for (int rb = 0; rb < RB; ++rb)
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t rr = row0 + rb * 16 + g + 8 * half;
      if (rr >= R) continue;
      const int64_t prow =
          int64_t(split) * rows_total + (rr / group) * p.Hq + int64_t(kvh) * group + rr % group;
      float* arow = p.part_acc + prow * Dv;
#pragma unroll
      for (int n = 0; n < S::kDvw / 8; ++n) {
        const int c = warp * S::kDvw + n * 8 + 2 * t4;  // Dv is even: c < Dv covers c + 1
        if (c < Dv)
          *reinterpret_cast<float2*>(arow + c) =
              make_float2(o[rb][n][2 * half], o[rb][n][2 * half + 1]);
      }
    }
  if (skey == 0 && limit >= 0) {
    const int64_t prow =
        int64_t(split) * rows_total + (srr / group) * p.Hq + int64_t(kvh) * group + srr % group;
    p.part_m[prow] = m_run == -INFINITY ? -INFINITY : m_run * kLn2;
    p.part_l[prow] = l_run;
  }
#endif
}

// One instantiation's launcher and its co-resident blocks per SM (0 when it cannot run here).
template <int RB, int DKP, int DVP, bool VA>
struct BulkKernel {
  using S = BulkShape<RB, DKP, DVP, VA>;

  // Opts into the shared memory once per device; 0 when the device lacks it.
  static int blocks_per_sm() {
    static int cached[64] = {};
    int device = 0;
    check_cuda(cudaGetDevice(&device), "cudaGetDevice");
    if (device < 0 || device >= 64) device = 0;
    if (cached[device] == 0) {
      int blocks = -1;
      if (S::kSmem <= size_t(device_max_smem_optin())) {
        auto kernel = attention_decode_bulk_kernel<RB, DKP, DVP, VA>;
        check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        int(S::kSmem)),
                   "cudaFuncSetAttribute (attention_decode_bulk_kernel)");
        int n = 0;
        check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, S::kSmem),
                   "cudaOccupancyMaxActiveBlocksPerMultiprocessor (attention_decode_bulk_kernel)");
        if (n > 0) blocks = n;
      }
      cached[device] = blocks;
    }
    return cached[device] > 0 ? cached[device] : 0;
  }

  static bool launch(const AttentionParams& p, cudaStream_t stream) {
    if (blocks_per_sm() == 0) return false;
    const int64_t R = int64_t(p.group) * p.Tq;
    const dim3 grid(unsigned((R + S::kRows - 1) / S::kRows), unsigned(p.nsplit), unsigned(p.Hkv));
    attention_decode_bulk_kernel<RB, DKP, DVP, VA><<<grid, kThreads, S::kSmem, stream>>>(p);
    check_launch("attention_decode_bulk_kernel");
    return true;
  }
};

// Only MLA's absorbed decode (576/512, v aliasing k) runs here. Small heads (GPT-2's 64/64,
// padded to 64/128) ran slower here than in the cp.async kernel (35 vs 30 us at Tk = 8192, 12
// heads): a tile costs about 2 us whatever its bytes, which points at the per-copy cost of 32
// to 64 small bulk copies per tile. The kernel itself also takes separate V (VA = false).
bool takes(int64_t Dk, int64_t Dv, bool v_alias) {
  return v_alias && Dk % 8 == 0 && Dv % 8 == 0 && Dk > 256 && Dk <= 576 && Dv <= 512;
}

}  // namespace

int attention_decode_bulk_blocks_per_sm(int64_t Dk, int64_t Dv, int64_t rows_per_kv_head,
                                        bool v_alias) {
  if (!takes(Dk, Dv, v_alias) || device_cc_major() < 9) return 0;
  return rows_per_kv_head <= 16 ? BulkKernel<1, 576, 512, true>::blocks_per_sm()
                                : BulkKernel<2, 576, 512, true>::blocks_per_sm();
}

bool launch_attention_decode_bulk(const AttentionParams& p, cudaStream_t stream) {
  if (p.nsplit < 1 || p.nsplit > kAttentionMaxSplits || p.split_len % kBN != 0) return false;
  if (p.q_stride % 8 != 0 || p.k_stride % 8 != 0 || p.v_stride % 8 != 0) return false;
  if (!aligned16(p.q) || !aligned16(p.k) || !aligned16(p.v)) return false;
  const bool v_alias = p.v == p.k && p.v_stride == p.k_stride && p.Hkv == 1 && p.Dv <= p.Dk;
  if (!takes(p.Dk, p.Dv, v_alias) || device_cc_major() < 9) return false;
  const int64_t R = int64_t(p.group) * p.Tq;
  return R <= 16 ? BulkKernel<1, 576, 512, true>::launch(p, stream)
                 : BulkKernel<2, 576, 512, true>::launch(p, stream);
}

}  // namespace kda::ops::cuda_detail
