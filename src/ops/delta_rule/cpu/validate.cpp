#include "ops/delta_rule/cpu/validate.h"

#include <string>

#include "core/error.h"

namespace kda::ops::detail {

SequenceLayout validate_inputs(const DeltaRuleInputs<float>& in, int chunk) {
  const DeltaRuleShape& s = in.shape;
  s.validate();
  require(chunk >= 1 && chunk <= 256,
          "delta rule: chunk size must be in [1, 256], got " + std::to_string(chunk));
  require(in.q && in.k && in.v && in.beta, "delta rule: q, k, v and beta are required");
  require(s.gate == Gate::none || in.g, "delta rule: this gate kind needs g");
  SequenceLayout seqs(s.B, s.T, in.cu_seqlens);
  const int64_t tokens = s.B * s.T;
  require_finite(in.q, tokens * s.H * s.K, "q");
  require_finite(in.k, tokens * s.H * s.K, "k");
  require_finite(in.v, tokens * s.HV * s.V, "v");
  require_finite(in.beta, tokens * s.HV, "beta");
  if (s.gate != Gate::none) require_finite(in.g, tokens * s.HV * s.gate_width(), "g");
  if (in.h0) require_finite(in.h0, seqs.num_sequences() * s.HV * s.K * s.V, "h0");
  return seqs;
}

}  // namespace kda::ops::detail
