// fp32 KDA mixer with the layer's in-op options: activations around the chunked delta rule.
#include <algorithm>
#include <vector>

#include "core/error.h"
#include "ops/common/sequences.h"
#include "ops/kda/kda.h"
#include "ops/kda/kda_activations.h"

namespace kda::ops {
namespace {

struct Activated {
  std::vector<float> q, k, g, beta;
};

Activated activate(const KdaInputs<float>& in) {
  const DeltaRuleShape& s = in.shape;
  s.validate();
  require(s.gate == Gate::channel, "kda: the shape's gate must be per channel");
  require(in.q && in.k && in.v && in.graw && in.braw && in.A_log && in.dt_bias,
          "kda: q, k, v, graw, braw, A_log and dt_bias are required");
  require(in.options.gate != KdaGate::lower_bound ||
              (in.options.lower_bound >= -5.0 && in.options.lower_bound < 0.0),
          "kda: lower_bound must lie in [-5, 0)");
  const int64_t tokens = s.B * s.T;
  require_finite(in.q, tokens * s.H * s.K, "q");
  require_finite(in.k, tokens * s.H * s.K, "k");
  require_finite(in.graw, tokens * s.HV * s.K, "graw");
  require_finite(in.braw, tokens * s.HV, "braw");
  require_finite(in.A_log, s.HV, "A_log");
  require_finite(in.dt_bias, s.HV * s.K, "dt_bias");
  Activated a;
  a.q.resize(tokens * s.H * s.K);
  a.k.resize(a.q.size());
  a.g.resize(tokens * s.HV * s.K);
  a.beta.resize(tokens * s.HV);
  if (in.options.l2norm_qk) {
    detail::l2norm_rows(in.q, tokens * s.H, s.K, a.q.data());
    detail::l2norm_rows(in.k, tokens * s.H, s.K, a.k.data());
  } else {
    a.q.assign(in.q, in.q + a.q.size());
    a.k.assign(in.k, in.k + a.k.size());
  }
  detail::kda_gate_forward(in.options, in.graw, in.A_log, in.dt_bias, tokens, s.HV, s.K,
                           a.g.data());
  for (size_t i = 0; i < a.beta.size(); ++i) a.beta[i] = detail::sigmoid(in.braw[i]);
  return a;
}

DeltaRuleInputs<float> plain(const KdaInputs<float>& in, const Activated& a) {
  return {in.shape, a.q.data(), a.k.data(), in.v, a.g.data(), a.beta.data(), in.h0, in.cu_seqlens};
}

}  // namespace

void kda_chunk_forward(const KdaInputs<float>& in, float* o, float* ht, int chunk) {
  const Activated a = activate(in);
  delta_rule_chunk_forward(plain(in, a), o, ht, chunk);
}

void kda_recurrent_forward(const KdaInputs<float>& in, float* o, float* ht) {
  const Activated a = activate(in);
  delta_rule_recurrent_forward(plain(in, a), o, ht);
}

void kda_chunk_backward(const KdaInputs<float>& in, const float* d_o, const float* d_ht,
                        const KdaGrads<float>& gr, int chunk) {
  require(gr.dq && gr.dk && gr.dv && gr.dgraw && gr.dbraw && gr.dA_log && gr.ddt_bias,
          "kda backward: every gradient except dh0 is required");
  const Activated a = activate(in);
  const DeltaRuleShape& s = in.shape;
  const int64_t tokens = s.B * s.T;
  std::vector<float> dq(a.q.size()), dk(a.k.size()), dg(a.g.size()), dbeta(a.beta.size());
  delta_rule_chunk_backward(plain(in, a), d_o, d_ht,
                            {dq.data(), dk.data(), gr.dv, dg.data(), dbeta.data(), gr.dh0}, chunk);
  if (in.options.l2norm_qk) {
    detail::l2norm_rows_backward(in.q, dq.data(), tokens * s.H, s.K, gr.dq);
    detail::l2norm_rows_backward(in.k, dk.data(), tokens * s.H, s.K, gr.dk);
  } else {
    std::copy(dq.begin(), dq.end(), gr.dq);
    std::copy(dk.begin(), dk.end(), gr.dk);
  }
  std::fill_n(gr.dA_log, s.HV, 0.0f);
  std::fill_n(gr.ddt_bias, s.HV * s.K, 0.0f);
  detail::kda_gate_backward(in.options, in.graw, in.A_log, in.dt_bias, dg.data(), tokens, s.HV, s.K,
                            gr.dgraw, gr.dA_log, gr.ddt_bias);
  for (size_t i = 0; i < dbeta.size(); ++i) {
    const float b = a.beta[i];
    gr.dbraw[i] = dbeta[i] * b * (1.0f - b);
  }
}

}  // namespace kda::ops

namespace kda::ops {

void kda_decode_step(const DeltaRuleShape& shape, const KdaOptions& options, const float* q,
                     const float* k, const float* v, const float* graw, const float* braw,
                     const float* A_log, const float* dt_bias, float* state, float* o) {
  DeltaRuleShape s = shape;
  s.T = 1;
  KdaInputs<float> in{s, options, q, k, v, graw, braw, A_log, dt_bias, nullptr, {}};
  const Activated a = activate(in);
  delta_rule_decode_step(s, a.q.data(), a.k.data(), v, a.g.data(), a.beta.data(), state, o);
}

}  // namespace kda::ops
