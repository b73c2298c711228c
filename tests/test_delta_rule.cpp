// The delta-rule family (DeltaNet, Gated DeltaNet, KDA): chunked and recurrent fp32 paths held
// against the float64 recurrence, decode against prefill, gradients against finite differences.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "core/error.h"
#include "delta_rule_test_util.h"

namespace kda {
namespace {

using ops::DeltaRuleShape;
using ops::Gate;
using testing::rel_error;

std::string gate_name(Gate g) {
  return g == Gate::none ? "delta" : g == Gate::scalar ? "gated_delta" : "kda";
}

struct Case {
  Gate gate;
  int64_t B, T, H, HV, K, V;
  std::vector<int64_t> cu_seqlens;
};

std::vector<Case> forward_cases() {
  std::vector<Case> cases;
  for (Gate gate : {Gate::none, Gate::scalar, Gate::channel}) {
    cases.push_back({gate, 1, 1, 2, 2, 16, 16, {}});                        // T = 1
    cases.push_back({gate, 2, 63, 1, 1, 32, 24, {}});                       // below one chunk
    cases.push_back({gate, 1, 64, 2, 2, 32, 32, {}});                       // exactly one chunk
    cases.push_back({gate, 2, 65, 2, 4, 16, 32, {}});                       // one past, GVA
    cases.push_back({gate, 1, 300, 1, 2, 32, 16, {}});                      // many chunks
    cases.push_back({gate, 1, 230, 2, 2, 16, 16, {0, 37, 101, 229, 230}});  // varlen, len 1
  }
  return cases;
}

TEST(DeltaRule, ChunkedAndRecurrentMatchFloat64Reference) {
  uint64_t seed = 100;
  for (const Case& c : forward_cases()) {
    const DeltaRuleShape shape{c.B, c.T, c.H, c.HV, c.K, c.V, c.gate, 0};
    const auto p = testing::random_delta_problem(seed++, shape, c.cu_seqlens);
    const auto ref = testing::run_reference(p);
    auto o = testing::poisoned(p.o_size()), ht = testing::poisoned(p.state_size());
    ops::delta_rule_chunk_forward(p.inputs(), o.data(), ht.data());
    const std::string what = gate_name(c.gate) + " T=" + std::to_string(c.T);
    EXPECT_LE(rel_error(o, ref.o), 1e-5) << what;
    EXPECT_LE(rel_error(ht, ref.ht), 1e-5) << what;
    auto o2 = testing::poisoned(p.o_size()), ht2 = testing::poisoned(p.state_size());
    ops::delta_rule_recurrent_forward(p.inputs(), o2.data(), ht2.data());
    EXPECT_LE(rel_error(o2, ref.o), 1e-5) << what;
    EXPECT_LE(rel_error(ht2, ref.ht), 1e-5) << what;
  }
}

TEST(DeltaRule, StrongDecayCutsChunksAndStaysExact) {
  // log-gates down to -8 per token: 64 tokens would decay by exp(-500), far past fp32 range
  const DeltaRuleShape shape{1, 200, 2, 2, 32, 32, Gate::channel, 0};
  const auto p = testing::random_delta_problem(7, shape, {}, true, -8.0f, -0.001f);
  const auto ref = testing::run_reference(p);
  auto o = testing::poisoned(p.o_size()), ht = testing::poisoned(p.state_size());
  ops::delta_rule_chunk_forward(p.inputs(), o.data(), ht.data());
  EXPECT_LE(rel_error(o, ref.o), 1e-5);
  EXPECT_LE(rel_error(ht, ref.ht), 1e-5);
}

TEST(DeltaRule, SingleTokenDecayPastExpRangeStaysExact) {
  // a channel forgetting everything in one token (log-gate below -87, where fast_exp clamps):
  // each such token is a chunk of its own, whose exp(G) exp(-G) must still be 1, forward and
  // backward (the backward against the chunked one on gates just inside the range)
  const DeltaRuleShape shape{1, 40, 1, 2, 16, 8, Gate::channel, 0};
  auto p = testing::random_delta_problem(11, shape, {}, true, -0.5f, -0.01f);
  for (size_t i = 0; i < p.g.size(); i += 3) p.g[i] = -90.0f - 30.0f * float(i % 7);
  const auto ref = testing::run_reference(p);
  auto o = testing::poisoned(p.o_size()), ht = testing::poisoned(p.state_size());
  ops::delta_rule_chunk_forward(p.inputs(), o.data(), ht.data());
  EXPECT_LE(rel_error(o, ref.o), 1e-5);
  EXPECT_LE(rel_error(ht, ref.ht), 1e-5);
  // gradients: a decay of e^-90 and one of e^-86 differ by < 1e-37 in every output, so the
  // gradients of q, k, v, beta and h0 must match a problem whose gates sit at -86 instead (the
  // float64 finite differences of ChunkedBackwardMatchesFiniteDifferences hold dg there too)
  auto clamped = p;
  for (float& g : clamped.g) g = std::max(g, -86.0f);
  Random rng(12);
  std::vector<float> d_o(p.o_size()), d_ht(p.state_size());
  rng.fill_normal(d_o);
  rng.fill_normal(d_ht);
  std::vector<std::vector<float>> grads[2];
  for (int run = 0; run < 2; ++run) {
    const auto& prob = run ? clamped : p;
    auto& gr = grads[run];
    gr = {testing::poisoned(prob.q.size()),    testing::poisoned(prob.k.size()),
          testing::poisoned(prob.v.size()),    testing::poisoned(prob.g.size()),
          testing::poisoned(prob.beta.size()), testing::poisoned(prob.h0.size())};
    ops::delta_rule_chunk_backward(
        prob.inputs(), d_o.data(), d_ht.data(),
        {gr[0].data(), gr[1].data(), gr[2].data(), gr[3].data(), gr[4].data(), gr[5].data()}, 64);
  }
  for (int t : {0, 1, 2, 4, 5}) EXPECT_LE(rel_error(grads[0][t], grads[1][t]), 1e-5) << t;
}

TEST(DeltaRule, DecodeStepByStepMatchesPrefill) {
  uint64_t seed = 200;
  for (Gate gate : {Gate::none, Gate::scalar, Gate::channel}) {
    // prefill the first T0 tokens chunked, then decode the rest one token at a time
    const int64_t N = 3, T = 90, T0 = 70, H = 2, HV = 4, K = 16, V = 24;
    const DeltaRuleShape shape{N, T, H, HV, K, V, gate, 0};
    const auto p = testing::random_delta_problem(seed++, shape);
    const auto ref = testing::run_reference(p);
    const int64_t gw = shape.gate_width();
    auto slice = [&](const std::vector<float>& x, int64_t width, int64_t t_begin, int64_t t_end) {
      std::vector<float> out;
      for (int64_t n = 0; n < N; ++n)
        for (int64_t t = t_begin; t < t_end; ++t)
          out.insert(out.end(), x.begin() + (n * T + t) * width,
                     x.begin() + (n * T + t + 1) * width);
      return out;
    };
    DeltaRuleShape prefix = shape;
    prefix.T = T0;
    const auto q0 = slice(p.q, H * K, 0, T0), k0 = slice(p.k, H * K, 0, T0),
               v0 = slice(p.v, HV * V, 0, T0), b0 = slice(p.beta, HV, 0, T0);
    const auto g0 = gw ? slice(p.g, HV * gw, 0, T0) : std::vector<float>{};
    std::vector<float> o0(N * T0 * HV * V), state(p.state_size());
    ops::delta_rule_chunk_forward(
        {prefix, q0.data(), k0.data(), v0.data(), gw ? g0.data() : nullptr, b0.data(), p.h0.data()},
        o0.data(), state.data());
    double worst = 0;
    for (int64_t t = T0; t < T; ++t) {
      const auto q = slice(p.q, H * K, t, t + 1), k = slice(p.k, H * K, t, t + 1),
                 v = slice(p.v, HV * V, t, t + 1), b = slice(p.beta, HV, t, t + 1);
      const auto g = gw ? slice(p.g, HV * gw, t, t + 1) : std::vector<float>{};
      auto o = testing::poisoned(N * HV * V);
      ops::delta_rule_decode_step(shape, q.data(), k.data(), v.data(), gw ? g.data() : nullptr,
                                  b.data(), state.data(), o.data());
      std::vector<double> want;
      for (int64_t n = 0; n < N; ++n)
        want.insert(want.end(), ref.o.begin() + (n * T + t) * HV * V,
                    ref.o.begin() + (n * T + t + 1) * HV * V);
      worst = std::max(worst, rel_error(o, want));
    }
    EXPECT_LE(worst, 1e-5) << gate_name(gate);
    EXPECT_LE(rel_error(state, ref.ht), 1e-5) << gate_name(gate);
  }
}

// Central finite differences of the float64 reference for every element of `x`.
std::vector<double> finite_difference(testing::DeltaProblem p,
                                      std::vector<float> testing::DeltaProblem::*field,
                                      const std::vector<double>& d_o,
                                      const std::vector<double>& d_ht) {
  // perturb in double: evaluate the reference on double copies directly
  const auto base_q = testing::to_double(p.q), base_k = testing::to_double(p.k),
             base_v = testing::to_double(p.v), base_g = testing::to_double(p.g),
             base_b = testing::to_double(p.beta), base_h = testing::to_double(p.h0);
  std::vector<double>* target = nullptr;
  std::vector<double> q = base_q, k = base_k, v = base_v, g = base_g, b = base_b, h = base_h;
  if (field == &testing::DeltaProblem::q) target = &q;
  if (field == &testing::DeltaProblem::k) target = &k;
  if (field == &testing::DeltaProblem::v) target = &v;
  if (field == &testing::DeltaProblem::g) target = &g;
  if (field == &testing::DeltaProblem::beta) target = &b;
  if (field == &testing::DeltaProblem::h0) target = &h;
  std::vector<double> o(p.o_size()), ht(p.state_size()), grad(target->size());
  auto loss = [&]() {
    ops::delta_rule_reference(
        {p.shape, q.data(), k.data(), v.data(), g.empty() ? nullptr : g.data(), b.data(),
         h.empty() ? nullptr : h.data(), p.cu_seqlens},
        o.data(), ht.data());
    double l = 0;
    for (size_t i = 0; i < o.size(); ++i) l += o[i] * d_o[i];
    for (size_t i = 0; i < ht.size(); ++i) l += ht[i] * d_ht[i];
    return l;
  };
  const double eps = 1e-6;
  for (size_t i = 0; i < target->size(); ++i) {
    const double keep = (*target)[i];
    (*target)[i] = keep + eps;
    const double up = loss();
    (*target)[i] = keep - eps;
    const double down = loss();
    (*target)[i] = keep;
    grad[i] = (up - down) / (2 * eps);
  }
  return grad;
}

TEST(DeltaRule, ChunkedBackwardMatchesFiniteDifferences) {
  uint64_t seed = 300;
  struct GradCase {
    Gate gate;
    int64_t B, T, H, HV, K, V;
    int chunk;
    std::vector<int64_t> cu;
    float gate_lo;
    float beyond_exp = 0;  // < 0: every third gate set there (a one-token chunk each)
  };
  const std::vector<GradCase> cases = {
      {Gate::none, 2, 11, 1, 2, 6, 5, 4, {}, -0.3f},
      {Gate::scalar, 2, 11, 2, 2, 6, 5, 4, {}, -0.3f},
      {Gate::channel, 2, 11, 1, 2, 6, 5, 4, {}, -0.3f},
      {Gate::channel, 1, 1, 1, 1, 4, 3, 4, {}, -0.3f},
      {Gate::channel, 1, 13, 2, 2, 5, 4, 4, {0, 1, 6, 13}, -0.3f},
      {Gate::channel, 1, 12, 1, 1, 5, 4, 8, {}, -20.0f},         // decay cuts chunks short
      {Gate::channel, 1, 12, 1, 2, 5, 4, 8, {}, -0.5f, -90.0f},  // decays past fp32's exp
  };
  for (const GradCase& c : cases) {
    const DeltaRuleShape shape{c.B, c.T, c.H, c.HV, c.K, c.V, c.gate, 0};
    auto p = testing::random_delta_problem(seed++, shape, c.cu, true, c.gate_lo, -0.01f);
    if (c.beyond_exp < 0)
      for (size_t i = 0; i < p.g.size(); i += 3) p.g[i] = c.beyond_exp - 30.0f * float(i % 5);
    Random rng(seed++);
    std::vector<float> d_o(p.o_size()), d_ht(p.state_size());
    rng.fill_normal(d_o);
    rng.fill_normal(d_ht);
    const auto d_o64 = testing::to_double(d_o), d_ht64 = testing::to_double(d_ht);
    auto dq = testing::poisoned(p.q.size()), dk = testing::poisoned(p.k.size()),
         dv = testing::poisoned(p.v.size()), dg = testing::poisoned(p.g.size()),
         db = testing::poisoned(p.beta.size()), dh0 = testing::poisoned(p.h0.size());
    ops::delta_rule_chunk_backward(
        p.inputs(), d_o.data(), d_ht.data(),
        {dq.data(), dk.data(), dv.data(), dg.empty() ? nullptr : dg.data(), db.data(), dh0.data()},
        c.chunk);
    const std::string what = gate_name(c.gate) + " T=" + std::to_string(c.T);
    using P = testing::DeltaProblem;
    EXPECT_LE(rel_error(dq, finite_difference(p, &P::q, d_o64, d_ht64)), 1e-4) << what << " dq";
    EXPECT_LE(rel_error(dk, finite_difference(p, &P::k, d_o64, d_ht64)), 1e-4) << what << " dk";
    EXPECT_LE(rel_error(dv, finite_difference(p, &P::v, d_o64, d_ht64)), 1e-4) << what << " dv";
    EXPECT_LE(rel_error(db, finite_difference(p, &P::beta, d_o64, d_ht64)), 1e-4)
        << what << " dbeta";
    EXPECT_LE(rel_error(dh0, finite_difference(p, &P::h0, d_o64, d_ht64)), 1e-4) << what << " dh0";
    if (c.gate != Gate::none) {
      EXPECT_LE(rel_error(dg, finite_difference(p, &P::g, d_o64, d_ht64)), 1e-4) << what << " dg";
    }
  }
}

TEST(DeltaRule, RejectsBadArguments) {
  const DeltaRuleShape shape{1, 10, 2, 3, 8, 8, Gate::channel, 0};  // HV not a multiple of H
  auto p = testing::random_delta_problem(1, DeltaRuleShape{1, 10, 2, 4, 8, 8, Gate::channel, 0});
  std::vector<float> o(p.o_size()), ht(p.state_size());
  auto in = p.inputs();
  in.shape = shape;
  EXPECT_THROW(ops::delta_rule_chunk_forward(in, o.data(), ht.data()), Error);
  in = p.inputs();
  const std::vector<int64_t> not_increasing = {0, 5, 5, 10}, not_ending = {0, 4, 9};
  in.cu_seqlens = not_increasing;
  EXPECT_THROW(ops::delta_rule_chunk_forward(in, o.data(), ht.data()), Error);
  in.cu_seqlens = not_ending;
  EXPECT_THROW(ops::delta_rule_chunk_forward(in, o.data(), ht.data()), Error);
  p.v[17] = NAN;
  EXPECT_THROW(ops::delta_rule_chunk_forward(p.inputs(), o.data(), ht.data()), Error);
  p.v[17] = 0.5f;
  p.g[3] = INFINITY;
  EXPECT_THROW(ops::delta_rule_recurrent_forward(p.inputs(), o.data(), ht.data()), Error);
  p.g[3] = -0.1f;
  in = p.inputs();
  in.g = nullptr;
  EXPECT_THROW(ops::delta_rule_chunk_forward(in, o.data(), ht.data()), Error);
}

}  // namespace
}  // namespace kda
