// CUDA entry points for the delta-rule family (DeltaNet, Gated DeltaNet, KDA): chunked prefill
// forward, token-by-token (recurrent) forward, and the fused decode step over a state pool.
//
// Every tensor argument is a DEVICE pointer in the layouts of delta_rule.h (token-major, fla's):
//   q, k [B, T, H, K]; v, o [B, T, HV, V]; g [B, T, HV, K] (Gate::channel, KDA) or [B, T, HV]
//   (Gate::scalar, Gated DeltaNet), unused for Gate::none; beta [B, T, HV]; states fp32
//   [N, HV, K, V]. With cu_seqlens, B = 1 and the N sequences are packed along T.
// q, k, v, g, beta and o share one element type (bf16 or fp32); gate sums, the C x C solve and
// the states are fp32. All work is queued on `stream`; nothing synchronises the host.
// Errors in arguments throw kda::Error before anything is queued; CUDA errors throw kda::Error.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>

#include "ops/common/device_types.h"
#include "ops/delta_rule/delta_rule.h"
#include "ops/kda/kda.h"

namespace kda::ops::cuda {

// A KDA layer's in-kernel options, as fla's chunk_kda(use_qk_l2norm_in_kernel,
// use_gate_in_kernel, use_beta_sigmoid_in_kernel) and kda.h's KdaOptions apply them. The bf16
// chunk_forward and chunk_backward with Gate::channel take them (the fp32 path refuses); each
// option is independent of the others.
//   l2norm_qk:      q, k rows <- x / max(|x|, 1e-6)
//   gate_in_kernel: g holds graw; g <- lower_bound * sigmoid(exp(A_log) (graw + dt_bias))
//                   (KdaGate::lower_bound, fla's safe_gate) or -exp(A_log) softplus(graw +
//                   dt_bias) (KdaGate::softplus; decays of any size, see "Any KDA decay"
//                   below). A_log [HV], dt_bias [HV * K]: fp32 device arrays; a
//                   null A_log means exp(A_log) = 1, a null dt_bias zero.
//   beta_sigmoid:   beta holds braw; beta <- sigmoid(braw)
struct KdaLayerDeviceOptions {
  bool l2norm_qk = false;
  bool gate_in_kernel = false;
  KdaGate gate = KdaGate::lower_bound;
  float lower_bound = -5.f;
  const float* A_log = nullptr;
  const float* dt_bias = nullptr;
  bool beta_sigmoid = false;
  bool any() const { return l2norm_qk || gate_in_kernel || beta_sigmoid; }
};

struct DeltaRuleDeviceInputs {
  DeltaRuleShape shape;
  ElementType dtype = ElementType::bf16;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* g = nullptr;  // log-space gate (natural log); may be null for Gate::none
  const void* beta = nullptr;
  const float* h0 = nullptr;  // optional initial states [N, HV, K, V]
  // HOST copy of the packed sequence boundaries (N + 1 entries, first 0, last T); empty means
  // B sequences of T tokens. The host always knows the lengths, so no device round trip.
  std::span<const int64_t> cu_seqlens = {};
  KdaLayerDeviceOptions kda_layer = {};  // all off: the inputs are used as given
};

// Chunked forward (C = 64). bf16 inputs run the tensor-core path (bf16 products, fp32
// accumulation, fp32 gate sums / solve / state; fla's precision). fp32 inputs run the fp32
// recurrent kernel instead (exact to fp32 rounding; K in {32, 64, 128}). Supported: K, V in
// {64, 128} for bf16.
//
// Any KDA decay (bf16 path): the tensor-core products split each pairwise decay exp(G_i - G_j)
// around the first token of its 16-token block, which leaves bf16's range when a channel decays
// by more than ~e^-78 inside the block. chunk_prepare lists such chunks and chunk_prepare_exact.cu
// redoes them elementwise in fp32 (the backward's pairwise terms likewise), so raw g and the
// softplus gate may decay without limit; a lower-bound gate of lower_bound >= -5 (fla's) never
// reaches it, and its chunks skip the test.
//
// o [B, T, HV, V] (same element type as the inputs); ht [N, HV, K, V] fp32 or null.
// `workspace` must hold chunk_forward_workspace_bytes(...) bytes of device memory and must not
// be used by other work on other streams while this call's work runs.
size_t chunk_forward_workspace_bytes(const DeltaRuleShape& shape,
                                     std::span<const int64_t> cu_seqlens);
void chunk_forward(const DeltaRuleDeviceInputs& in, void* o, float* ht, void* workspace,
                   size_t workspace_bytes, cudaStream_t stream);

// Backward of chunk_forward (bf16 inputs only): gradients of sum(o * d_o) + sum(ht * d_ht)
// with respect to q, k, v, g, beta and h0 (and, with in.kda_layer's gate, A_log and dt_bias).
// Recomputes the forward's chunk quantities and the state entering every chunk, walks the chunks
// backwards carrying dS, then computes each chunk's gradients in parallel (see chunk_kernels.cuh).
// Supported: K = V in {64, 128}; any KDA decay, as chunk_forward. d_o [B, T, HV, V] (bf16); d_ht
// fp32 [N, HV, K, V] or null (zero). Gradients have the inputs' layouts and element type (bf16),
// dh0 fp32; dg is not written for Gate::none and may be null then; dh0 may be null. `workspace`
// must hold chunk_backward_workspace_bytes(...) bytes (forward workspace + per-chunk states and
// their gradients, ~4 * K * V bytes per chunk and value head).
//
// With in.kda_layer (the same options as the forward's) every gradient is with respect to the
// RAW input the caller passed: dq, dk of the raw q, k rows (through the L2 norm, l2norm_qk),
// dg = dgraw (gate_in_kernel), dbeta = dbraw (beta_sigmoid); layouts and bf16 as above. With
// gate_in_kernel, dA_log [HV] and ddt_bias [HV * K] (fp32 device arrays, either may be null)
// are overwritten with the gradients with respect to A_log and dt_bias (a null A_log / dt_bias
// in the options is differentiated at A_log = 0 / dt_bias = 0). They are sums over all tokens
// in a fixed order (per-chunk terms, then kda_gate_grads), like every sum of the backward: the
// same bits run to run. The recompute and the gradients use the
// forward's activations (same functions, so the same gate and beta bit for bit; normalised
// q / k rounded to bf16 once).
struct DeltaRuleDeviceGrads {
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  void* dg = nullptr;
  void* dbeta = nullptr;
  float* dh0 = nullptr;
  float* dA_log = nullptr;    // KDA layer gate only: [HV]
  float* ddt_bias = nullptr;  // KDA layer gate only: [HV * K]
};
size_t chunk_backward_workspace_bytes(const DeltaRuleShape& shape,
                                      std::span<const int64_t> cu_seqlens);
// Where chunk_backward finds the forward's per-chunk arrays: it recomputes them (a chunk_prepare
// and a state walk: ~1 ms of the ~5.9 ms of a KDA layer's forward + backward at 8 x 2048, H = 32,
// K = V = 128), or chunk_forward_for_backward kept them in the workspace.
enum class ChunkBackwardFrom { recompute, kept_forward };
void chunk_backward(const DeltaRuleDeviceInputs& in, const void* d_o, const float* d_ht,
                    const DeltaRuleDeviceGrads& grads, void* workspace, size_t workspace_bytes,
                    cudaStream_t stream, ChunkBackwardFrom from = ChunkBackwardFrom::recompute);

// A training forward: chunk_forward's o and ht (bf16 inputs, the K, V and option limits of
// chunk_backward), computed by the backward's own recompute, which also leaves in `workspace`
// (chunk_backward_workspace_bytes) the arrays the backward needs. chunk_backward(...,
// ChunkBackwardFrom::kept_forward) on the same inputs and the untouched workspace then skips its
// recompute and computes what the recompute path computes (as equal to it as two runs of that
// path are to each other: bit for bit but where shared-memory float sums may change order). It
// cannot tell a workspace that did not come from this forward: other contents give wrong
// gradients, not an error. The price: the
// workspace stays allocated from forward to backward (per layer, in a model), and the forward
// writes ~4 K V bytes more per chunk and value head (at 8 x 2048, H = 32: ~0.55 GB).
void chunk_forward_for_backward(const DeltaRuleDeviceInputs& in, void* o, float* ht,
                                void* workspace, size_t workspace_bytes, cudaStream_t stream);

// The recurrence token by token (one block per sequence, value head and 32-column tile of the
// state): fp32 arithmetic throughout. Any K in {32, 64, 128}, V a multiple of 32. `workspace` as
// for chunk_forward, of recurrent_forward_workspace_bytes(...) bytes (it holds the sequence table).
size_t recurrent_forward_workspace_bytes(std::span<const int64_t> cu_seqlens);
void recurrent_forward(const DeltaRuleDeviceInputs& in, void* o, float* ht, void* workspace,
                       size_t workspace_bytes, cudaStream_t stream);

// Which kernel runs a decode step (both give the same results up to fp32 summation order).
enum class DecodeKernel {
  // head when the tile kernel would need more than one wave of blocks (B * HV * V / 32 > 8 blocks
  // per SM: B >= 9 at HV = 32, V = 128 on 132 SMs) and V = 128; tile otherwise. The kernel-lab
  // knob KDA_DECODE_KERNEL=tile|head|auto overrides `automatic` (not an explicit choice).
  automatic,
  // one block of 128 threads per K x 32 column tile of a (sequence, value head) state, state in
  // registers (many small blocks: best when there are few sequences)
  tile,
  // one block of 256 threads per (sequence, value head), V = 128 and one token per sequence
  // only: the first 64 rows of the state in registers, the rest (K = 128) brought into shared
  // memory by one bulk copy; q, k and the gate loaded once per head, 4 blocks per SM (all 16 x 32
  // heads of B = 16 in one wave)
  head,
};

// One decode step for shape.B sequences, `tokens` tokens each (1, or a few for speculative
// decoding: the last accepted token and the drafts), token-major per sequence as in a prefill
// batch: q, k [B, tokens, H, K]; v [B, tokens, HV, V]; g [B, tokens, HV, K] or [B, tokens, HV];
// beta [B, tokens, HV]; o [B, tokens, HV, V]. Sequence b reads the fp32 state
// state_pool[slots[b]] ([num_slots, HV, K, V]), runs its tokens in order, and writes the state
// back in place; or, with token_slots, writes the state after its token t to
// state_pool[token_slots[b * tokens + t]] for every t and leaves slots[b] as it was (unless a
// token slot names it), so that a verifier that accepts the first j tokens keeps slot
// token_slots[b * tokens + j - 1] as the sequence's state. `slots` and `token_slots` are device
// arrays of int32 indices in [0, num_slots), distinct between sequences (not checked on the
// device).
constexpr int kMaxDecodeTokens = 16;
struct DecodeArgs {
  DeltaRuleShape shape;  // B = number of sequences; T is ignored
  ElementType dtype = ElementType::bf16;
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* g = nullptr;
  const void* beta = nullptr;
  float* state_pool = nullptr;
  const int32_t* slots = nullptr;
  int64_t num_slots = 0;
  void* o = nullptr;
  int tokens = 1;                        // per sequence, 1 .. kMaxDecodeTokens
  const int32_t* token_slots = nullptr;  // [B, tokens] or null (see above)
  // Programmatic dependent launch (Hopper): the step's blocks may be scheduled while the
  // previous kernel on the stream finishes; each waits for it (griddepcontrol.wait) before
  // touching memory, so the results are the same. Hides the launch gap between back-to-back
  // kernels; it pays only when the kernel before also lets dependents start early (another
  // decode step does). Off by default.
  bool overlap_launch = false;
  // With overlap_launch: read the states (through L2) and the slot arrays before waiting for the
  // previous kernel; only q, k, v, g and beta wait for it, so the state fetch, the step's bulk,
  // overlaps that kernel's tail. The caller vouches that (a) the kernel just before on the stream
  // writes none of those, and (b) if that kernel was itself launched with programmatic
  // serialization, it lets its dependents start only after its own griddepcontrol.wait (or never),
  // so that every kernel before it has completed: true of the decode kernels here (consecutive
  // decode steps on disjoint slots, as kda_gpu_check's chain check runs them); a model must check
  // the kernels it puts before the step. Off by default; KDA_DECODE_PREFETCH=0 forces it off.
  bool prefetch_state = false;
  DecodeKernel kernel = DecodeKernel::automatic;
};
void decode_step(const DecodeArgs& args, cudaStream_t stream);

// Kernel lab: the bandwidth ceiling of decode_step(args). Reads and writes back, in place and
// unchanged, exactly the state bytes the step touches (state_pool[slots[b]] for every b: 2 x B x
// HV x K x V x 4 bytes) with a plain streaming copy kernel (four 16-byte loads in flight per
// thread, streaming stores), launched like the step (args.overlap_launch, KDA_DECODE_OVERLAP).
// Only state_pool, slots, num_slots and shape (B, HV, K, V) are used.
void decode_state_copy(const DecodeArgs& args, cudaStream_t stream);

}  // namespace kda::ops::cuda
