// Ground truth for the delta-rule family: the plain recurrence in float64, token by token.
#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/common/sequences.h"
#include "ops/delta_rule/delta_rule.h"

namespace kda::ops {

void delta_rule_reference(const DeltaRuleInputs<double>& in, double* o, double* ht) {
  const DeltaRuleShape& s = in.shape;
  s.validate();
  const SequenceLayout seqs(s.B, s.T, in.cu_seqlens);
  const int64_t H = s.H, HV = s.HV, K = s.K, V = s.V, group = HV / H;
  const int64_t gw = s.gate_width();
  const double scale = s.effective_scale();
  std::vector<double> S(K * V), pk(V);
  for (int64_t n = 0; n < seqs.num_sequences(); ++n) {
    for (int64_t hv = 0; hv < HV; ++hv) {
      const int64_t h = hv / group;
      if (in.h0) {
        for (int64_t i = 0; i < K * V; ++i) S[i] = in.h0[(n * HV + hv) * K * V + i];
      } else {
        std::fill(S.begin(), S.end(), 0.0);
      }
      for (int64_t t = 0; t < seqs.length(n); ++t) {
        const int64_t tok = seqs.start(n) + t;
        const double* q = in.q + (tok * H + h) * K;
        const double* k = in.k + (tok * H + h) * K;
        const double* v = in.v + (tok * HV + hv) * V;
        const double beta = in.beta[tok * HV + hv];
        if (gw > 0) {
          const double* g = in.g + (tok * HV + hv) * gw;
          for (int64_t i = 0; i < K; ++i) {
            const double decay = std::exp(g[gw == 1 ? 0 : i]);
            for (int64_t j = 0; j < V; ++j) S[i * V + j] *= decay;
          }
        }
        std::fill(pk.begin(), pk.end(), 0.0);
        for (int64_t i = 0; i < K; ++i)
          for (int64_t j = 0; j < V; ++j) pk[j] += k[i] * S[i * V + j];
        for (int64_t j = 0; j < V; ++j) pk[j] = beta * (v[j] - pk[j]);  // the written increment
        for (int64_t i = 0; i < K; ++i)
          for (int64_t j = 0; j < V; ++j) S[i * V + j] += k[i] * pk[j];
        double* out = o + (tok * HV + hv) * V;
        for (int64_t j = 0; j < V; ++j) out[j] = 0;
        for (int64_t i = 0; i < K; ++i)
          for (int64_t j = 0; j < V; ++j) out[j] += scale * q[i] * S[i * V + j];
      }
      if (ht) {
        for (int64_t i = 0; i < K * V; ++i) ht[(n * HV + hv) * K * V + i] = S[i];
      }
    }
  }
}

}  // namespace kda::ops
