#include <cmath>
#include <string>

#include "core/error.h"
#include "ops/delta_rule/delta_rule.h"

namespace kda::ops {

double DeltaRuleShape::effective_scale() const {
  return scale != 0 ? scale : 1.0 / std::sqrt(double(K));
}

void DeltaRuleShape::validate() const {
  require(B >= 1 && T >= 1 && H >= 1 && HV >= 1 && K >= 1 && V >= 1,
          "delta rule: sizes must be positive (B=" + std::to_string(B) + " T=" + std::to_string(T) +
              " H=" + std::to_string(H) + " HV=" + std::to_string(HV) + " K=" + std::to_string(K) +
              " V=" + std::to_string(V) + ")");
  require(HV % H == 0, "delta rule: value heads HV = " + std::to_string(HV) +
                           " must be a multiple of q/k heads H = " + std::to_string(H));
  require(std::isfinite(scale), "delta rule: scale is not finite");
}

double delta_rule_chunk_forward_flops_per_token(const DeltaRuleShape& s, int chunk) {
  // Per chunk of C tokens and value head: L and M (2 C^2 K each), U and W (2 C^2 V, 2 C^2 K),
  // the C x C solve (C^3 / 3), W S0 and Q S0 (2 C K V each), M D (2 C^2 V; counted full),
  // the state update (2 C K V). Divided by C tokens.
  const double C = chunk, K = double(s.K), V = double(s.V);
  const double per_chunk = 2 * C * C * K * 2 + 2 * C * C * V + 2 * C * C * K + C * C * C / 3 +
                           2 * C * K * V * 3 + 2 * C * C * V;
  return per_chunk / C * double(s.HV);
}

}  // namespace kda::ops
