// Random problems for the delta-rule family, in fp32 and the matching float64 copy.
#pragma once
#include <cmath>
#include <vector>

#include "core/random.h"
#include "ops/delta_rule/delta_rule.h"

namespace kda::testing {

// ||a - b|| / ||b|| over n elements; NaN anywhere gives +inf (never passes).
template <class A, class B>
double rel_error(const A* a, const B* b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    const double x = double(a[i]), y = double(b[i]);
    if (!std::isfinite(x) || !std::isfinite(y)) return INFINITY;
    num += (x - y) * (x - y);
    den += y * y;
  }
  return den == 0 ? (num == 0 ? 0 : INFINITY) : std::sqrt(num / den);
}

template <class A, class B>
double rel_error(const std::vector<A>& a, const std::vector<B>& b) {
  return a.size() == b.size() ? rel_error(a.data(), b.data(), a.size()) : INFINITY;
}

inline std::vector<double> to_double(const std::vector<float>& x) {
  return std::vector<double>(x.begin(), x.end());
}

inline std::vector<float> poisoned(size_t n) {
  return std::vector<float>(n, NAN);
}

struct DeltaProblem {
  ops::DeltaRuleShape shape;
  std::vector<int64_t> cu_seqlens;
  std::vector<float> q, k, v, g, beta, h0;
  int64_t num_sequences = 0;

  ops::DeltaRuleInputs<float> inputs() const {
    return {shape,
            q.data(),
            k.data(),
            v.data(),
            g.empty() ? nullptr : g.data(),
            beta.data(),
            h0.empty() ? nullptr : h0.data(),
            cu_seqlens};
  }
  size_t o_size() const { return size_t(shape.B * shape.T * shape.HV * shape.V); }
  size_t state_size() const { return size_t(num_sequences * shape.HV * shape.K * shape.V); }
};

// Normalised keys/queries (as KDA layers feed them), beta in (0, 1), gates log-space in
// [gate_lo, gate_hi] (<= 0 for decay).
inline DeltaProblem random_delta_problem(uint64_t seed, ops::DeltaRuleShape shape,
                                         std::vector<int64_t> cu_seqlens = {}, bool with_h0 = true,
                                         float gate_lo = -0.3f, float gate_hi = -0.01f) {
  Random rng(seed);
  DeltaProblem p;
  p.shape = shape;
  p.cu_seqlens = std::move(cu_seqlens);
  p.num_sequences = p.cu_seqlens.empty() ? shape.B : int64_t(p.cu_seqlens.size()) - 1;
  const int64_t tokens = shape.B * shape.T;
  auto normalised_rows = [&](std::vector<float>& x, int64_t rows, int64_t width) {
    x.resize(rows * width);
    rng.fill_normal(x);
    for (int64_t r = 0; r < rows; ++r) {
      double n2 = 0;
      for (int64_t c = 0; c < width; ++c) n2 += double(x[r * width + c]) * x[r * width + c];
      const float inv = float(1.0 / std::sqrt(n2 + 1e-12));
      for (int64_t c = 0; c < width; ++c) x[r * width + c] *= inv;
    }
  };
  normalised_rows(p.q, tokens * shape.H, shape.K);
  normalised_rows(p.k, tokens * shape.H, shape.K);
  p.v.resize(tokens * shape.HV * shape.V);
  rng.fill_normal(p.v);
  p.beta.resize(tokens * shape.HV);
  rng.fill_uniform(p.beta, 0.05f, 0.95f);
  if (shape.gate_width() > 0) {
    p.g.resize(tokens * shape.HV * shape.gate_width());
    rng.fill_uniform(p.g, gate_lo, gate_hi);
  }
  if (with_h0) {
    p.h0.resize(p.state_size());
    rng.fill_normal(p.h0, 0.5f);
  }
  return p;
}

struct DeltaReference {
  std::vector<double> o, ht;
};

inline DeltaReference run_reference(const DeltaProblem& p) {
  const auto q = to_double(p.q), k = to_double(p.k), v = to_double(p.v), g = to_double(p.g),
             beta = to_double(p.beta), h0 = to_double(p.h0);
  DeltaReference r;
  r.o.resize(p.o_size());
  r.ht.resize(p.state_size());
  ops::delta_rule_reference({p.shape, q.data(), k.data(), v.data(), g.empty() ? nullptr : g.data(),
                             beta.data(), h0.empty() ? nullptr : h0.data(), p.cu_seqlens},
                            r.o.data(), r.ht.data());
  return r;
}

}  // namespace kda::testing
