// SequenceLayout (B rows of T tokens, or packed sequences delimited by cu_seqlens) and
// require_finite: valid layouts map every token once; bad ones throw kda::Error naming the problem.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "ops/common/sequences.h"

namespace kda::ops {
namespace {

struct Span {
  int64_t start, length;
  bool operator==(const Span&) const = default;
};

std::vector<Span> spans_of(const SequenceLayout& layout) {
  std::vector<Span> spans;
  for (int64_t n = 0; n < layout.num_sequences(); ++n) {
    spans.push_back({layout.start(n), layout.length(n)});
  }
  return spans;
}

// Expects `make` to throw kda::Error whose message contains `reason`.
template <class F>
void expect_error(F make, std::string_view reason, const std::string& label) {
  SCOPED_TRACE(label);
  try {
    make();
    ADD_FAILURE() << "no error; wanted one about '" << reason << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(reason), std::string::npos) << e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not a kda::Error: " << e.what();
  }
}

TEST(CoreSequences, BatchLayoutHasBRowsOfT) {
  const SequenceLayout layout(3, 5);
  EXPECT_EQ(layout.num_sequences(), 3);
  EXPECT_EQ(layout.total_tokens(), 15);
  EXPECT_EQ(spans_of(layout), (std::vector<Span>{{0, 5}, {5, 5}, {10, 5}}));
}

TEST(CoreSequences, SingleTokenBatch) {
  const SequenceLayout layout(1, 1);
  EXPECT_EQ(spans_of(layout), (std::vector<Span>{{0, 1}}));
  EXPECT_EQ(layout.total_tokens(), 1);
}

TEST(CoreSequences, EmptyCuSeqlensMeansBatchLayout) {
  const std::vector<int64_t> none;
  const SequenceLayout layout(2, 4, none);
  EXPECT_EQ(spans_of(layout), (std::vector<Span>{{0, 4}, {4, 4}}));
}

TEST(CoreSequences, PackedLayoutFollowsCuSeqlens) {
  const std::vector<int64_t> cu = {0, 3, 4, 10};
  const SequenceLayout layout(1, 10, cu);
  EXPECT_EQ(layout.num_sequences(), 3);
  EXPECT_EQ(layout.total_tokens(), 10);
  EXPECT_EQ(spans_of(layout), (std::vector<Span>{{0, 3}, {3, 1}, {4, 6}}));
}

TEST(CoreSequences, PackedEdgeCases) {
  const std::vector<int64_t> one_token = {0, 1};
  EXPECT_EQ(spans_of(SequenceLayout(1, 1, one_token)), (std::vector<Span>{{0, 1}}));
  const std::vector<int64_t> whole = {0, 37};
  EXPECT_EQ(spans_of(SequenceLayout(1, 37, whole)), (std::vector<Span>{{0, 37}}));
  const std::vector<int64_t> all_single = {0, 1, 2, 3, 4, 5, 6};
  const SequenceLayout singles(1, 6, all_single);
  ASSERT_EQ(singles.num_sequences(), 6);
  for (int64_t n = 0; n < 6; ++n) {
    EXPECT_EQ(singles.start(n), n);
    EXPECT_EQ(singles.length(n), 1);
  }
}

// Random packings: the sequences tile [0, T) in order, each as long as cu_seqlens says.
TEST(CoreSequences, RandomPackingsTileTheTokens) {
  std::mt19937_64 rng(61);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<int64_t> cu = {0};
    const int count = 1 + int(rng() % 12);
    for (int n = 0; n < count; ++n) cu.push_back(cu.back() + 1 + int64_t(rng() % 70));
    const int64_t T = cu.back();
    const SequenceLayout layout(1, T, cu);
    ASSERT_EQ(layout.num_sequences(), count);
    EXPECT_EQ(layout.total_tokens(), T);
    int64_t next = 0;
    for (int n = 0; n < count; ++n) {
      EXPECT_EQ(layout.start(n), next);
      EXPECT_EQ(layout.length(n), cu[n + 1] - cu[n]);
      next += layout.length(n);
    }
    EXPECT_EQ(next, T);
  }
}

TEST(CoreSequences, RefusesNonPositiveSizes) {
  expect_error([] { SequenceLayout(0, 4); }, "positive", "B = 0");
  expect_error([] { SequenceLayout(-1, 4); }, "positive", "B = -1");
  expect_error([] { SequenceLayout(2, 0); }, "positive", "T = 0");
  expect_error([] { SequenceLayout(2, -3); }, "positive", "T = -3");
  const std::vector<int64_t> cu = {0, 0};
  expect_error([&] { SequenceLayout(1, 0, cu); }, "positive", "packed, T = 0");
}

TEST(CoreSequences, RefusesCuSeqlensWithABatch) {
  const std::vector<int64_t> cu = {0, 2, 4};
  expect_error([&] { SequenceLayout(2, 4, cu); }, "B = 1", "B = 2");
  expect_error([&] { SequenceLayout(3, 4, cu); }, "B = 1", "B = 3");
}

TEST(CoreSequences, RefusesCuSeqlensNotStartingAtZero) {
  const std::vector<std::vector<int64_t>> cases = {{1, 5}, {-1, 5}, {2, 3, 5}};
  for (const auto& cu : cases) {
    expect_error([&] { SequenceLayout(1, 5, cu); }, "start at 0",
                 "cu_seqlens from " + std::to_string(cu.front()));
  }
}

TEST(CoreSequences, RefusesCuSeqlensThatDoNotIncrease) {
  const std::vector<std::vector<int64_t>> cases = {
      {0, 3, 3, 5}, {0, 4, 2, 5}, {0, 0, 5}, {0, 5, 5}, {0, -1, 5}};
  for (const auto& cu : cases) {
    expect_error([&] { SequenceLayout(1, 5, cu); }, "increase strictly",
                 "cu_seqlens ending " + std::to_string(cu[cu.size() - 2]));
  }
}

TEST(CoreSequences, RefusesCuSeqlensNotEndingAtT) {
  const std::vector<std::vector<int64_t>> cases = {{0, 3}, {0, 6}, {0, 2, 4}, {0, 2, 9}};
  for (const auto& cu : cases) {
    expect_error([&] { SequenceLayout(1, 5, cu); }, "end at T",
                 "cu_seqlens ending at " + std::to_string(cu.back()));
  }
}

TEST(CoreSequences, RefusesCuSeqlensWithOneEntry) {
  const std::vector<int64_t> zero = {0}, five = {5};
  expect_error([&] { SequenceLayout(1, 5, zero); }, "two entries", "{0}");
  expect_error([&] { SequenceLayout(1, 5, five); }, "two entries", "{5}");
}

template <class F>
void check_require_finite() {
  std::mt19937_64 rng(71);
  std::uniform_real_distribution<F> uniform(-3, 3);
  std::vector<F> values(37);
  for (F& x : values) x = uniform(rng);
  // Finite extremes pass.
  values[3] = std::numeric_limits<F>::max();
  values[4] = std::numeric_limits<F>::lowest();
  values[5] = std::numeric_limits<F>::denorm_min();
  values[6] = F(-0.0);
  EXPECT_NO_THROW(require_finite(values.data(), int64_t(values.size()), "values"));
  EXPECT_NO_THROW(require_finite(values.data(), 0, "values"));

  const F bad_values[] = {std::numeric_limits<F>::quiet_NaN(), -std::numeric_limits<F>::quiet_NaN(),
                          std::numeric_limits<F>::signaling_NaN(),
                          std::numeric_limits<F>::infinity(), -std::numeric_limits<F>::infinity()};
  for (const F bad : bad_values) {
    for (const size_t at : {size_t(0), size_t(17), values.size() - 1}) {
      std::vector<F> poisoned = values;
      poisoned[at] = bad;
      expect_error([&] { require_finite(poisoned.data(), int64_t(poisoned.size()), "gate_log"); },
                   "gate_log has a non-finite value at element " + std::to_string(at),
                   std::to_string(bad) + " at " + std::to_string(at));
      // Only the first n values are looked at.
      EXPECT_NO_THROW(require_finite(poisoned.data(), int64_t(at), "gate_log"));
    }
  }
}

TEST(CoreSequences, RequireFiniteFloat) {
  check_require_finite<float>();
}
TEST(CoreSequences, RequireFiniteDouble) {
  check_require_finite<double>();
}

}  // namespace
}  // namespace kda::ops
