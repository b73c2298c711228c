// The mean next-token cross-entropy of one sequence's logits, in float64: what the fixtures'
// reference losses (transformers' `labels=input_ids`) and the model checks compare against.
#pragma once
#include <cstdint>
#include <span>

#include "core/tensor.h"

namespace kda::runtime {

// logits: [T, V] f32, row t predicting ids[t + 1]; mean over t < T - 1 of
// logsumexp(logits[t]) - logits[t][ids[t + 1]]. Throws kda::Error unless T = ids.size() >= 2
// and every id lies in [0, V).
double mean_next_token_loss(const Tensor& logits, std::span<const int32_t> ids);

}  // namespace kda::runtime
