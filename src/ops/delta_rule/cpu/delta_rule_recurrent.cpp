// The delta-rule recurrence in fp32, one token at a time: the decode step, and the same step
// run over a whole prompt (the recurrent path that tests hold against the chunked one).
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "ops/common/sequences.h"
#include "ops/delta_rule/cpu/validate.h"
#include "ops/delta_rule/delta_rule.h"

namespace kda::ops {
namespace {

// S (K x V) <- decay; d = beta (v - S^T k); S += k d^T; o = scale S^T q.
// `g` points at gw gate values (gw = 0, 1 or K). `scratch` holds V floats.
void token_update(int64_t K, int64_t V, int64_t gw, const float* q, const float* k, const float* v,
                  const float* g, float beta, float scale, float* S, float* o, float* scratch) {
  if (gw > 0) {
    for (int64_t i = 0; i < K; ++i) {
      const float decay = std::exp(g[gw == 1 ? 0 : i]);
      float* row = S + i * V;
      for (int64_t j = 0; j < V; ++j) row[j] *= decay;
    }
  }
  std::fill_n(scratch, V, 0.0f);
  for (int64_t i = 0; i < K; ++i) {
    const float* row = S + i * V;
    for (int64_t j = 0; j < V; ++j) scratch[j] += k[i] * row[j];
  }
  for (int64_t j = 0; j < V; ++j) scratch[j] = beta * (v[j] - scratch[j]);
  std::fill_n(o, V, 0.0f);
  for (int64_t i = 0; i < K; ++i) {
    float* row = S + i * V;
    const float qi = scale * q[i];
    for (int64_t j = 0; j < V; ++j) {
      row[j] += k[i] * scratch[j];
      o[j] += qi * row[j];
    }
  }
}

}  // namespace

void delta_rule_decode_step(const DeltaRuleShape& shape, const float* q, const float* k,
                            const float* v, const float* g, const float* beta, float* state,
                            float* o) {
  DeltaRuleShape s = shape;
  s.T = 1;
  s.validate();
  require(q && k && v && beta && state && o, "delta rule decode: null argument");
  require(s.gate == Gate::none || g, "delta rule decode: this gate kind needs g");
  const int64_t N = s.B, H = s.H, HV = s.HV, K = s.K, V = s.V, gw = s.gate_width();
  const float scale = float(s.effective_scale());
  parallel_for(
      N * HV,
      [&](int64_t job) {
        const int64_t n = job / HV, hv = job % HV, h = hv / (HV / H);
        thread_local std::vector<float> scratch;
        scratch.resize(V);
        token_update(K, V, gw, q + (n * H + h) * K, k + (n * H + h) * K, v + (n * HV + hv) * V,
                     gw ? g + (n * HV + hv) * gw : nullptr, beta[n * HV + hv], scale,
                     state + (n * HV + hv) * K * V, o + (n * HV + hv) * V, scratch.data());
      },
      7.0 * double(K) * double(V));
}

void delta_rule_recurrent_forward(const DeltaRuleInputs<float>& in, float* o, float* ht) {
  const SequenceLayout seqs = detail::validate_inputs(in, 1);
  const DeltaRuleShape& s = in.shape;
  const int64_t H = s.H, HV = s.HV, K = s.K, V = s.V, gw = s.gate_width();
  const float scale = float(s.effective_scale());
  parallel_for(seqs.num_sequences() * HV, [&](int64_t job) {
    const int64_t n = job / HV, hv = job % HV, h = hv / (HV / H);
    std::vector<float> S(K * V, 0.0f), scratch(V);
    if (in.h0) std::copy_n(in.h0 + (n * HV + hv) * K * V, K * V, S.data());
    for (int64_t t = 0; t < seqs.length(n); ++t) {
      const int64_t tok = seqs.start(n) + t;
      token_update(K, V, gw, in.q + (tok * H + h) * K, in.k + (tok * H + h) * K,
                   in.v + (tok * HV + hv) * V, gw ? in.g + (tok * HV + hv) * gw : nullptr,
                   in.beta[tok * HV + hv], scale, S.data(), o + (tok * HV + hv) * V,
                   scratch.data());
    }
    if (ht) std::copy_n(S.data(), K * V, ht + (n * HV + hv) * K * V);
  });
}

}  // namespace kda::ops
