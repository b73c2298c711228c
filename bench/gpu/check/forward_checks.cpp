// Forward checks: the chunked forward (bf16 tensor-core path) and the fp32 recurrent path of
// KDA, Gated DeltaNet and DeltaNet against the float64 reference (delta_rule_reference), o and
// the final states ht, each named with the kernel-lab knobs it ran under.
#include "bench/gpu/check/check_common.h"

#include <cstdio>
#include <string>
#include <vector>

namespace kda_gpu_check {

void check_forward(Gate gate, int64_t B, int64_t T, int64_t H, int64_t HV, int64_t K, int64_t V,
                   std::vector<int64_t> cu, bool with_h0, ElementType t, bool recurrent,
                   uint64_t seed, int strength) {
  DeltaRuleShape s{B, T, H, HV, K, V, gate, 0};
  const Inputs in = make_inputs(s, cu, with_h0, seed, strength);
  const Uploaded u = upload_all(in, t);
  const Reference ref =
      reference(in, u.q.rounded, u.k.rounded, u.v.rounded,
                in.g.empty() ? std::vector<double>{} : u.g.rounded, u.beta.rounded, u.h0_rounded);
  const ForwardResult got = run_forward(in, u, t, recurrent);
  char name[160];
  std::snprintf(name, sizeof name, "%s %s %s B%lld T%lld H%lld HV%lld K%lld V%lld%s%s%s%s",
                recurrent ? "recurrent" : "chunk", gate_name(gate),
                t == ElementType::bf16 ? "bf16" : "fp32", (long long)B, (long long)T, (long long)H,
                (long long)HV, (long long)K, (long long)V, cu.empty() ? "" : " varlen",
                with_h0 ? " h0" : "",
                strength == 1   ? " strong-g"
                : strength == 2 ? " wide-decay"
                                : "",
                knob_tags().c_str());
  const double tol = t == ElementType::bf16 ? 5e-3 : 1e-4;
  report(name, "o", rel_rms(got.o, ref.o), tol);
  report(name, "ht", rel_rms(got.ht, ref.ht), tol);
}

}  // namespace kda_gpu_check
