// The backward passes the Kimi Linear training model adds to the ops (short convolution + SiLU,
// sigmoid-gated RMSNorm, rsqrt L2 normalisation) against float64 central finite differences of
// sum(y * dy), on fresh random inputs, with NaN-poisoned outputs; and the training models' LM
// head over the scored rows against its float64 formula.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "core/random.h"
#include "ops/conv1d/conv1d.h"
#include "ops/norm/norm.h"
#include "train/layers.h"

namespace kda {
namespace {

double rel(const std::vector<float>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::isfinite(num) ? std::sqrt(num / den) : INFINITY;
}

// d/dp of f at p (central differences, double).
std::vector<double> numeric_grad(std::vector<double>& p, const std::function<double()>& f) {
  std::vector<double> g(p.size());
  for (size_t i = 0; i < p.size(); ++i) {
    const double keep = p[i], h = 1e-6 * std::max(1.0, std::abs(keep));
    p[i] = keep + h;
    const double up = f();
    p[i] = keep - h;
    const double down = f();
    p[i] = keep;
    g[i] = (up - down) / (2 * h);
  }
  return g;
}

std::vector<float> as_float(const std::vector<double>& v) {
  return std::vector<float>(v.begin(), v.end());
}

std::vector<double> random_vector(Random& rng, size_t n, double scale = 1.0) {
  std::vector<double> v(n);
  for (double& x : v) x = scale * rng.normal();
  return v;
}

TEST(TrainOpBackward, ShortConvSiluMatchesFiniteDifferences) {
  Random rng(901);
  for (const int64_t T : {1, 3, 11}) {
    const int64_t C = 6, W = 4;
    std::vector<double> x = random_vector(rng, size_t(T * C)), w = random_vector(rng, C * W, 0.5),
                        dy = random_vector(rng, size_t(T * C));
    auto loss = [&] {
      std::vector<double> state(size_t((W - 1) * C), 0.0), y(size_t(T * C));
      ops::short_conv_silu_reference(x.data(), T, C, w.data(), W, state.data(), y.data());
      double s = 0;
      for (size_t i = 0; i < y.size(); ++i) s += y[i] * dy[i];
      return s;
    };
    const std::vector<double> want_dx = numeric_grad(x, loss), want_dw = numeric_grad(w, loss);
    const std::vector<float> xf = as_float(x), wf = as_float(w), dyf = as_float(dy);
    std::vector<float> dx(size_t(T * C), std::numeric_limits<float>::quiet_NaN());
    std::vector<float> dw(size_t(C * W), 0.0f);
    ops::short_conv_silu_backward(xf.data(), T, C, C, wf.data(), W, dyf.data(), dx.data(), C,
                                  dw.data());
    EXPECT_LE(rel(dx, want_dx), 1e-5) << "T " << T;
    EXPECT_LE(rel(dw, want_dw), 1e-5) << "T " << T;
  }
}

TEST(TrainOpBackward, GatedRmsNormSigmoidMatchesFiniteDifferences) {
  Random rng(902);
  const int64_t rows = 5, D = 8;
  const float eps = 1e-5f;
  std::vector<double> x = random_vector(rng, rows * D), gate = random_vector(rng, rows * D),
                      w = random_vector(rng, D), dy = random_vector(rng, rows * D);
  auto loss = [&] {
    double s = 0;
    for (int64_t r = 0; r < rows; ++r) {
      double ss = 0;
      for (int64_t i = 0; i < D; ++i) ss += x[r * D + i] * x[r * D + i];
      const double inv = 1.0 / std::sqrt(ss / D + eps);
      for (int64_t i = 0; i < D; ++i) {
        const double sig = 1.0 / (1.0 + std::exp(-gate[r * D + i]));
        s += w[i] * x[r * D + i] * inv * sig * dy[r * D + i];
      }
    }
    return s;
  };
  const std::vector<double> want_dx = numeric_grad(x, loss), want_dg = numeric_grad(gate, loss),
                            want_dw = numeric_grad(w, loss);
  const std::vector<float> xf = as_float(x), gf = as_float(gate), wf = as_float(w),
                           dyf = as_float(dy);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> dx(x.size(), nan), dg(x.size(), nan), dw(size_t(D), 0.0f);
  ops::gated_rms_norm_sigmoid_backward(xf.data(), gf.data(), rows, D, wf.data(), eps, dyf.data(),
                                       dx.data(), dg.data(), dw.data());
  EXPECT_LE(rel(dx, want_dx), 1e-5);
  EXPECT_LE(rel(dg, want_dg), 1e-5);
  EXPECT_LE(rel(dw, want_dw), 1e-5);
}

TEST(TrainOpBackward, L2NormalizeRowsMatchesFiniteDifferences) {
  Random rng(903);
  const int64_t rows = 4, D = 16;
  const float eps = 1e-6f;
  // one row of small values, where eps matters
  std::vector<double> x = random_vector(rng, rows * D), dy = random_vector(rng, rows * D);
  for (int64_t i = 0; i < D; ++i) x[i] *= 1e-3;
  auto loss = [&] {
    double s = 0;
    for (int64_t r = 0; r < rows; ++r) {
      double ss = 0;
      for (int64_t i = 0; i < D; ++i) ss += x[r * D + i] * x[r * D + i];
      const double inv = 1.0 / std::sqrt(ss + eps);
      for (int64_t i = 0; i < D; ++i) s += x[r * D + i] * inv * dy[r * D + i];
    }
    return s;
  };
  const std::vector<double> want = numeric_grad(x, loss);
  const std::vector<float> xf = as_float(x), dyf = as_float(dy);
  std::vector<float> dx(x.size(), std::numeric_limits<float>::quiet_NaN());
  ops::l2_normalize_rows_backward(xf.data(), rows, D, eps, dyf.data(), dx.data());
  EXPECT_LE(rel(dx, want), 1e-5);
}

// lm_head_cross_entropy runs the head over the scored rows alone: its loss, counts, dh (zero on
// the unscored rows) and dW (accumulated) must equal the full head's float64 formula, whether
// some, all or none of the rows are scored.
TEST(TrainOpBackward, LmHeadOverScoredRowsMatchesTheFullHead) {
  const int64_t rows = 37, D = 24, V = 50;
  for (const double p_scored : {0.3, 1.0, 0.0}) {
    Random rng(uint64_t(100 + 10 * p_scored));
    const std::vector<double> h = random_vector(rng, size_t(rows * D));
    const std::vector<double> W = random_vector(rng, size_t(V * D), 0.3);
    const std::vector<double> dW0 = random_vector(rng, size_t(V * D));
    std::vector<int32_t> targets(static_cast<size_t>(rows));
    for (auto& t : targets) t = rng.uniform(0, 1) < p_scored ? int32_t(rng.integer(0, V - 1)) : -1;
    // float64 reference over every row
    int64_t n = 0, hits = 0;
    for (int32_t t : targets) n += t >= 0;
    double loss = 0;
    std::vector<double> dh(size_t(rows * D), 0.0), dW = dW0;
    for (int64_t r = 0; r < rows; ++r) {
      if (targets[size_t(r)] < 0) continue;
      std::vector<double> logit(static_cast<size_t>(V));
      for (int64_t v = 0; v < V; ++v)
        for (int64_t k = 0; k < D; ++k)
          logit[size_t(v)] += h[size_t(r * D + k)] * W[size_t(v * D + k)];
      const int64_t best = std::max_element(logit.begin(), logit.end()) - logit.begin();
      hits += best == targets[size_t(r)];
      double sum = 0;
      for (double l : logit) sum += std::exp(l - logit[size_t(best)]);
      loss += logit[size_t(best)] + std::log(sum) - logit[size_t(targets[size_t(r)])];
      for (int64_t v = 0; v < V; ++v) {
        const double d =
            (std::exp(logit[size_t(v)] - logit[size_t(best)]) / sum - (v == targets[size_t(r)])) /
            double(n);
        for (int64_t k = 0; k < D; ++k) {
          dh[size_t(r * D + k)] += d * W[size_t(v * D + k)];
          dW[size_t(v * D + k)] += d * h[size_t(r * D + k)];
        }
      }
    }
    if (n) loss /= double(n);

    const std::vector<float> hf = as_float(h), Wf = as_float(W);
    std::vector<float> dhf(size_t(rows * D), std::numeric_limits<float>::quiet_NaN());
    std::vector<float> dWf = as_float(dW0);
    int64_t scored = -1, correct = -1;
    const double got = train::lm_head_cross_entropy(hf.data(), targets.data(), rows, D, Wf.data(),
                                                    V, dhf.data(), dWf.data(), &scored, &correct);
    EXPECT_EQ(scored, n) << p_scored;
    EXPECT_EQ(correct, hits) << p_scored;
    EXPECT_NEAR(got, loss, 1e-5 * std::max(1.0, loss)) << p_scored;
    for (int64_t r = 0; r < rows; ++r) {
      if (targets[size_t(r)] >= 0) continue;
      for (int64_t k = 0; k < D; ++k) ASSERT_EQ(dhf[size_t(r * D + k)], 0.0f) << r;
    }
    if (n) {
      EXPECT_LT(rel(dhf, dh), 1e-5) << p_scored;
    }
    EXPECT_LT(rel(dWf, dW), 1e-6) << p_scored;
    // without dh (evaluation): the same loss, dW untouched
    const std::vector<float> dW_before = dWf;
    const double eval = train::lm_head_cross_entropy(hf.data(), targets.data(), rows, D, Wf.data(),
                                                     V, nullptr, dWf.data(), nullptr, nullptr);
    EXPECT_EQ(eval, got);
    EXPECT_EQ(dWf, dW_before);
  }
}

}  // namespace
}  // namespace kda
