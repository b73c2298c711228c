// The plain attention kernel: one warp per query row (t, h), keys one at a time with an online
// softmax in fp32 (exact expf, warp-reduced dot products). The fp32 path (held to 1e-4 against
// the CPU on whole models), and the fallback for bf16 layouts the tensor-core kernels do not
// take (unaligned strides, head dims not a multiple of 8, too little shared memory). Grid: (row
// blocks, splits or 1, batch): sequence b = blockIdx.z (split decode has batch == 1).
#include <cuda_bf16.h>

#include <cmath>

#include "ops/attention/cuda/attention_kernels.cuh"
#include "ops/delta_rule/cuda/device_common.cuh"

namespace kda::ops::cuda_detail {

namespace {

constexpr int kGenericWarps = 4;
constexpr int kQChunks = (kAttentionMaxDk + 31) / 32;  // per-lane q values (d = lane + 32 i)
constexpr int kVChunks = (kAttentionMaxDv + 31) / 32;  // per-lane accumulators

template <class T>
__global__ void __launch_bounds__(32 * kGenericWarps) attention_generic_kernel(AttentionParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kGenericWarps + (threadIdx.x >> 5);
  if (row >= p.Tq * p.Hq) return;  // whole warps leave; no block-wide sync below
  const int64_t t = row / p.Hq;
  const int h = int(row % p.Hq);
  const int kvh = h / p.group;
  const int Dk = p.Dk, Dv = p.Dv;
  const int64_t b = blockIdx.z;  // the sequence (0 on the split path)

  // Keys of this launch: all visible ones (direct), or this split's share of them (none for a
  // split at or past a device key count: the loop is skipped and it writes the empty partial).
  const KvExtent ext = kv_extent(p);
  const int64_t visible_end = min(ext.q_offset + t + 1, p.Tk);
  int64_t key_begin = 0, key_end = visible_end;
  if (p.nsplit > 0) {
    key_begin = int64_t(blockIdx.y) * p.split_len;
    key_end = min(visible_end, key_begin + p.split_len);
  }

  const T* qrow = static_cast<const T*>(p.q) + b * p.q_bstride + t * p.q_stride + int64_t(h) * Dk;
  float qv[kQChunks];
#pragma unroll
  for (int i = 0; i < kQChunks; ++i) {
    const int d = lane + 32 * i;
    qv[i] = d < Dk ? to_f32(qrow[d]) : 0.f;
  }
  float acc[kVChunks];
#pragma unroll
  for (int i = 0; i < kVChunks; ++i) acc[i] = 0.f;
  float m = -INFINITY, l = 0.f;

  const T* kbase = static_cast<const T*>(p.k) + b * p.k_bstride + int64_t(kvh) * Dk;
  const T* vbase = static_cast<const T*>(p.v) + b * p.v_bstride + int64_t(kvh) * Dv;
  for (int64_t j = key_begin; j < key_end; ++j) {
    const T* krow = kbase + j * p.k_stride;
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < kQChunks; ++i) {
      const int d = lane + 32 * i;
      if (d < Dk) dot = fmaf(qv[i], to_f32(krow[d]), dot);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
      dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    const float s = dot * p.scale;
    if (s > m) {  // new running max: rescale what came before (exp(-inf) = 0 on the first key)
      const float alpha = expf(m - s);
      m = s;
      l *= alpha;
#pragma unroll
      for (int i = 0; i < kVChunks; ++i) acc[i] *= alpha;
    }
    const float pj = expf(s - m);
    l += pj;
    const T* vrow = vbase + j * p.v_stride;
#pragma unroll
    for (int i = 0; i < kVChunks; ++i) {
      const int d = lane + 32 * i;
      if (d < Dv) acc[i] = fmaf(pj, to_f32(vrow[d]), acc[i]);
    }
  }

  if (p.nsplit == 0) {
    const float inv = 1.f / l;  // l >= 1: key 0 is always visible
    const int64_t orow = b * p.o_bstride + row * Dv;
#pragma unroll
    for (int i = 0; i < kVChunks; ++i) {
      const int d = lane + 32 * i;
      if (d >= Dv) continue;
      if (p.o_bf16 != nullptr)
        static_cast<__nv_bfloat16*>(p.o_bf16)[orow + d] = __float2bfloat16_rn(acc[i] * inv);
      else
        p.o[orow + d] = acc[i] * inv;
    }
    if (p.lse != nullptr && lane == 0) p.lse[b * p.lse_bstride + row] = m + logf(l);
  } else {
    const int64_t rows = p.Tq * p.Hq;
    const int64_t prow = int64_t(blockIdx.y) * rows + row;
    float* arow = p.part_acc + prow * Dv;
#pragma unroll
    for (int i = 0; i < kVChunks; ++i) {
      const int d = lane + 32 * i;
      if (d < Dv) arow[d] = acc[i];
    }
    if (lane == 0) {
      p.part_m[prow] = m;  // -inf (with l = 0, acc = 0) when the split held no visible key
      p.part_l[prow] = l;
    }
  }
}

}  // namespace

void launch_attention_generic(const AttentionParams& p, bool elem_bf16, cudaStream_t stream) {
  const int64_t rows = p.Tq * p.Hq;
  const dim3 grid(unsigned((rows + kGenericWarps - 1) / kGenericWarps),
                  unsigned(p.nsplit > 0 ? p.nsplit : 1), unsigned(p.batch));
  const dim3 block(32 * kGenericWarps);
  if (elem_bf16)
    attention_generic_kernel<__nv_bfloat16><<<grid, block, 0, stream>>>(p);
  else
    attention_generic_kernel<float><<<grid, block, 0, stream>>>(p);
  check_launch("attention_generic_kernel");
}

}  // namespace kda::ops::cuda_detail
