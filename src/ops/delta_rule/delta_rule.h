// The delta-rule family: DeltaNet (no gate), Gated DeltaNet (scalar log-gate per head) and KDA
// (log-gate per channel). One recurrence, per value head hv with state S (K x V, fp32):
//
//   P_t = diag(exp(g_t)) S_{t-1}                       (decay; g = 0 for DeltaNet)
//   S_t = P_t + beta_t k_t (v_t - P_t^T k_t)^T          (delta-rule write)
//   o_t = scale * S_t^T q_t
//
// Layouts follow fla (token-major): q, k [B, T, H, K]; v, o [B, T, HV, V]; g [B, T, HV, K]
// (channel) or [B, T, HV] (scalar); beta [B, T, HV]; states h0, ht [N, HV, K, V] where N is
// the number of sequences. Value head hv reads q/k head hv / (HV / H) (grouped value heads).
// With cu_seqlens, B = 1 and the sequences are packed along T.
#pragma once
#include <cstdint>
#include <span>

namespace kda::ops {

enum class Gate { none, scalar, channel };  // DeltaNet, Gated DeltaNet, KDA

struct DeltaRuleShape {
  int64_t B = 1, T = 1, H = 1, HV = 1, K = 64, V = 64;
  Gate gate = Gate::channel;
  double scale = 0;  // 0 means K^-0.5

  double effective_scale() const;
  int64_t gate_width() const { return gate == Gate::channel ? K : gate == Gate::scalar ? 1 : 0; }
  // Throws kda::Error on non-positive sizes or HV not a multiple of H.
  void validate() const;
};

template <class F>
struct DeltaRuleInputs {
  DeltaRuleShape shape;
  const F* q = nullptr;
  const F* k = nullptr;
  const F* v = nullptr;
  const F* g = nullptr;  // log-space gate; ignored (may be null) for Gate::none
  const F* beta = nullptr;
  const F* h0 = nullptr;  // optional initial state [N, HV, K, V]
  std::span<const int64_t> cu_seqlens = {};
};

template <class F>
struct DeltaRuleGrads {
  F* dq = nullptr;  // [B, T, H, K]
  F* dk = nullptr;
  F* dv = nullptr;  // [B, T, HV, V]
  F* dg = nullptr;  // like g; may be null (and is not written for Gate::none)
  F* dbeta = nullptr;
  F* dh0 = nullptr;  // [N, HV, K, V]; may be null
};

// Ground truth: the plain recurrence in float64. o [B, T, HV, V]; ht may be null.
void delta_rule_reference(const DeltaRuleInputs<double>& in, double* o, double* ht);

// Fast fp32 forward: chunkwise-parallel WY/UT form. Chunks hold at most `chunk` tokens and are
// cut shorter where a channel's decay inside the chunk would pass exp(-60) (fp32 safety).
void delta_rule_chunk_forward(const DeltaRuleInputs<float>& in, float* o, float* ht,
                              int chunk = 64);

// Backward of the chunked forward: gradients of sum(o * d_o) + sum(ht * d_ht) for every input.
// d_ht may be null (zero cotangent for the final state).
void delta_rule_chunk_backward(const DeltaRuleInputs<float>& in, const float* d_o,
                               const float* d_ht, const DeltaRuleGrads<float>& grads,
                               int chunk = 64);

// The recurrence in fp32, token by token (what decode does, over a whole prompt).
void delta_rule_recurrent_forward(const DeltaRuleInputs<float>& in, float* o, float* ht);

// One decode step for N sequences, one token each: q, k [N, H, K]; v [N, HV, V];
// g [N, HV, K] or [N, HV]; beta [N, HV]. `state` [N, HV, K, V] is updated in place; o [N, HV, V].
// (shape.B is the number of sequences, shape.T is ignored.)
void delta_rule_decode_step(const DeltaRuleShape& shape, const float* q, const float* k,
                            const float* v, const float* g, const float* beta, float* state,
                            float* o);

// Multiply-adds of the chunked forward per token and head (for GFLOP/s reports).
double delta_rule_chunk_forward_flops_per_token(const DeltaRuleShape& shape, int chunk = 64);

}  // namespace kda::ops
