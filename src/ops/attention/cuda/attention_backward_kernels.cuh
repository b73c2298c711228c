// Internals of the CUDA attention backward (attention_backward.cu dispatches): the parameters
// every backward kernel reads and their launchers.
//
// Workspace: lse2 [batch][Hq][Tq_pad] (the forward's lse in log2 units) then delta
// [batch][Hq][Tq_pad] (D_i = rowsum(d_o * o)), Tq_pad = Tq rounded up to kAttentionBwdRowPad,
// then for bf16 with head dims 128 / 128 the wgmma kernel's fp32 dQ sums [batch][Tq][Hq][128];
// the padding rows hold lse2 = +inf and delta = 0, so a padded query row has probability 0
// against every key and the tensor-core kernels can copy whole 16-byte chunks of them.
// Batch: every kernel runs sequence b = blockIdx.z; q, k, v, o and lse at the batch strides
// below, d_o, dq, dk, dv dense per sequence (b * Tq * Hq * Dv, ...), lse2 / delta at
// b * Hq * Tq_pad (dq, dk, dv at their row strides). The pointers below are those of sequence 0.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace kda::ops::cuda_detail {

constexpr int64_t kAttentionBwdRowPad = 64;

struct AttentionBwdParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const float* o = nullptr;      // [Tq, Hq, Dv] fp32 (the forward's output)
  const void* o_bf16 = nullptr;  // or in bf16 (o null), same strides
  const float* lse = nullptr;    // [Tq, Hq] natural log (the forward's)
  const void* d_o = nullptr;     // [Tq, Hq, Dv] dense
  void* dq = nullptr;            // [Tq, Hq, Dk] at dq_stride
  void* dk = nullptr;            // [Tk, Hkv, Dk] at dk_stride
  void* dv = nullptr;            // [Tk, Hkv, Dv] at dv_stride
  float* lse2 = nullptr;         // workspace [batch][Hq][Tq_pad]
  float* delta = nullptr;        // workspace [batch][Hq][Tq_pad]
  // workspace [batch][Tq][Hq][Dk] fp32 for the wgmma kernel's dQ sums (Dk = Dv = 128, bf16),
  // else null
  float* dq_accum = nullptr;
  int64_t q_stride = 0, k_stride = 0, v_stride = 0;  // elements between tokens
  // elements between tokens of dq, dk, dv (sequence b starts b Tq or b Tk tokens in)
  int64_t dq_stride = 0, dk_stride = 0, dv_stride = 0;
  // Elements between sequences (resolved, never 0): q, k, v, o (or o_bf16) and lse in theirs.
  int64_t q_bstride = 0, k_bstride = 0, v_bstride = 0, o_bstride = 0, lse_bstride = 0;
  int batch = 1;
  int64_t Tq = 0, Tk = 0, q_offset = 0, Tq_pad = 0;
  int Hq = 1, Hkv = 1, group = 1, Dk = 0, Dv = 0;
  float scale = 0.f;  // natural units (scores are scale * q . k)
};

// lse2 and delta (including the padding rows) from lse, o and d_o.
void launch_attention_bwd_preprocess(const AttentionBwdParams& p, bool elem_bf16,
                                     cudaStream_t stream);

// Plain kernels (one warp per key row for dk / dv, one per query row for dq; fp32 arithmetic,
// expf): any sizes the forward takes.
void launch_attention_bwd_generic(const AttentionBwdParams& p, bool elem_bf16, cudaStream_t stream);

// Tensor-core kernels for bf16; returns false (launching nothing) when this shape or layout has
// no instantiation (the caller falls back to the plain kernels).
bool launch_attention_bwd_mma(const AttentionBwdParams& p, cudaStream_t stream);

// The whole backward on wgmma (sm_90a, head dims 128 / 128, p.dq_accum set;
// attention_backward_wgmma.cu): launches when attention_wgmma_enabled() (the caller has checked
// the layout as for launch_attention_bwd_mma) and returns whether it did.
bool launch_attention_bwd_wgmma(const AttentionBwdParams& p, cudaStream_t stream);

}  // namespace kda::ops::cuda_detail
