// The two kernels of the bf16 chunked forward and the workspace they share.
//
// 1. chunk_prepare (parallel over chunks x value heads): gate cumulative sums, the masked
//    C x C products L (keys-keys) and M (queries-keys), the unit lower-triangular solve
//    T = (I + L)^-1 diag(beta), and U = T V, W = T Kt. Writes per chunk and value head
//    W, Qt (= scale Q exp(G)), Kd (= K exp(G_C - G)), U, M (scaled, masked), exp(G_C).
// 2. chunk_state (sequential over chunks, parallel over sequences x value heads x 32-column
//    state tiles): D = U - W S0, O = Qt S0 + M D, S = exp(G_C) S0 + Kd^T D.
// Rows of a chunk past its sequence's end are zero in every workspace array.
// Gated DeltaNet forward (ChunkWorkspace::raw_qk): the decay factors are per-row scalars, so
// chunk_prepare skips Qt and Kd and writes the gate cumsum G (log2 units, C floats) where
// exp(G_C) would go; chunk_state reads q and k themselves and applies the factors as row
// scalings of its products (O rows by scale 2^G_i, Kd's token columns by 2^(G_C - G_j)).
//
// The backward (chunk_backward.cu) runs both forward kernels again with the optional outputs
// below switched on, then
// 3. chunk_state_bwd (sequential over chunks, backwards): dD = M^T dO + Kd dS and
//    dS <- exp(G_C) dS + Qt^T dO - W^T dD; writes dS (leaving each chunk) and dD.
// 4. chunk_bwd_local (parallel over chunks x value heads): every input gradient of the chunk.
// 5. finish_qk_grads (grouped value heads or the KDA layer's l2norm): dq, dk per q / k head.
// With a KDA layer's options (KdaLayerParams) the recompute activates as the forward does, and
// chunk_bwd_local activates its own loads the same way (normalised q / k rows, gate, beta) and
// maps dg, dbeta to the raw inputs' gradients itself (plus each block's dA_log, ddt_bias terms,
// summed over the chunks by kda_gate_grads in a fixed order); finish_qk_grads maps the
// normalised rows' dq, dk to the raw rows'.
// Deterministic: no kernel of the backward sums with atomics, so a backward gives the same bits
// on every run of the same inputs.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "ops/common/device_attributes.h"
#include "ops/delta_rule/delta_rule.h"

namespace kda::ops::cuda_detail {

constexpr int kChunk = 64;
constexpr int kStateTile = 32;         // state columns per chunk_state block
constexpr int kBwdLocalThreads = 256;  // chunk_bwd_local's block
// A KDA layer gate's per-block terms (ChunkGrads::gate_part): ddt_bias by thread, dA_log by warp
constexpr int kGatePartFloats = kBwdLocalThreads + kBwdLocalThreads / 32;

struct ChunkWorkspace {
  const int64_t* chunk_tok0;           // [num_chunks] first token of each chunk
  const int64_t* chunk_len;            // [num_chunks] tokens in the chunk (1..64)
  const int64_t* seq_chunk0;           // [N] index of each sequence's first chunk
  const int64_t* seq_nchunks;          // [N]
  const int64_t* seq_bos;              // [N]
  const int64_t* seq_len;              // [N]
  __nv_bfloat16 *W, *Qt, *Kd, *U, *M;  // [num_chunks, HV, C, K|V|C]
  float* gC;                           // [num_chunks, HV, K]
  int64_t num_chunks;
  bool raw_qk = false;  // Gated DeltaNet forward: see the note above (Qt, Kd unused)
  // Gated DeltaNet forward on the wgmma walk (raw_qk too): chunk_state_wgmma forms M from the
  // q, k tiles it holds anyway, so chunk_prepare neither computes nor writes M
  bool m_in_state = false;
  // Gated DeltaNet forward on the split walk: its output warps read
  // the q rows and scale P's rows by scale 2^G_i themselves, so chunk_prepare writes Kd, M and G
  // (in gC, C floats) but not Qt
  bool qt_in_state = false;
  // KDA's wide-decay list (null for the scalar gate and for a gate bounded inside the split's
  // range, decay_within_split below): chunk_prepare appends chunk * HV + hv of every (chunk, value
  // head) where some channel decays by more than kWideDecayLog2 inside a 16-row block (its split of
  // exp(G_i - G_j) would leave bf16's range), and chunk_prepare_exact recomputes those chunks' M,
  // W, U (X, A) elementwise in fp32. wide_count is zeroed before chunk_prepare.
  unsigned* wide_count = nullptr;
  static constexpr float kWideDecayLog2 = 112.f;  // fla's bound: 15 x 5 nats = 108 in log2
  unsigned* wide_list = nullptr;                  // [num_chunks * HV]
  // 1 where chunk_prepare listed (chunk, hv), else 0, written by every chunk_prepare block while
  // wide_count is set: chunk_bwd_local's default instance skips those chunks and its EXACT
  // instance walks the list (null: every chunk in one instance)
  unsigned char* wide_flag = nullptr;  // [num_chunks * HV]
  // Optional (backward only; null in the plain forward):
  __nv_bfloat16* X = nullptr;   // prepare: (I + L)^-1, [num_chunks, HV, C, C], zero above diag
  __nv_bfloat16* A = nullptr;   // prepare: decayed K K^T, strictly lower, [num_chunks, HV, C, C]
  __nv_bfloat16* S0 = nullptr;  // state: state entering each chunk, [num_chunks, HV, K, V]
  __nv_bfloat16* D = nullptr;   // state: D = U - W S0, [num_chunks, HV, C, V]
};

// The chunks a state walk visits for sequence n: each chunk's first token and length are
// computed from the sequence's as chunk_plan lays them out (not loaded: a table load would put
// an L2 round trip into every chunk's chain).
struct WalkedChunks {
  int64_t seq_chunk0, seq_bos, seq_len;
  int64_t first, count;  // chunks [first, first + count)
  __device__ WalkedChunks(const ChunkWorkspace& ws, int64_t n)
      : seq_chunk0(ws.seq_chunk0[n]),
        seq_bos(ws.seq_bos[n]),
        seq_len(ws.seq_len[n]),
        first(seq_chunk0),
        count(ws.seq_nchunks[n]) {}
  __device__ int64_t tok0(int64_t chunk) const { return seq_bos + (chunk - seq_chunk0) * kChunk; }
  __device__ int len(int64_t chunk) const {
    const int64_t left = seq_len - (chunk - seq_chunk0) * kChunk;
    return int(left < kChunk ? left : kChunk);
  }
};

// A KDA layer's in-kernel options (fla's chunk_kda use_qk_l2norm_in_kernel, use_gate_in_kernel,
// use_beta_sigmoid_in_kernel), applied by chunk_prepare and chunk_bwd_local: q, k rows
// L2-normalised, g = lower_bound * sigmoid(exp(A_log) (graw + dt_bias)) or -exp(A_log)
// softplus(graw + dt_bias), beta = sigmoid(braw). `on` false: the inputs are used as given.
struct KdaLayerParams {
  bool on = false;
  bool l2norm_qk = false;
  bool gate = false;           // g holds graw
  bool gate_softplus = false;  // else the lower-bound sigmoid gate
  bool beta_sigmoid = false;   // beta holds braw
  float lower_bound = -5.f;
  const float* A_log = nullptr;    // [HV]
  const float* dt_bias = nullptr;  // [HV * K] or null (zero)
};

// Whether no KDA chunk can decay past the anchored split's range (ChunkWorkspace::kWideDecayLog2):
// the lower-bound gate in the kernel decays at most -lower_bound nats a token, so 15 tokens of a
// 16-row block stay inside it for lower_bound >= -5.18 (fla's -5: 108 in log2). Raw g and the
// softplus gate have no bound, so their chunks are tested and the wide ones redone exactly.
inline bool decay_within_split(const KdaLayerParams& layer) {
  constexpr float kLog2e = 1.44269504f;
  return layer.on && layer.gate && !layer.gate_softplus &&
         -layer.lower_bound * 15.f * kLog2e <= ChunkWorkspace::kWideDecayLog2;
}

struct ChunkTokens {
  const __nv_bfloat16 *q, *k, *v, *g, *beta;
  __nv_bfloat16* o;  // may be null (backward recompute)
  const float* h0;
  float* ht;
  int H, HV;
  float scale;
  KdaLayerParams layer;
};

// Backward-only buffers and outputs (token-major like the inputs).
struct ChunkGrads {
  const __nv_bfloat16* dO;  // [tokens, HV, V]
  const float* dht;         // [N, HV, K, V] or null
  float* dh0;               // [N, HV, K, V] or null
  __nv_bfloat16* dS;       // workspace: gradient of the state leaving each chunk [chunks, HV, K, V]
  __nv_bfloat16* dD;       // workspace: [chunks, HV, C, V]
  __nv_bfloat16 *dq, *dk;  // [tokens, H, K] (written directly when HV == H)
  float *dq_part, *dk_part;        // [tokens, HV, K] per value head (HV != H), then summed
  __nv_bfloat16 *dv, *dg, *dbeta;  // [tokens, HV, V], like g (null for Gate::none), [tokens, HV]
  // KDA layer gate (KdaLayerParams::gate): fp32 [HV], [HV * K], written by kda_gate_grads;
  // either may be null (not computed; both null: gate_part unused)
  float *dA_log, *ddt_bias;
  // workspace [num_chunks * HV][kGatePartFloats]: each chunk_bwd_local block's terms of
  // ddt_bias (one per thread) and dA_log (one per warp), for kda_gate_grads' fixed-order sums
  float* gate_part;
};

void launch_chunk_prepare(const ChunkTokens& x, const ChunkWorkspace& ws, Gate gate, int K, int V,
                          cudaStream_t stream);
// The wide-decay chunks' exact recompute (ChunkWorkspace::wide_list; launched by
// launch_chunk_prepare after chunk_prepare when the list is on; KDA, Gate::channel).
void launch_chunk_prepare_exact(const ChunkTokens& x, const ChunkWorkspace& ws, int K, int V,
                                cudaStream_t stream);
void launch_chunk_state(const ChunkTokens& x, const ChunkWorkspace& ws, int64_t num_seqs, int K,
                        int V, cudaStream_t stream);
// chunk_state's grid: blocks of 8 warps (two 32-column tiles) when there are enough (sequence,
// value head) pairs for about one per SM, else blocks of 4 warps (one tile).
bool chunk_state_wide(int64_t num_seqs, int HV, int V);
// chunk_state_split.cu: the mma.sync walk with the output on warps of its own, off the state
// chain (taken by launch_chunk_state while chunk_state_split_on(): for one-tile grids, and for
// chunk_state_wide's grids with two tiles a block where chunk_state_split_wide(): they fit in
// one wave).
bool chunk_state_split_on();
bool chunk_state_split_wide(int64_t num_seqs, int HV, int V);
void launch_chunk_state_split(const ChunkTokens& x, const ChunkWorkspace& ws, int64_t num_seqs,
                              int K, int V, bool wide, cudaStream_t stream);
// chunk_state_wgmma.cu: the same walk on wgmma (sm_90a), one warpgroup per 64 state columns
// (on compute capability 9 where the grid fills the chip twice; launch_chunk_state then takes
// it; chunk_state_wide describes the mma.sync walks only).
bool chunk_state_uses_wgmma(int64_t num_seqs, int HV, int K, int V);
void launch_chunk_state_wgmma(const ChunkTokens& x, const ChunkWorkspace& ws, int64_t num_seqs,
                              int K, int V, cudaStream_t stream);
void launch_chunk_state_bwd(const ChunkTokens& x, const ChunkWorkspace& ws, const ChunkGrads& gd,
                            int64_t num_seqs, int K, int V, cudaStream_t stream);
// chunk_state_bwd_wgmma.cu: the reverse walk on wgmma (on compute capability 9 where the grid
// has at least 3/4 of a block per SM; launch_chunk_state_bwd then takes it)
bool chunk_state_bwd_uses_wgmma(int64_t num_seqs, int HV, int K, int V);
void launch_chunk_state_bwd_wgmma(const ChunkTokens& x, const ChunkWorkspace& ws,
                                  const ChunkGrads& gd, int64_t num_seqs, int K, int V,
                                  cudaStream_t stream);
void launch_chunk_bwd_local(const ChunkTokens& x, const ChunkWorkspace& ws, const ChunkGrads& gd,
                            Gate gate, int K, int V, cudaStream_t stream);
// dq/dk [tokens, H, K] (bf16): for grouped value heads (gd.dq_part set) the sum over each
// group's value heads of the fp32 partials, else the rows chunk_bwd_local wrote to gd.dq / gd.dk;
// with x.layer.l2norm_qk these are the normalised rows' gradients, mapped here (in place) to the
// raw rows' (x.q, x.k). Nothing to do (not launched) for HV == H without l2norm.
void launch_finish_qk_grads(const ChunkTokens& x, const ChunkGrads& gd, int64_t tokens, int K,
                            cudaStream_t stream);
// kda_gate_grads: gd.ddt_bias [HV * K] and gd.dA_log [HV] (either may be null) as the sums of
// chunk_bwd_local's per-block terms in gd.gate_part, over the chunks in order (not launched
// when both are null).
void launch_kda_gate_grads(const ChunkGrads& gd, int64_t num_chunks, int HV, int K,
                           cudaStream_t stream);

}  // namespace kda::ops::cuda_detail
