// float64 ground truth for a KDA layer's mixer: activations in double, then the recurrence.
#include <vector>

#include "core/error.h"
#include "ops/common/sequences.h"
#include "ops/kda/kda.h"
#include "ops/kda/kda_activations.h"

namespace kda::ops {

void kda_reference(const KdaInputs<double>& in, double* o, double* ht) {
  const DeltaRuleShape& s = in.shape;
  s.validate();
  require(s.gate == Gate::channel, "kda: the shape's gate must be per channel");
  const int64_t tokens = s.B * s.T;
  std::vector<double> q(tokens * s.H * s.K), k(q.size()), g(tokens * s.HV * s.K),
      beta(tokens * s.HV);
  if (in.options.l2norm_qk) {
    detail::l2norm_rows(in.q, tokens * s.H, s.K, q.data());
    detail::l2norm_rows(in.k, tokens * s.H, s.K, k.data());
  } else {
    q.assign(in.q, in.q + q.size());
    k.assign(in.k, in.k + k.size());
  }
  detail::kda_gate_forward(in.options, in.graw, in.A_log, in.dt_bias, tokens, s.HV, s.K, g.data());
  for (size_t i = 0; i < beta.size(); ++i) beta[i] = detail::sigmoid(in.braw[i]);
  delta_rule_reference({s, q.data(), k.data(), in.v, g.data(), beta.data(), in.h0, in.cu_seqlens},
                       o, ht);
}

}  // namespace kda::ops
