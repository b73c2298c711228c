// Snapshots of sequences, keyed by the token ids they have consumed: a request whose prompt
// starts with a snapshot's ids continues from a copy of it instead of prefilling those tokens
// again (a shared system prompt, or the earlier turns of a chat, which the client sends again
// with every turn). For the KDA layers a snapshot is their fixed state, whatever the length; the
// MLA / softmax layers' caches are copied row by row. Least recently used entries go first.
// Not thread-safe: only the scheduler's worker thread uses it.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/tensor.h"
#include "model/causal_lm.h"

namespace kda::server {

class PrefixCache {
 public:
  explicit PrefixCache(int64_t max_entries) : max_entries_(max_entries) {}

  struct Hit {
    std::unique_ptr<model::Session> session;  // a copy, the caller's to feed
    int64_t tokens = 0;                       // prompt tokens it has consumed
    Tensor last_logits;                       // set when tokens is the whole prompt
  };
  // The longest snapshot whose ids begin the prompt (all of it only when its last logits are
  // stored); an empty hit when none.
  Hit lookup(std::span<const int32_t> prompt);
  // Keeps a copy of `session`, which has consumed `ids` (and whose last logits are
  // `last_logits`, or an empty tensor); nothing when the backend cannot copy sessions.
  void store(std::vector<int32_t> ids, const model::Session& session, const Tensor& last_logits);

  int64_t size() const { return int64_t(entries_.size()); }

 private:
  struct Entry {
    std::vector<int32_t> ids;
    std::unique_ptr<model::Session> session;
    Tensor last_logits;
    uint64_t last_used = 0;
  };
  int64_t max_entries_;
  std::vector<Entry> entries_;
  uint64_t clock_ = 0;
};

}  // namespace kda::server
