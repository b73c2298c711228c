// Causal softmax attention on the GPU for a batch of independent, equal-length sequences (one
// sequence by default), the core that GPT-2 (prefill, training and KV-cache decode) and Kimi
// Linear's MLA (expanded prefill; absorbed decode over the latent cache, MQA-style) share.
//
//   o[i, h] = sum_j p_ij v[j, kvh(h)],  p_i = softmax_j(scale * q[i, h] . k[j, kvh(h)]),
//   j = 0 .. q_offset + i   (query i sits at position q_offset + i; Tk >= q_offset + Tq)
//   kvh(h) = h / (Hq / Hkv)  (grouped heads; Hq a multiple of Hkv)
//
// Layouts (device pointers, token-major): q [Tq, Hq, Dk] with q_row_stride elements between
// tokens (heads Dk apart); k [Tk, Hkv, Dk] with k_row_stride; v [Tk, Hkv, Dv] with
// v_row_stride (heads Dv apart). v may alias k (MLA absorbed decode: v = the first Dv values
// of each latent row). o [Tq, Hq, Dv] fp32 (or bf16: AttentionArgs::o_bf16), dense. q, k, v share
// one element type. These are the layouts of one sequence; a batch repeats them at the batch
// strides (see AttentionArgs).
//
// Paths: bf16 with Tq >= 16 runs a tensor-core flash-attention kernel (mma.sync bf16, fp32
// softmax and accumulation; Dk, Dv <= 256, zero-padded to multiples of 16 inside; for
// Dk = Dv = 128 on compute capability 9 a wgmma kernel fed by a TMA producer warp instead,
// KDA_ATTENTION_TMA_FORWARD=0 turns it off); small Tq
// (decode, a few tokens) runs a split-sequence kernel in which one block serves every query
// head of a KV head, so a shared KV head (MLA's latent) is read once per step (on sm_90, for
// MLA's 576/512 with v aliasing k, a bulk-copy-fed variant with 32-key tiles; else a cp.async
// one with 64-key tiles); fp32 inputs run a plain fp32 kernel (exact to fp32 rounding; the
// path held to 1e-4 against the CPU). The prefill and plain kernels run the batch in one launch
// (grid z); every sequence gets exactly the arithmetic a call of its own would (bit-identical).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "ops/common/device_types.h"

namespace kda::ops::cuda {

struct AttentionArgs {
  ElementType dtype = ElementType::bf16;
  int64_t Tq = 0, Tk = 0, Hq = 1, Hkv = 1, Dk = 0, Dv = 0;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t q_row_stride = 0, k_row_stride = 0, v_row_stride = 0;  // 0: dense (H * D)
  int64_t q_offset = 0;
  float scale = 0.f;  // 0: Dk^-0.5
  float* o = nullptr;
  // Or o in bf16 (set exactly one of o, o_bf16): [Tq, Hq, Dv] at the same strides, each value
  // the fp32 result rounded to nearest. Direct paths only (Tq >= 16, or lse set): what a
  // trainer's next GEMM reads, without an fp32 copy and a cast; attention_backward then reads it.
  void* o_bf16 = nullptr;
  // Optional [Tq, Hq] fp32: the natural log of each row's sum of exp(scale q . k) over its
  // visible keys (the CPU's lse; what attention_backward needs). Setting it takes the direct
  // (unsplit) path even for small Tq; with Tk_device it throws.
  float* lse = nullptr;
  // Graph replay while the cache grows: when set, the kernels read n = *Tk_device (the keys in
  // use, Tq <= n <= Tk; clamped into that range) when they run, and the queries are the last Tq
  // positions of those n keys (q_offset = n - Tq; args.q_offset is ignored). Keys >= n are
  // never read. Tk is then an upper bound: it alone sizes the split plan, the grid and the
  // workspace, so one launch (and one attention_workspace_bytes) serves every n. Decode only
  // (Tq <= 15; larger Tq throws).
  const int32_t* Tk_device = nullptr;
  // Independent sequences of equal length in one launch (grid over batch too): sequence b reads
  // q + b * q_batch_stride, k + b * k_batch_stride, v + b * v_batch_stride (elements) and writes
  // o + b * o_batch_stride, lse + b * lse_batch_stride. A 0 stride means dense: Tq * q_row_stride
  // (Tq * Hq * Dk when the row stride is 0) for q, Tk * (row stride) for k and v,
  // Tq * Hq * Dv for o, Tq * Hq for lse. The decode paths (Tk_device, the split kernels) take
  // batch == 1 only (throw otherwise).
  int64_t batch = 1;
  int64_t q_batch_stride = 0, k_batch_stride = 0, v_batch_stride = 0, o_batch_stride = 0,
          lse_batch_stride = 0;
};

// Bytes of device workspace attention_forward needs for these sizes (split-sequence partial
// results; batch > 1 never splits); 0 is a valid answer. Throws kda::Error on bad sizes, and for
// batch > 1 where the split decode path would run (Tq <= 15 without lse, or Tk_device).
size_t attention_workspace_bytes(const AttentionArgs& args);

// Throws kda::Error on bad sizes (naming the field) before queuing anything.
void attention_forward(const AttentionArgs& args, void* workspace, size_t workspace_bytes,
                       cudaStream_t stream);

// ---- Backward (attention_backward.cu) ----
// Gradients of sum(o * d_o) for the forward described by `args` (Tk_device unset), recomputing
// the probabilities from q, k and lse (FlashAttention-2): args.o (or args.o_bf16) must still hold
// the forward's output (read for D_i = rowsum(d_o * o)); lse [Tq, Hq] the forward's (args.lse). q,
// k, v, o and lse of sequence b are read at the batch strides of `args` as in the forward
// (lse_batch_stride applies to the `lse` argument). d_o is args.dtype [batch, Tq, Hq, Dv] dense;
// dq [batch, Tq, Hq, Dk], dk [batch, Tk, Hkv, Dk], dv [batch, Tk, Hkv, Dv] are args.dtype,
// dense unless `layout` gives their row strides (e.g. the three column blocks of one
// [tokens, q | k | v] buffer, so that one GEMM takes them back through a fused projection),
// every element of their rows written (keys no query sees get 0). dk and dv sum over the query
// heads of their KV head in a fixed order: deterministic (no atomics), and each sequence's
// gradients are bit-identical to a call for that sequence alone. So is dq, except on the wgmma
// path (below), where it is summed by fp32 atomics and may differ run to run in its last bits
// (attention_backward_dq_deterministic says which; KDA_ATTENTION_WGMMA=0 turns the path off).
// Paths: bf16 with Dk = Dv = 128 on a compute capability 9 device runs one wgmma kernel (dk, dv
// over key tiles, dq added into fp32 sums) and a cast; other bf16 shapes with Dk, Dv <= 128
// (multiples of 8, 16-byte aligned arrays and strides) two tensor-core kernels (dk/dv over key
// tiles, dq over query tiles); everything else a plain fp32-arithmetic kernel per key row and
// per query row (exact to fp32 rounding for f32).
// Workspace: 2 batch Hq roundup(Tq, 64) floats (lse in log2 units and D_i), plus batch Tq Hq 128
// floats for bf16 with Dk = Dv = 128 (the wgmma path's dq sums). args.lse is not read.
size_t attention_backward_workspace_bytes(const AttentionArgs& args);
// Whether attention_backward's dq is bit-reproducible for these arguments on the current device
// (false on the wgmma path, whose dq sums are fp32 atomics).
bool attention_backward_dq_deterministic(const AttentionArgs& args);
// Process-wide (default off): every later attention_backward keeps off the wgmma path, so its dq
// is bit-reproducible too (the two mma.sync kernels, slower at Dk = Dv = 128). What a trainer's
// `--deterministic` sets; like torch.use_deterministic_algorithms, a setting of the process.
void set_attention_backward_deterministic(bool on);
// Elements between tokens of dq, dk, dv (0: dense, Hq Dk / Hkv Dk / Hkv Dv); sequence b of a
// batch starts b Tq (dq) or b Tk (dk, dv) tokens in.
struct AttentionGradLayout {
  int64_t dq_row_stride = 0, dk_row_stride = 0, dv_row_stride = 0;
};
void attention_backward(const AttentionArgs& args, const float* lse, const void* d_o, void* dq,
                        void* dk, void* dv, void* workspace, size_t workspace_bytes,
                        cudaStream_t stream, const AttentionGradLayout& layout = {});

}  // namespace kda::ops::cuda
