// Argument checks shared by the delta-rule entry points.
#pragma once
#include "ops/common/sequences.h"
#include "ops/delta_rule/delta_rule.h"

namespace kda::ops::detail {

// Checks sizes, pointers, the chunk size, cu_seqlens and that every input is finite.
SequenceLayout validate_inputs(const DeltaRuleInputs<float>& in, int chunk);

}  // namespace kda::ops::detail
