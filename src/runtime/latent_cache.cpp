#include "runtime/latent_cache.h"

#include <algorithm>
#include <limits>
#include <string>

#include "core/error.h"

namespace kda::runtime {

LatentPagePool::LatentPagePool(int64_t row_width, int64_t page_tokens, int64_t max_pages)
    : row_width_(row_width), page_tokens_(page_tokens), max_pages_(max_pages) {
  require(row_width >= 1 && page_tokens >= 1 && max_pages >= 0,
          "latent page pool: row width and page tokens must be positive");
  require(max_pages <= std::numeric_limits<int32_t>::max(), "latent page pool: too many pages");
}

int32_t LatentPagePool::acquire() {
  require(in_use_ < max_pages_, "latent page pool: all " + std::to_string(max_pages_) +
                                    " pages are in use (context limit reached)");
  int32_t page;
  if (!free_.empty()) {
    page = free_.back();
    free_.pop_back();
  } else {
    page = int32_t(storage_.size());
    storage_.push_back(std::make_unique<float[]>(size_t(row_width_ * page_tokens_)));
    busy_.push_back(0);
  }
  busy_[page] = 1;
  ++in_use_;
  return page;
}

void LatentPagePool::release(int32_t page) {
  require(page >= 0 && page < int32_t(storage_.size()) && busy_[page],
          "latent page pool: releasing a page that is not in use");
  busy_[page] = 0;
  --in_use_;
  free_.push_back(page);
}

float* LatentPagePool::data(int32_t page) {
  return storage_.at(size_t(page)).get();
}

const float* LatentPagePool::data(int32_t page) const {
  return storage_.at(size_t(page)).get();
}

LatentCache::LatentCache(std::shared_ptr<LatentPagePool> pool, int64_t max_tokens)
    : pool_(std::move(pool)), max_tokens_(max_tokens) {
  require(pool_ != nullptr, "latent cache: no page pool");
  require(max_tokens >= 0, "latent cache: max_tokens must be non-negative");
}

LatentCache::~LatentCache() {
  if (pool_) clear();
}

LatentCache::LatentCache(LatentCache&& other) noexcept
    : pool_(std::move(other.pool_)),
      max_tokens_(other.max_tokens_),
      length_(other.length_),
      page_ids_(std::move(other.page_ids_)),
      page_data_(std::move(other.page_data_)) {
  other.length_ = 0;
}

LatentCache& LatentCache::operator=(LatentCache&& other) noexcept {
  if (this != &other) {
    if (pool_) clear();
    pool_ = std::move(other.pool_);
    max_tokens_ = other.max_tokens_;
    length_ = other.length_;
    page_ids_ = std::move(other.page_ids_);
    page_data_ = std::move(other.page_data_);
    other.length_ = 0;
  }
  return *this;
}

void LatentCache::check_room(int64_t tokens) const {
  require(tokens >= 0, "latent cache: negative token count");
  require(length_ + tokens <= max_tokens_,
          "latent cache: " + std::to_string(length_) + " + " + std::to_string(tokens) +
              " tokens would pass the context limit of " + std::to_string(max_tokens_));
  const int64_t pt = pool_->page_tokens();
  const int64_t needed = (length_ + tokens + pt - 1) / pt - int64_t(page_ids_.size());
  require(needed <= pool_->max_pages() - pool_->pages_in_use(),
          "latent cache: the page pool has no room for " + std::to_string(tokens) + " more tokens");
}

void LatentCache::append(const float* rows, int64_t tokens) {
  check_room(tokens);
  const int64_t pt = pool_->page_tokens(), width = pool_->row_width();
  while (int64_t(page_ids_.size()) * pt < length_ + tokens) {
    const int32_t page = pool_->acquire();
    page_ids_.push_back(page);
    page_data_.push_back(pool_->data(page));
  }
  for (int64_t i = 0; i < tokens;) {
    const int64_t at = length_ + i, page = at / pt, offset = at % pt;
    const int64_t n = std::min(tokens - i, pt - offset);
    std::copy_n(rows + i * width, n * width, pool_->data(page_ids_[page]) + offset * width);
    i += n;
  }
  length_ += tokens;
}

void LatentCache::gather(float* out) const {
  const int64_t pt = pool_->page_tokens(), width = pool_->row_width();
  for (int64_t first = 0; first < length_; first += pt) {
    const int64_t n = std::min(pt, length_ - first);
    std::copy_n(page_data_[first / pt], n * width, out + first * width);
  }
}

void LatentCache::clear() {
  for (int32_t page : page_ids_) pool_->release(page);
  page_ids_.clear();
  page_data_.clear();
  length_ = 0;
}

}  // namespace kda::runtime
