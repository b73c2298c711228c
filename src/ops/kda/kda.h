// A KDA layer's token mixer with its in-op options, as fla's chunk_kda applies them:
//   q, k <- q / max(|q|, 1e-6), k / max(|k|, 1e-6)            (optional L2 normalisation)
//   g    <- -exp(A_log[hv]) * softplus(graw + dt_bias[hv, :])    (Kimi Linear's gate), or
//   g    <- lower_bound * sigmoid(exp(A_log[hv]) * (graw + dt_bias[hv, :]))  (bounded gate)
//   beta <- sigmoid(braw)
// then the delta rule with a per-channel gate (ops/delta_rule/delta_rule.h).
// Layouts: q, k [B, T, H, K]; v [B, T, HV, V]; graw [B, T, HV, K]; braw [B, T, HV];
// A_log [HV]; dt_bias [HV * K]; states [N, HV, K, V].
#pragma once
#include <cstdint>
#include <span>

#include "ops/delta_rule/delta_rule.h"

namespace kda::ops {

enum class KdaGate {
  softplus,     // -exp(A_log) * softplus(graw + dt_bias)
  lower_bound,  // lower_bound * sigmoid(exp(A_log) * (graw + dt_bias)), lower_bound in [-5, 0)
};

struct KdaOptions {
  bool l2norm_qk = true;
  KdaGate gate = KdaGate::softplus;
  double lower_bound = -5.0;
};

template <class F>
struct KdaInputs {
  DeltaRuleShape shape;  // gate must be Gate::channel
  KdaOptions options;
  const F* q = nullptr;
  const F* k = nullptr;
  const F* v = nullptr;
  const F* graw = nullptr;
  const F* braw = nullptr;
  const F* A_log = nullptr;
  const F* dt_bias = nullptr;
  const F* h0 = nullptr;
  std::span<const int64_t> cu_seqlens = {};
};

template <class F>
struct KdaGrads {
  F* dq = nullptr;
  F* dk = nullptr;
  F* dv = nullptr;
  F* dgraw = nullptr;
  F* dbraw = nullptr;
  F* dA_log = nullptr;
  F* ddt_bias = nullptr;
  F* dh0 = nullptr;  // may be null
};

// float64 ground truth: the activations in double, then delta_rule_reference.
void kda_reference(const KdaInputs<double>& in, double* o, double* ht);
// fp32: activations, then the chunked delta rule.
void kda_chunk_forward(const KdaInputs<float>& in, float* o, float* ht, int chunk = 64);
void kda_chunk_backward(const KdaInputs<float>& in, const float* d_o, const float* d_ht,
                        const KdaGrads<float>& grads, int chunk = 64);
// fp32 token-by-token (the decode path over a prompt).
void kda_recurrent_forward(const KdaInputs<float>& in, float* o, float* ht);

}  // namespace kda::ops

namespace kda::ops {

// One decode step of a KDA layer for N = shape.B sequences, one raw token each (q, k [N, H, K];
// v [N, HV, V]; graw [N, HV, K]; braw [N, HV]): activations, then delta_rule_decode_step on
// `state` [N, HV, K, V] in place; o [N, HV, V].
void kda_decode_step(const DeltaRuleShape& shape, const KdaOptions& options, const float* q,
                     const float* k, const float* v, const float* graw, const float* braw,
                     const float* A_log, const float* dt_bias, float* state, float* o);

}  // namespace kda::ops
