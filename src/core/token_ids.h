// Range checks over token ids and targets, written once: a per-token require() with a built
// message allocated strings for every token (~9 ms a step at 32 x 2048, longer than the GPU's
// share of a recall model's step), so the loop tests first and builds a message only to throw.
#pragma once
#include <cstdint>
#include <span>
#include <string>

namespace kda {

// Throws kda::Error "<what>: token id <id> is outside the vocabulary [0, <vocab>)" for the first
// id outside [0, vocab).
void require_token_ids(std::span<const int32_t> ids, int64_t vocab, const std::string& what);

// The same for targets, where -1 (an unscored position) is also allowed.
void require_targets(std::span<const int32_t> targets, int64_t vocab, const std::string& what);

}  // namespace kda
