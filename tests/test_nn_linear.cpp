// ops::linear's one-token path (the decode matrix-vector product, four rows at a time, large
// matrices shared with helper threads) and its few-row path (a batched decode step) against a
// float64 reference: row counts that are and are not multiples of four or of the block, short
// and long rows, with and without bias, and linear_accumulate.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "core/random.h"
#include "delta_rule_test_util.h"
#include "ops/nn/nn.h"

namespace kda {
namespace {

using testing::poisoned;
using testing::rel_error;

std::vector<float> random_vector(Random& rng, size_t n) {
  std::vector<float> v(n);
  rng.fill_normal(v);
  return v;
}

TEST(NnLinear, OneTokenMatchesFloat64) {
  Random rng(5);
  for (const int64_t in : {1, 7, 16, 100, 300, 1031}) {
    for (const int64_t out : {1, 3, 4, 5, 67, 1001}) {
      const std::vector<float> x = random_vector(rng, size_t(in));
      const std::vector<float> W = random_vector(rng, size_t(out * in));
      const std::vector<float> bias = random_vector(rng, size_t(out));
      const std::vector<float> start = random_vector(rng, size_t(out));
      const size_t n = static_cast<size_t>(out);
      std::vector<double> want(n), want_bias(n), want_acc(n);
      for (int64_t o = 0; o < out; ++o) {
        double dot = 0;
        for (int64_t i = 0; i < in; ++i) dot += double(W[o * in + i]) * x[i];
        want[o] = dot;
        want_bias[o] = dot + bias[o];
        want_acc[o] = dot + start[o];
      }
      std::vector<float> y = poisoned(size_t(out));
      ops::linear(x.data(), 1, in, W.data(), out, nullptr, y.data());
      EXPECT_LE(rel_error(y, want), 1e-6) << in << " x " << out;
      y = poisoned(size_t(out));
      ops::linear(x.data(), 1, in, W.data(), out, bias.data(), y.data());
      EXPECT_LE(rel_error(y, want_bias), 1e-6) << in << " x " << out << " with bias";
      y = start;
      ops::linear_accumulate(x.data(), 1, in, W.data(), out, y.data());
      EXPECT_LE(rel_error(y, want_acc), 1e-6) << in << " x " << out << " accumulating";
    }
  }
}

// Large products are split into row blocks shared with helper threads: every block is written,
// every time (poisoned outputs, many calls in a row, as decode makes them).
TEST(NnLinear, SharedRowBlocksAreAllWrittenEveryCall) {
  Random rng(9);
  const int64_t in = 700, out = 2051;
  const std::vector<float> x = random_vector(rng, size_t(in));
  const std::vector<float> W = random_vector(rng, size_t(out * in));
  std::vector<double> want(static_cast<size_t>(out));
  for (int64_t o = 0; o < out; ++o) {
    double dot = 0;
    for (int64_t i = 0; i < in; ++i) dot += double(W[o * in + i]) * x[i];
    want[o] = dot;
  }
  for (int call = 0; call < 200; ++call) {
    std::vector<float> y = poisoned(size_t(out));
    ops::linear(x.data(), 1, in, W.data(), out, nullptr, y.data());
    ASSERT_LE(rel_error(y, want), 1e-6) << "call " << call;
  }
}

// A few rows (a batched decode step: 2-16 rows take the few-row product, more a GEMM): every
// row against float64, row counts that are and are not multiples of four, products small and
// large enough to be shared with the helper threads (700 x 2051), with and without bias, and
// linear_accumulate; outputs poisoned, large products repeated.
TEST(NnLinear, FewRowsMatchFloat64) {
  Random rng(13);
  for (const int64_t T : {2, 3, 4, 5, 7, 8, 16, 17}) {
    for (const auto& [in, out] :
         {std::pair<int64_t, int64_t>{7, 1}, {300, 5}, {1031, 67}, {16, 3}, {700, 2051}}) {
      const std::vector<float> x = random_vector(rng, size_t(T * in));
      const std::vector<float> W = random_vector(rng, size_t(out * in));
      const std::vector<float> bias = random_vector(rng, size_t(out));
      const std::vector<float> start = random_vector(rng, size_t(T * out));
      const size_t n = static_cast<size_t>(T * out);
      std::vector<double> want(n), want_bias(n), want_acc(n);
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t o = 0; o < out; ++o) {
          double dot = 0;
          for (int64_t i = 0; i < in; ++i) dot += double(W[o * in + i]) * x[t * in + i];
          want[t * out + o] = dot;
          want_bias[t * out + o] = dot + bias[o];
          want_acc[t * out + o] = dot + start[t * out + o];
        }
      }
      const std::string shape =
          std::to_string(T) + " rows, " + std::to_string(in) + " x " + std::to_string(out);
      const int calls = out * in >= (1 << 16) ? 20 : 1;
      for (int call = 0; call < calls; ++call) {
        std::vector<float> y = poisoned(n);
        ops::linear(x.data(), T, in, W.data(), out, nullptr, y.data());
        ASSERT_LE(rel_error(y, want), 1e-6) << shape << ", call " << call;
      }
      std::vector<float> y = poisoned(n);
      ops::linear(x.data(), T, in, W.data(), out, bias.data(), y.data());
      EXPECT_LE(rel_error(y, want_bias), 1e-6) << shape << " with bias";
      y = start;
      ops::linear_accumulate(x.data(), T, in, W.data(), out, y.data());
      EXPECT_LE(rel_error(y, want_acc), 1e-6) << shape << " accumulating";
    }
  }
}

}  // namespace
}  // namespace kda
