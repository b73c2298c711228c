// The per-chunk algebra of the chunked delta rule (see ../shared/notes/chunked-delta-rule.md),
// shared by the forward and the backward. One ChunkWork per thread; buffers are reused.
//
// For a chunk of C tokens with in-chunk gate cumsum G (C x K):
//   E = exp(G), Qt = Q*E, Kt = K*E, Ki = K/E            (ratios stay in fp32 range: chunks
//                                                         are planned so |G| stays bounded)
//   Akk = tril(Kt Ki^T, -1),  Aqk = tril(Qt Ki^T)         pairwise decays exp(G_i - G_j)
//   Tm  = (I + diag(beta) Akk)^-1,  U = Tm (beta V),  W = Tm (beta Kt)
//   D   = U - W S0,  O = scale (Qt S0 + Aqk D),  S_C = diag(E_C) S0 + (Ki E_C)^T D
#pragma once
#include <cstdint>
#include <vector>

#include "ops/delta_rule/delta_rule.h"

namespace kda::ops::detail {

// Where chunks are cut: at most `max_chunk` tokens, shorter where a channel's in-chunk gate
// cumsum would leave [-kMaxNegativeLogDecay, kMaxPositiveLogGrowth].
constexpr float kMaxNegativeLogDecay = 60.0f;
constexpr float kMaxPositiveLogGrowth = 20.0f;

// Chunk start offsets (relative to the sequence start) plus a final entry = length.
std::vector<int64_t> plan_chunks(const DeltaRuleInputs<float>& in, int64_t seq_start,
                                 int64_t length, int64_t hv, int max_chunk);

struct ChunkWork {
  int64_t K = 0, V = 0, C = 0, cap = 0;
  std::vector<float> q, k, v, beta, G, E, Einv, Qt, Kt, Ki;  // C x K (v: C x V, beta: C)
  std::vector<float> Akk, Aqk, Tm;                           // C x C
  std::vector<float> Vb, Ktb, U, W, D;                       // C x V / C x K
  std::vector<float> EC;                                     // K: exp(G_C)

  ChunkWork(int64_t K, int64_t V, int64_t cap);

  // Loads tokens [t0, t0 + C) of (sequence start, head h, value head hv) and computes
  // everything up to U and W (independent of the entering state).
  void load_and_prepare(const DeltaRuleInputs<float>& in, int64_t seq_start, int64_t t0, int64_t C,
                        int64_t h, int64_t hv);
  // D = U - W S0
  void compute_d(const float* S0);
  // o rows (stride ld_o) = scale (Qt S0 + Aqk D)
  void compute_output(const float* S0, float scale, float* o, int64_t ld_o) const;
  // S (K x V) <- diag(E_C) S + (Ki E_C)^T D, in place
  void advance_state(float* S) const;
};

}  // namespace kda::ops::detail
