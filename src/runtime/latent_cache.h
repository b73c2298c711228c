// The growing part of hybrid memory: per-token latent rows of MLA layers (fp32 here), kept in
// fixed-size pages taken from a pool. A sequence's cache for one layer is a page table; pages
// are handed out on demand and go back to the pool when the cache is cleared or destroyed, so a
// server can later share one pool across sequences (and pages across prefixes).
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace kda::runtime {

constexpr int64_t kDefaultPageTokens = 256;

// Pages of page_tokens rows x row_width floats. Storage is allocated when a page is first
// needed and then recycled through a free list; at most max_pages are in use at once.
class LatentPagePool {
 public:
  LatentPagePool(int64_t row_width, int64_t page_tokens, int64_t max_pages);

  int64_t row_width() const { return row_width_; }
  int64_t page_tokens() const { return page_tokens_; }
  int64_t max_pages() const { return max_pages_; }
  int64_t page_bytes() const { return row_width_ * page_tokens_ * int64_t(sizeof(float)); }
  int64_t pages_in_use() const { return in_use_; }
  int64_t pages_allocated() const { return int64_t(storage_.size()); }

  // A free page (its contents are stale); throws kda::Error when max_pages are in use.
  int32_t acquire();
  void release(int32_t page);
  float* data(int32_t page);
  const float* data(int32_t page) const;

 private:
  int64_t row_width_, page_tokens_, max_pages_;
  std::vector<std::unique_ptr<float[]>> storage_;
  std::vector<int32_t> free_;
  std::vector<char> busy_;
  int64_t in_use_ = 0;
};

// One sequence's latent rows for one layer, at most max_tokens of them.
class LatentCache {
 public:
  LatentCache(std::shared_ptr<LatentPagePool> pool, int64_t max_tokens);
  ~LatentCache();
  LatentCache(LatentCache&&) noexcept;
  LatentCache& operator=(LatentCache&&) noexcept;
  LatentCache(const LatentCache&) = delete;
  LatentCache& operator=(const LatentCache&) = delete;

  int64_t length() const { return length_; }
  int64_t max_tokens() const { return max_tokens_; }
  int64_t row_width() const { return pool_->row_width(); }
  int64_t page_tokens() const { return pool_->page_tokens(); }
  // Pointers to the pages in order (the last may be partly filled).
  std::span<const float* const> pages() const { return page_data_; }

  // Throws kda::Error (changing nothing) unless `tokens` more rows fit under max_tokens and the
  // pool can supply the pages they need.
  void check_room(int64_t tokens) const;
  // Appends rows [tokens, row_width]; all or nothing.
  void append(const float* rows, int64_t tokens);
  // Copies every row into out [length, row_width].
  void gather(float* out) const;
  void clear();  // forgets the rows, returns the pages to the pool

  int64_t bytes_used() const { return length_ * row_width() * int64_t(sizeof(float)); }
  int64_t bytes_reserved() const { return int64_t(page_ids_.size()) * pool_->page_bytes(); }

 private:
  std::shared_ptr<LatentPagePool> pool_;
  int64_t max_tokens_;
  int64_t length_ = 0;
  std::vector<int32_t> page_ids_;
  std::vector<const float*> page_data_;
};

}  // namespace kda::runtime
