// The two kernels of the bf16 chunked forward and the workspace they share.
//
// 1. chunk_prepare (parallel over chunks x value heads): gate cumulative sums, the masked
//    C x C products L (keys-keys) and M (queries-keys), the unit lower-triangular solve
//    T = (I + L)^-1 diag(beta), and U = T V, W = T Kt. Writes per chunk and value head
//    W, Qt (= scale Q exp(G)), Kd (= K exp(G_C - G)), U, M (scaled, masked), exp(G_C).
// 2. chunk_state (sequential over chunks, parallel over sequences x value heads x 32-column
//    state tiles): D = U - W S0, O = Qt S0 + M D, S = exp(G_C) S0 + Kd^T D.
// Rows of a chunk past its sequence's end are zero in every workspace array.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "ops/delta_rule/delta_rule.h"

namespace kda::ops::cuda_detail {

constexpr int kChunk = 64;
constexpr int kStateTile = 32;  // state columns per chunk_state block

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
};

struct ChunkTokens {
  const __nv_bfloat16 *q, *k, *v, *g, *beta;
  __nv_bfloat16* o;
  const float* h0;
  float* ht;
  int H, HV;
  float scale;
};

void launch_chunk_prepare(const ChunkTokens& x, const ChunkWorkspace& ws, Gate gate, int K, int V,
                          cudaStream_t stream);
void launch_chunk_state(const ChunkTokens& x, const ChunkWorkspace& ws, int64_t num_seqs, int K,
                        int V, cudaStream_t stream);

}  // namespace kda::ops::cuda_detail
