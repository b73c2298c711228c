// Where each sequence of a batch lives in a token-major [B, T, ...] tensor: either B rows of
// T tokens, or (B = 1) sequences packed back to back and delimited by cu_seqlens.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

namespace kda::ops {

class SequenceLayout {
 public:
  // Validates: with cu_seqlens, B must be 1, cu_seqlens must start at 0, increase strictly and
  // end at T. Throws kda::Error naming the problem.
  SequenceLayout(int64_t B, int64_t T, std::span<const int64_t> cu_seqlens = {});

  int64_t num_sequences() const { return int64_t(starts_.size()); }
  int64_t start(int64_t n) const { return starts_[n]; }  // flat token index of the first token
  int64_t length(int64_t n) const { return lengths_[n]; }
  int64_t total_tokens() const { return total_; }

 private:
  std::vector<int64_t> starts_, lengths_;
  int64_t total_ = 0;
};

// Throws kda::Error naming `what` if any of the n values is NaN or infinite.
void require_finite(const float* data, int64_t n, const char* what);
void require_finite(const double* data, int64_t n, const char* what);

}  // namespace kda::ops
