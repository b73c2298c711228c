#include "core/token_ids.h"

#include "core/error.h"

namespace kda {

namespace {

void require_in_range(std::span<const int32_t> values, int32_t lowest, int64_t vocab,
                      const std::string& what, const char* noun, const char* extra) {
  for (const int32_t v : values) {
    if (v >= lowest && v < vocab) continue;
    throw Error(what + ": " + noun + " " + std::to_string(v) + " is outside the vocabulary [0, " +
                std::to_string(vocab) + ")" + extra);
  }
}

}  // namespace

void require_token_ids(std::span<const int32_t> ids, int64_t vocab, const std::string& what) {
  require_in_range(ids, 0, vocab, what, "token id", "");
}

void require_targets(std::span<const int32_t> targets, int64_t vocab, const std::string& what) {
  require_in_range(targets, -1, vocab, what, "target", " (or -1)");
}

}  // namespace kda
