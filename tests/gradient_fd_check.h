// Finite-difference checks of one trainable tensor's gradient, shared by the model tests.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "core/random.h"
#include "train/trainable_model.h"

namespace kda::testing {

struct GradientFdOptions {
  double max_step = 0.05;      // longest step along a unit direction (curvature beyond it)
  double along_tol = 2e-2;     // |fd / |g| - 1| along the gradient
  double random_tol = 5e-3;    // |fd - g.u| / |g on u's elements| along a sparse random direction
  double random_floor = 2e-5;  // ... plus this absolute slack (fp32 loss noise / step)
  int random_directions = 4;   // how many sparse random directions
  int coords = 8;              // elements a sparse direction moves
};

// Holds `p->grad` (computed for the current values) to central differences of `loss` (the
// model's loss at the current values, no backward), Richardson-extrapolated over two steps:
// along the gradient's own direction, which finds a wrong scale, and along random directions
// over a few random elements, which find what that cannot: elements the backward never wrote
// (they read 0, while the loss moves) and terms orthogonal to the gradient.
inline void check_gradient_fd(train::Param* p, const std::function<double()>& loss, double loss0,
                              Random& rng, const GradientFdOptions& opt, const std::string& what) {
  const int64_t n = p->value.numel();
  const std::vector<float> keep(p->value.f32(), p->value.f32() + n);
  const float* g = p->grad.f32();
  double gnorm2 = 0;
  for (int64_t i = 0; i < n; ++i) gnorm2 += double(g[i]) * g[i];
  const double gnorm = std::sqrt(gnorm2);

  // fd of the loss along u (unit, given on `idx`), with a step that moves it by ~2e-3 relative
  // when the slope is `slope`: fp32 losses carry ~1e-7 relative noise
  auto fd_along = [&](const std::vector<int64_t>& idx, const std::vector<double>& u, double slope) {
    const double eps = std::clamp(2e-3 * loss0 / std::max(slope, 1e-12), 1e-3, opt.max_step);
    auto at = [&](double s) {
      for (size_t j = 0; j < idx.size(); ++j)
        p->value.f32()[idx[j]] = float(keep[idx[j]] + s * u[j]);
      const double l = loss();
      for (const int64_t i : idx) p->value.f32()[i] = keep[i];
      return l;
    };
    auto central = [&](double e) { return (at(e) - at(-e)) / (2 * e); };
    return (4 * central(eps / 2) - central(eps)) / 3;
  };

  std::vector<int64_t> all(static_cast<size_t>(n));
  std::iota(all.begin(), all.end(), 0);
  std::vector<double> along(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) along[i] = g[i] / gnorm;
  const double fd = fd_along(all, along, gnorm);
  EXPECT_NEAR(fd / gnorm, 1.0, opt.along_tol) << what << " along the gradient, |g| " << gnorm;

  const int coords = int(std::min<int64_t>(opt.coords, n));
  for (int d = 0; d < opt.random_directions; ++d) {
    std::vector<int64_t> idx = all;  // `coords` distinct elements, a partial shuffle
    for (int j = 0; j < coords; ++j) std::swap(idx[j], idx[j + rng.integer(0, n - 1 - j)]);
    idx.resize(coords);
    std::vector<double> u(coords);
    double unorm2 = 0, gs2 = 0, expected = 0;
    for (double& x : u) x = rng.normal(), unorm2 += x * x;
    for (int j = 0; j < coords; ++j) {
      u[j] /= std::sqrt(unorm2);
      expected += u[j] * g[idx[j]];
      gs2 += double(g[idx[j]]) * g[idx[j]];
    }
    const double gs = std::sqrt(gs2);
    const double got = fd_along(idx, u, std::max(gs, 1e-3 * gnorm));
    EXPECT_LE(std::abs(got - expected), opt.random_tol * gs + opt.random_floor)
        << what << " random direction " << d << ": fd " << got << ", g.u " << expected
        << ", |g on its elements| " << gs;
  }
  std::copy(keep.begin(), keep.end(), p->value.f32());
}

}  // namespace kda::testing
