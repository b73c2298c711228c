#include "server/prefix_cache.h"

#include <algorithm>

namespace kda::server {

PrefixCache::Hit PrefixCache::lookup(std::span<const int32_t> prompt) {
  Entry* best = nullptr;
  for (Entry& e : entries_) {
    const bool whole = e.ids.size() == prompt.size();
    if (e.ids.size() > prompt.size() || (whole && e.last_logits.empty())) continue;
    if (!std::equal(e.ids.begin(), e.ids.end(), prompt.begin())) continue;
    if (!best || e.ids.size() > best->ids.size()) best = &e;
  }
  Hit hit;
  if (!best) return hit;
  hit.session = best->session->clone();
  if (!hit.session) return Hit{};
  best->last_used = ++clock_;
  hit.tokens = int64_t(best->ids.size());
  if (best->ids.size() == prompt.size())
    hit.last_logits = best->last_logits.reshaped(best->last_logits.shape());
  return hit;
}

void PrefixCache::store(std::vector<int32_t> ids, const model::Session& session,
                        const Tensor& last_logits) {
  if (max_entries_ <= 0 || ids.empty()) return;
  for (Entry& e : entries_) {
    if (e.ids == ids) {  // already held: only refresh it
      e.last_used = ++clock_;
      return;
    }
  }
  std::unique_ptr<model::Session> copy = session.clone();
  if (!copy) return;
  if (int64_t(entries_.size()) >= max_entries_) {
    const auto oldest =
        std::min_element(entries_.begin(), entries_.end(),
                         [](const Entry& a, const Entry& b) { return a.last_used < b.last_used; });
    entries_.erase(oldest);
  }
  entries_.push_back({std::move(ids), std::move(copy),
                      last_logits.empty() ? Tensor() : last_logits.reshaped(last_logits.shape()),
                      ++clock_});
}

}  // namespace kda::server
