// CausalLM's default batched decode step: each sequence fed in turn, after checking them all.
#include "model/causal_lm.h"

#include <algorithm>
#include <string>

#include "core/error.h"

namespace kda::model {

// The checks every decode_batch makes before feeding anything: one id per session, ids in the
// vocabulary, distinct sessions, room for one more token in each.
void check_decode_batch(const CausalLM& lm, std::span<Session* const> sessions,
                        std::span<const int32_t> ids) {
  require(!sessions.empty() && sessions.size() == ids.size(),
          "decode_batch: one id per session (got " + std::to_string(sessions.size()) +
              " sessions, " + std::to_string(ids.size()) + " ids)");
  for (size_t n = 0; n < sessions.size(); ++n) {
    Session* s = sessions[n];
    require(s != nullptr, "decode_batch: a null session");
    require(ids[n] >= 0 && ids[n] < lm.vocab_size(),
            "decode_batch: token id " + std::to_string(ids[n]) + " is outside the vocabulary");
    require(s->max_context() == 0 || s->length() + 1 <= s->max_context(),
            "decode_batch: sequence " + std::to_string(n) + " is at its context limit of " +
                std::to_string(s->max_context()));
    require(std::find(sessions.begin(), sessions.begin() + std::ptrdiff_t(n), s) ==
                sessions.begin() + std::ptrdiff_t(n),
            "decode_batch: a session appears twice");
  }
}

Tensor CausalLM::decode_batch(std::span<Session* const> sessions,
                              std::span<const int32_t> ids) const {
  check_decode_batch(*this, sessions, ids);
  const int64_t N = int64_t(sessions.size()), vocab = vocab_size();
  Tensor logits(DType::f32, {N, vocab});
  for (int64_t n = 0; n < N; ++n) {
    const Tensor row = sessions[size_t(n)]->feed_last(ids.subspan(size_t(n), 1));
    std::copy_n(row.f32(), vocab, logits.f32() + n * vocab);
  }
  return logits;
}

}  // namespace kda::model
