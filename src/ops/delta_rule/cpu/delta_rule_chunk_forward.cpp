// Chunked fp32 forward of the delta-rule family: within a chunk the WY/UT form with matrix
// products; between chunks the state passed forward. Parallel over (sequence, value head).
#include <algorithm>
#include <vector>

#include "core/parallel.h"
#include "ops/common/sequences.h"
#include "ops/delta_rule/cpu/chunk_math.h"
#include "ops/delta_rule/cpu/validate.h"
#include "ops/delta_rule/delta_rule.h"

namespace kda::ops {

void delta_rule_chunk_forward(const DeltaRuleInputs<float>& in, float* o, float* ht, int chunk) {
  const SequenceLayout seqs = detail::validate_inputs(in, chunk);
  const DeltaRuleShape& s = in.shape;
  const int64_t K = s.K, V = s.V, HV = s.HV, group = s.HV / s.H;
  const float scale = float(s.effective_scale());
  parallel_for(seqs.num_sequences() * HV, [&](int64_t job) {
    const int64_t n = job / HV, hv = job % HV, h = hv / group;
    const int64_t start = seqs.start(n);
    thread_local std::vector<float> S;
    S.assign(K * V, 0.0f);
    if (in.h0) std::copy_n(in.h0 + (n * HV + hv) * K * V, K * V, S.data());
    detail::ChunkWork work(K, V, chunk);
    const std::vector<int64_t> cuts = detail::plan_chunks(in, start, seqs.length(n), hv, chunk);
    for (size_t c = 0; c + 1 < cuts.size(); ++c) {
      const int64_t t0 = cuts[c], C = cuts[c + 1] - cuts[c];
      work.load_and_prepare(in, start, t0, C, h, hv);
      work.compute_d(S.data());
      work.compute_output(S.data(), scale, o + ((start + t0) * HV + hv) * V, HV * V);
      work.advance_state(S.data());
    }
    if (ht) std::copy_n(S.data(), K * V, ht + (n * HV + hv) * K * V);
  });
}

}  // namespace kda::ops
