// The plain attention backward kernels and the preprocess every path shares.
//
// Preprocess: one warp per workspace row (h, t): delta = rowsum(d_o * o) and lse2 = lse * log2(e)
// (padding rows t >= Tq: lse2 = +inf, delta = 0).
// dq: one warp per query row (t, h) walks the keys it sees: p = exp(scale q . k - lse),
// ds = p (d_o . v - delta), dq += ds k (times scale at the end).
// dk, dv: one warp per key row (j, kvh) walks the query heads of its group, then the queries that
// see key j, in a fixed order: dv += p d_o, dk += ds q (times scale). fp32 arithmetic with expf
// throughout: the f32 path is exact to fp32 rounding; bf16 layouts the tensor-core kernels do not
// take land here too. Every kernel: grid (warp blocks, 1, batch), sequence b = blockIdx.z.
#include <cuda_bf16.h>

#include <cmath>

#include "ops/attention/cuda/attention_backward_kernels.cuh"
#include "ops/attention/cuda/attention_kernels.cuh"
#include "ops/delta_rule/cuda/device_common.cuh"

namespace kda::ops::cuda_detail {

namespace {

constexpr int kWarps = 4;
constexpr int kQChunks = (kAttentionMaxDk + 31) / 32;  // per-lane values of a Dk row
constexpr int kVChunks = (kAttentionMaxDv + 31) / 32;  // per-lane values of a Dv row
constexpr float kLog2e = 1.4426950408889634f;

template <class T>
__global__ void __launch_bounds__(32 * kWarps)
    attention_bwd_preprocess_kernel(AttentionBwdParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t wrow = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);  // h * Tq_pad + t
  const int64_t wrows = int64_t(p.Hq) * p.Tq_pad;
  if (wrow >= wrows) return;
  const int64_t b = blockIdx.z;  // the sequence
  float* lse2 = p.lse2 + b * wrows;
  float* delta = p.delta + b * wrows;
  const int h = int(wrow / p.Tq_pad);
  const int64_t t = wrow % p.Tq_pad;
  if (t >= p.Tq) {
    if (lane == 0) {
      lse2[wrow] = INFINITY;
      delta[wrow] = 0.f;
    }
    return;
  }
  const int64_t row = t * p.Hq + h;
  const T* dorow = static_cast<const T*>(p.d_o) + (b * p.Tq * p.Hq + row) * p.Dv;
  const int64_t orow = b * p.o_bstride + row * p.Dv;
  float sum = 0.f;
  if (p.o_bf16 != nullptr) {
    const auto* o = static_cast<const __nv_bfloat16*>(p.o_bf16) + orow;
    for (int d = lane; d < p.Dv; d += 32) sum = fmaf(to_f32(dorow[d]), to_f32(o[d]), sum);
  } else {
    for (int d = lane; d < p.Dv; d += 32) sum = fmaf(to_f32(dorow[d]), p.o[orow + d], sum);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) {
    delta[wrow] = sum;
    lse2[wrow] = p.lse[b * p.lse_bstride + row] * kLog2e;
  }
}

template <class T>
__global__ void __launch_bounds__(32 * kWarps)
    attention_bwd_dq_generic_kernel(AttentionBwdParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (row >= p.Tq * p.Hq) return;  // whole warps leave; no block-wide sync below
  const int64_t t = row / p.Hq;
  const int h = int(row % p.Hq);
  const int kvh = h / p.group;
  const int Dk = p.Dk, Dv = p.Dv;
  const int64_t b = blockIdx.z;                // the sequence
  const int64_t brow = b * p.Tq * p.Hq + row;  // row of the dense d_o of the batch

  const T* qrow = static_cast<const T*>(p.q) + b * p.q_bstride + t * p.q_stride + int64_t(h) * Dk;
  const T* dorow = static_cast<const T*>(p.d_o) + brow * Dv;
  float qv[kQChunks], acc[kQChunks], dov[kVChunks];
#pragma unroll
  for (int i = 0; i < kQChunks; ++i) {
    const int d = lane + 32 * i;
    qv[i] = d < Dk ? to_f32(qrow[d]) : 0.f;
    acc[i] = 0.f;
  }
#pragma unroll
  for (int i = 0; i < kVChunks; ++i) {
    const int d = lane + 32 * i;
    dov[i] = d < Dv ? to_f32(dorow[d]) : 0.f;
  }
  const float lse = p.lse[b * p.lse_bstride + row];
  const float delta = p.delta[(b * p.Hq + h) * p.Tq_pad + t];

  const T* kbase = static_cast<const T*>(p.k) + b * p.k_bstride + int64_t(kvh) * Dk;
  const T* vbase = static_cast<const T*>(p.v) + b * p.v_bstride + int64_t(kvh) * Dv;
  const int64_t key_end = min(p.q_offset + t + 1, p.Tk);
  for (int64_t j = 0; j < key_end; ++j) {
    const T* krow = kbase + j * p.k_stride;
    const T* vrow = vbase + j * p.v_stride;
    float kv[kQChunks];
    float dot = 0.f, dp = 0.f;
#pragma unroll
    for (int i = 0; i < kQChunks; ++i) {
      const int d = lane + 32 * i;
      kv[i] = d < Dk ? to_f32(krow[d]) : 0.f;
      dot = fmaf(qv[i], kv[i], dot);
    }
#pragma unroll
    for (int i = 0; i < kVChunks; ++i) {
      const int d = lane + 32 * i;
      if (d < Dv) dp = fmaf(dov[i], to_f32(vrow[d]), dp);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      dot += __shfl_xor_sync(0xffffffffu, dot, offset);
      dp += __shfl_xor_sync(0xffffffffu, dp, offset);
    }
    const float pj = expf(dot * p.scale - lse);
    const float ds = pj * (dp - delta);
#pragma unroll
    for (int i = 0; i < kQChunks; ++i) acc[i] = fmaf(ds, kv[i], acc[i]);
  }
  T* out = static_cast<T*>(p.dq) + (b * p.Tq + t) * p.dq_stride + int64_t(h) * Dk;
#pragma unroll
  for (int i = 0; i < kQChunks; ++i) {
    const int d = lane + 32 * i;
    if (d < Dk) out[d] = from_f32<T>(acc[i] * p.scale);
  }
}

template <class T>
__global__ void __launch_bounds__(32 * kWarps)
    attention_bwd_dkdv_generic_kernel(AttentionBwdParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t krow_index = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);  // j * Hkv + kvh
  if (krow_index >= p.Tk * p.Hkv) return;
  const int64_t j = krow_index / p.Hkv;
  const int kvh = int(krow_index % p.Hkv);
  const int Dk = p.Dk, Dv = p.Dv;
  const int64_t b = blockIdx.z;  // the sequence
  const T* qbase = static_cast<const T*>(p.q) + b * p.q_bstride;
  const T* dobase = static_cast<const T*>(p.d_o) + b * p.Tq * p.Hq * Dv;
  const float* lse = p.lse + b * p.lse_bstride;
  const float* delta = p.delta + b * p.Hq * p.Tq_pad;

  const T* krow = static_cast<const T*>(p.k) + b * p.k_bstride + j * p.k_stride + int64_t(kvh) * Dk;
  const T* vrow = static_cast<const T*>(p.v) + b * p.v_bstride + j * p.v_stride + int64_t(kvh) * Dv;
  float kv[kQChunks], dk[kQChunks], vv[kVChunks], dv[kVChunks];
#pragma unroll
  for (int i = 0; i < kQChunks; ++i) {
    const int d = lane + 32 * i;
    kv[i] = d < Dk ? to_f32(krow[d]) : 0.f;
    dk[i] = 0.f;
  }
#pragma unroll
  for (int i = 0; i < kVChunks; ++i) {
    const int d = lane + 32 * i;
    vv[i] = d < Dv ? to_f32(vrow[d]) : 0.f;
    dv[i] = 0.f;
  }

  // Queries t see key j when q_offset + t >= j.
  const int64_t t_begin = j > p.q_offset ? j - p.q_offset : 0;
  for (int hh = 0; hh < p.group; ++hh) {
    const int h = kvh * p.group + hh;
    for (int64_t t = t_begin; t < p.Tq; ++t) {
      const int64_t row = t * p.Hq + h;
      const T* qrow = qbase + t * p.q_stride + int64_t(h) * Dk;
      const T* dorow = dobase + row * Dv;
      float qv[kQChunks], dov[kVChunks];
      float dot = 0.f, dp = 0.f;
#pragma unroll
      for (int i = 0; i < kQChunks; ++i) {
        const int d = lane + 32 * i;
        qv[i] = d < Dk ? to_f32(qrow[d]) : 0.f;
        dot = fmaf(qv[i], kv[i], dot);
      }
#pragma unroll
      for (int i = 0; i < kVChunks; ++i) {
        const int d = lane + 32 * i;
        dov[i] = d < Dv ? to_f32(dorow[d]) : 0.f;
        dp = fmaf(dov[i], vv[i], dp);
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) {
        dot += __shfl_xor_sync(0xffffffffu, dot, offset);
        dp += __shfl_xor_sync(0xffffffffu, dp, offset);
      }
      const float pj = expf(dot * p.scale - lse[row]);
      const float ds = pj * (dp - delta[int64_t(h) * p.Tq_pad + t]);
#pragma unroll
      for (int i = 0; i < kQChunks; ++i) dk[i] = fmaf(ds, qv[i], dk[i]);
#pragma unroll
      for (int i = 0; i < kVChunks; ++i) dv[i] = fmaf(pj, dov[i], dv[i]);
    }
  }
  T* dkrow = static_cast<T*>(p.dk) + (b * p.Tk + j) * p.dk_stride + int64_t(kvh) * Dk;
  T* dvrow = static_cast<T*>(p.dv) + (b * p.Tk + j) * p.dv_stride + int64_t(kvh) * Dv;
#pragma unroll
  for (int i = 0; i < kQChunks; ++i) {
    const int d = lane + 32 * i;
    if (d < Dk) dkrow[d] = from_f32<T>(dk[i] * p.scale);
  }
#pragma unroll
  for (int i = 0; i < kVChunks; ++i) {
    const int d = lane + 32 * i;
    if (d < Dv) dvrow[d] = from_f32<T>(dv[i]);
  }
}

unsigned blocks_for(int64_t warps) {
  return unsigned((warps + kWarps - 1) / kWarps);
}

}  // namespace

void launch_attention_bwd_preprocess(const AttentionBwdParams& p, bool elem_bf16,
                                     cudaStream_t stream) {
  const dim3 grid(blocks_for(int64_t(p.Hq) * p.Tq_pad), 1, unsigned(p.batch));
  if (elem_bf16)
    attention_bwd_preprocess_kernel<__nv_bfloat16><<<grid, 32 * kWarps, 0, stream>>>(p);
  else
    attention_bwd_preprocess_kernel<float><<<grid, 32 * kWarps, 0, stream>>>(p);
  check_launch("attention_bwd_preprocess_kernel");
}

void launch_attention_bwd_generic(const AttentionBwdParams& p, bool elem_bf16,
                                  cudaStream_t stream) {
  const dim3 dq_grid(blocks_for(p.Tq * p.Hq), 1, unsigned(p.batch));
  const dim3 dkdv_grid(blocks_for(p.Tk * p.Hkv), 1, unsigned(p.batch));
  if (elem_bf16) {
    attention_bwd_dkdv_generic_kernel<__nv_bfloat16><<<dkdv_grid, 32 * kWarps, 0, stream>>>(p);
    check_launch("attention_bwd_dkdv_generic_kernel");
    attention_bwd_dq_generic_kernel<__nv_bfloat16><<<dq_grid, 32 * kWarps, 0, stream>>>(p);
  } else {
    attention_bwd_dkdv_generic_kernel<float><<<dkdv_grid, 32 * kWarps, 0, stream>>>(p);
    check_launch("attention_bwd_dkdv_generic_kernel");
    attention_bwd_dq_generic_kernel<float><<<dq_grid, 32 * kWarps, 0, stream>>>(p);
  }
  check_launch("attention_bwd_dq_generic_kernel");
}

}  // namespace kda::ops::cuda_detail
