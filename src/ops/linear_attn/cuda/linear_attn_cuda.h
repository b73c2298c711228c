// Linear attention (ops/linear_attn/linear_attn.h's semantics, normalised or not) on the GPU for
// training: q, k [B, T, H, K], v, o [B, T, H, V] fp32 device arrays (token-major), or packed
// sequences (host cu_seqlens, B = 1, each sequence starting from a zero state). No initial or
// final states. fp32 accuracy: the products run on tensor cores in 3xTF32 (three TF32 products
// of split operands, accumulated in fp32).
//
// Design (simple, deterministic): chunks of 64 tokens; one block per (sequence, head, 32-column
// tile of V) walks its sequence's chunks in order with the K x 32 slice of the state (and the
// normaliser z) in shared memory. The backward walks forward for dq (the state before each
// chunk) and backward for dk, dv (carrying dS and, normalised, dz). dq and dk are sums over the
// V tiles: each tile writes its own partial rows into the workspace and a second kernel adds the
// tiles in tile order (no atomics, so two runs give the same bits). The normalised backward
// first recomputes o and the denominators (the forward kernel) into the workspace, unless the
// caller kept them from the forward (LinearAttnKeptForward).
//
// Supported: K, V in {32, 64, 128}; any T >= 1. Inputs are not checked for finite values (that
// would need a device round trip). Bad arguments throw kda::Error before anything is queued;
// CUDA launch errors throw kda::Error. Nothing synchronises the host, except that packed
// sequences' table is copied from pageable host memory with cudaMemcpyAsync, which waits for the
// stream (and cannot be captured); B sequences of T tokens need no table.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>

#include "ops/linear_attn/linear_attn.h"

namespace kda::ops::cuda {

struct LinearAttnDeviceArgs {
  LinearAttnShape shape;     // B, T, H, K, V, scale, normalize
  const float* q = nullptr;  // raw (before the feature map)
  const float* k = nullptr;
  const float* v = nullptr;
  std::span<const int64_t> cu_seqlens = {};  // host; empty: B sequences of T tokens
};

// Device workspace for either call (the backward's need, which covers the forward's: the forward
// uses only the sequence table at its start). Backward: the table, per-V-tile partial dq / dk
// rows (V / 32 * B * T * H * K floats) and, normalised, one float per (token, head) for the
// normaliser's weight, plus the recomputed o and denominators unless `kept_forward` (a backward
// that will be given LinearAttnKeptForward; a workspace sized without it serves both).
size_t linear_attn_workspace_bytes(const LinearAttnShape& shape,
                                   std::span<const int64_t> cu_seqlens, bool kept_forward = false);

// o [B, T, H, V] fp32 (overwritten). `workspace` must hold at least the sequence table (any
// buffer of linear_attn_workspace_bytes bytes does) and must not be used by other work while
// this call's work runs. den [B, T, H] (normalised form only; optional): the denominators,
// kept for linear_attn_backward (LinearAttnKeptForward) so that it need not run the forward
// again.
void linear_attn_forward(const LinearAttnDeviceArgs& args, float* o, void* workspace,
                         size_t workspace_bytes, cudaStream_t stream, float* den = nullptr);

// What the normalised backward needs from the forward and otherwise recomputes (a forward walk
// of its own): o and den exactly as linear_attn_forward wrote them for the same args. Both or
// neither; the plain form takes neither.
struct LinearAttnKeptForward {
  const float* o = nullptr;
  const float* den = nullptr;
};

// Gradients of sum(o * d_o) with respect to the raw q, k and v (all overwritten, fp32), as
// ops::linear_attn_chunk_backward computes them (without states). d_o [B, T, H, V]; dq, dk
// [B, T, H, K]; dv [B, T, H, V]; none may alias an input. `workspace` of
// linear_attn_workspace_bytes bytes. Deterministic: the same inputs give the same bits, with or
// without a kept forward (which holds the bits the recomputation would make).
void linear_attn_backward(const LinearAttnDeviceArgs& args, const float* d_o, float* dq, float* dk,
                          float* dv, void* workspace, size_t workspace_bytes, cudaStream_t stream,
                          LinearAttnKeptForward kept = {});

}  // namespace kda::ops::cuda
