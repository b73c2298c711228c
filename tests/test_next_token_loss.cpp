// runtime::mean_next_token_loss, the float64 loss every model check compares with the
// fixtures' reference losses.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "core/error.h"
#include "core/random.h"
#include "core/tensor.h"
#include "runtime/next_token_loss.h"

namespace kda {
namespace {

// -log softmax(row)[target] by the plain formula in long double (no max subtracted): an
// independent reference for the log-sum-exp in double.
long double plain_loss(const float* row, int64_t V, int32_t target) {
  long double sum = 0;
  for (int64_t v = 0; v < V; ++v) sum += std::exp((long double)row[v] - (long double)row[target]);
  return std::log(sum);
}

TEST(NextTokenLoss, MatchesThePlainFormulaOnRandomLogits) {
  for (uint64_t seed = 1; seed <= 6; ++seed) {
    Random rng(seed * 7919);
    const int64_t T = rng.integer(2, 40), V = rng.integer(2, 300);
    Tensor logits(DType::f32, {T, V});
    // an offset large enough that exp() of the raw logits would overflow a double
    rng.fill_normal(logits.span_f32(), 4.f);
    const float offset = rng.uniform(-800.f, 800.f);
    for (float& x : logits.span_f32()) x += offset;
    std::vector<int32_t> ids(static_cast<size_t>(T));
    for (int32_t& id : ids) id = int32_t(rng.integer(0, V - 1));
    long double want = 0;
    for (int64_t t = 0; t + 1 < T; ++t) want += plain_loss(logits.f32() + t * V, V, ids[t + 1]);
    want /= (long double)(T - 1);
    const double got = runtime::mean_next_token_loss(logits, ids);
    ASSERT_TRUE(std::isfinite(got)) << "seed " << seed;
    EXPECT_NEAR(got, double(want), 1e-9 * std::max(1.0, double(want))) << "seed " << seed;
  }
}

TEST(NextTokenLoss, EqualLogitsGiveTheLogOfTheVocabulary) {
  const int64_t T = 5, V = 97;
  const Tensor logits = Tensor::filled({T, V}, 3.25f);
  const std::vector<int32_t> ids = {4, 0, 96, 50, 7};
  EXPECT_NEAR(runtime::mean_next_token_loss(logits, ids), std::log(97.0), 1e-12);
}

TEST(NextTokenLoss, OnlyTheNextTokenOfEachRowCounts) {
  // Row t is certain of ids[t + 1]; the last row and ids[0] take no part.
  const int64_t T = 4, V = 6;
  Tensor logits = Tensor::filled({T, V}, 0.f);
  const std::vector<int32_t> ids = {5, 1, 2, 3};
  for (int64_t t = 0; t + 1 < T; ++t) logits.f32()[t * V + ids[size_t(t) + 1]] = 60.f;
  logits.f32()[(T - 1) * V + 0] = -60.f;  // the last row is never read
  EXPECT_LT(runtime::mean_next_token_loss(logits, ids), 1e-20);
}

TEST(NextTokenLoss, RefusesWhatItCannotScore) {
  const Tensor logits = Tensor::filled({3, 4}, 1.f);
  EXPECT_THROW(runtime::mean_next_token_loss(logits, std::vector<int32_t>{1, 2}), Error);
  EXPECT_THROW(runtime::mean_next_token_loss(logits, std::vector<int32_t>{1, 2, 4}), Error);
  EXPECT_THROW(runtime::mean_next_token_loss(logits, std::vector<int32_t>{1, -1, 2}), Error);
  EXPECT_THROW(runtime::mean_next_token_loss(Tensor::filled({1, 4}, 1.f), std::vector<int32_t>{1}),
               Error);
  EXPECT_THROW(
      runtime::mean_next_token_loss(Tensor(DType::bf16, {3, 4}), std::vector<int32_t>{1, 2, 3}),
      Error);
}

}  // namespace
}  // namespace kda
