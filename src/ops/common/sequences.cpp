#include "ops/common/sequences.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <string>

#include "core/error.h"

namespace kda::ops {

SequenceLayout::SequenceLayout(int64_t B, int64_t T, std::span<const int64_t> cu_seqlens) {
  require(B >= 1 && T >= 1, "batch and length must be positive (B = " + std::to_string(B) +
                                ", T = " + std::to_string(T) + ")");
  require(B <= (int64_t(1) << 40) / T, "batch x length is too large (B = " + std::to_string(B) +
                                           ", T = " + std::to_string(T) + ")");
  total_ = B * T;
  if (cu_seqlens.empty()) {
    for (int64_t b = 0; b < B; ++b) {
      starts_.push_back(b * T);
      lengths_.push_back(T);
    }
    return;
  }
  require(B == 1, "cu_seqlens needs the packed batch B = 1, got B = " + std::to_string(B));
  require(cu_seqlens.size() >= 2, "cu_seqlens needs at least two entries");
  require(cu_seqlens.front() == 0,
          "cu_seqlens must start at 0, got " + std::to_string(cu_seqlens.front()));
  for (size_t i = 1; i < cu_seqlens.size(); ++i) {
    require(cu_seqlens[i] > cu_seqlens[i - 1],
            "cu_seqlens must increase strictly, but entry " + std::to_string(i) + " is " +
                std::to_string(cu_seqlens[i]) + " after " + std::to_string(cu_seqlens[i - 1]));
    starts_.push_back(cu_seqlens[i - 1]);
    lengths_.push_back(cu_seqlens[i] - cu_seqlens[i - 1]);
  }
  require(cu_seqlens.back() == T, "cu_seqlens must end at T = " + std::to_string(T) + ", got " +
                                      std::to_string(cu_seqlens.back()));
}

// A finite float has an exponent field that is not all ones; the count vectorises.
static bool all_finite(const float* data, int64_t n) {
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = std::bit_cast<uint32_t>(data[i]);
    bad += (bits & 0x7f800000u) == 0x7f800000u;
  }
  return bad == 0;
}
static bool all_finite(const double* data, int64_t n) {
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t bits = std::bit_cast<uint64_t>(data[i]);
    bad += (bits & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
  }
  return bad == 0;
}

template <class F>
static void check_finite(const F* data, int64_t n, const char* what) {
  if (!data || all_finite(data, n)) return;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(data[i])) {
      throw Error(std::string(what) + " has a non-finite value at element " + std::to_string(i));
    }
  }
}

void require_finite(const float* data, int64_t n, const char* what) {
  check_finite(data, n, what);
}
void require_finite(const double* data, int64_t n, const char* what) {
  check_finite(data, n, what);
}

}  // namespace kda::ops
