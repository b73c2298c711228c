// The ops under Kimi Linear: causal short conv + SiLU (prefill against float64, decode and
// pieces against prefill), gated RMSNorm and L2 normalisation, MoE routing (selection by biased
// score, weights from the unbiased one) and grouped expert evaluation, MLA absorbed and
// expanded forms against float64, and the paged latent cache.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/random.h"
#include "delta_rule_test_util.h"
#include "ops/conv1d/conv1d.h"
#include "ops/mla/mla.h"
#include "ops/moe/moe.h"
#include "ops/norm/norm.h"
#include "runtime/latent_cache.h"

namespace kda {
namespace {

using testing::poisoned;
using testing::rel_error;
using testing::to_double;

std::vector<float> random_vector(Random& rng, size_t n, float sd = 1.0f) {
  std::vector<float> x(n);
  rng.fill_normal(x, sd);
  return x;
}

// --- short convolution ---

TEST(KimiLinearShortConv, PrefillMatchesReference) {
  Random rng(1);
  for (const auto& [T, C, W] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {37, 70, 4}, {1, 9, 4}, {2, 300, 4}, {16, 5, 1}, {11, 8, 3}}) {
    const std::vector<float> x = random_vector(rng, size_t(T * C));
    const std::vector<float> w = random_vector(rng, size_t(C * W), 0.5f);
    std::vector<float> state = random_vector(rng, size_t((W - 1) * C));
    std::vector<double> state_ref = to_double(state);
    std::vector<float> y = poisoned(size_t(T * C));
    std::vector<double> y_ref(y.size());
    ops::short_conv_silu_forward(x.data(), T, C, C, w.data(), W, state.data(), y.data());
    ops::short_conv_silu_reference(to_double(x).data(), T, C, to_double(w).data(), W,
                                   state_ref.data(), y_ref.data());
    EXPECT_LE(rel_error(y, y_ref), 1e-6) << T << " " << C << " " << W;
    if (W > 1) {
      EXPECT_EQ(rel_error(state, state_ref), 0.0) << T << " " << C << " " << W;
    }
  }
}

// Prefill in pieces (some shorter than the window, one token through the decode step, rows
// read with a stride) continues exactly where one whole prefill would be.
TEST(KimiLinearShortConv, DecodeAndPiecesEqualPrefill) {
  Random rng(2);
  const int64_t T = 23, C = 40, W = 4, stride = 52;
  const std::vector<float> x = random_vector(rng, size_t(T * stride));
  const std::vector<float> w = random_vector(rng, size_t(C * W), 0.5f);
  const std::vector<float> state0 = random_vector(rng, size_t((W - 1) * C));
  std::vector<float> whole_state = state0, whole = poisoned(size_t(T * C));
  ops::short_conv_silu_forward(x.data(), T, C, stride, w.data(), W, whole_state.data(),
                               whole.data());
  std::vector<float> state = state0, pieces = poisoned(size_t(T * C));
  int64_t at = 0;
  for (int64_t n : {1, 2, 5, 1, 1, 7, 1, 5}) {
    if (n == 1) {
      ops::short_conv_silu_decode_step(x.data() + at * stride, C, w.data(), W, state.data(),
                                       pieces.data() + at * C);
    } else {
      ops::short_conv_silu_forward(x.data() + at * stride, n, C, stride, w.data(), W, state.data(),
                                   pieces.data() + at * C);
    }
    at += n;
  }
  ASSERT_EQ(at, T);
  // Same sums; the compiler may contract them into FMAs differently in the two loops.
  EXPECT_LE(rel_error(pieces, whole), 1e-6);
  EXPECT_EQ(rel_error(state, whole_state), 0.0);  // the windows are copies
}

TEST(KimiLinearShortConv, BadSizesThrow) {
  float x[4] = {1, 2, 3, 4}, w[4] = {1, 1, 1, 1}, s[4] = {}, y[4];
  EXPECT_THROW(ops::short_conv_silu_forward(x, 1, 2, 1, w, 2, s, y), Error);  // stride < C
  EXPECT_THROW(ops::short_conv_silu_forward(x, 1, 0, 1, w, 2, s, y), Error);
  EXPECT_THROW(ops::short_conv_silu_decode_step(x, 2, w, 0, s, y), Error);
}

// --- norms ---

TEST(KimiLinearNorm, GatedRmsNormAndL2Norm) {
  Random rng(3);
  const int64_t rows = 7, D = 24;
  const std::vector<float> x = random_vector(rng, size_t(rows * D), 0.3f);
  const std::vector<float> gate = random_vector(rng, size_t(rows * D));
  const std::vector<float> weight = random_vector(rng, size_t(D), 0.2f);
  std::vector<float> y = poisoned(x.size()), l2 = poisoned(x.size());
  ops::gated_rms_norm_sigmoid(x.data(), gate.data(), rows, D, weight.data(), 1e-5f, y.data());
  ops::l2_normalize_rows(x.data(), rows, D, 1e-6f, l2.data());
  std::vector<double> want(x.size()), want_l2(x.size());
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += double(x[r * D + i]) * x[r * D + i];
    for (int64_t i = 0; i < D; ++i) {
      const int64_t j = r * D + i;
      want[j] = weight[i] * x[j] / std::sqrt(ss / D + 1e-5) / (1 + std::exp(-double(gate[j])));
      want_l2[j] = x[j] / std::sqrt(ss + 1e-6);
    }
  }
  EXPECT_LE(rel_error(y, want), 1e-6);
  EXPECT_LE(rel_error(l2, want_l2), 1e-6);
  // In place.
  std::vector<float> inplace = x;
  ops::gated_rms_norm_sigmoid(inplace.data(), gate.data(), rows, D, weight.data(), 1e-5f,
                              inplace.data());
  EXPECT_EQ(rel_error(inplace, y), 0.0);
}

// --- MoE ---

TEST(KimiLinearMoe, RoutingPicksByBiasedScoreWeightsByUnbiased) {
  ops::MoeRouting r;
  r.num_experts = 4;
  r.top_k = 2;
  r.scaling = 2.446;
  // Scores sigmoid(2, 1, 0, -1) = 0.881, 0.731, 0.5, 0.269; the bias lifts expert 2 to 1.4.
  const float logits[4] = {2.0f, 1.0f, 0.0f, -1.0f};
  const float bias[4] = {0.0f, 0.0f, 0.9f, 0.0f};
  int32_t ids[2] = {-1, -1};
  float weights[2] = {NAN, NAN};
  ops::moe_route_sigmoid(r, logits, 1, bias, ids, weights);
  EXPECT_EQ(ids[0], 2);
  EXPECT_EQ(ids[1], 0);
  const double s0 = 1 / (1 + std::exp(-2.0)), s2 = 0.5;
  EXPECT_NEAR(weights[0], s2 / (s0 + s2) * 2.446, 1e-6);
  EXPECT_NEAR(weights[1], s0 / (s0 + s2) * 2.446, 1e-6);
  // Without the bias the two best plain scores win.
  ops::moe_route_sigmoid(r, logits, 1, nullptr, ids, weights);
  EXPECT_EQ(ids[0], 0);
  EXPECT_EQ(ids[1], 1);
  // Without renormalisation the weights are the scaled scores.
  r.renormalize = false;
  ops::moe_route_sigmoid(r, logits, 1, bias, ids, weights);
  EXPECT_NEAR(weights[0], s2 * 2.446, 1e-6);
  EXPECT_NEAR(weights[1], s0 * 2.446, 1e-6);
}

TEST(KimiLinearMoe, GroupedRoutingKeepsTheBestGroup) {
  ops::MoeRouting r;
  r.num_experts = 6;
  r.top_k = 2;
  r.num_groups = 2;
  r.topk_groups = 1;
  // Group 0 = experts 0..2 (best two 3 + 0 -> 3.0 in choice terms via sigmoid), group 1 = 3..5.
  // Expert 0 alone is the best expert, but group 1's two best sum higher.
  const float logits[6] = {4.0f, -3.0f, -3.0f, 2.0f, 2.0f, -3.0f};
  int32_t ids[2];
  float weights[2];
  ops::moe_route_sigmoid(r, logits, 1, nullptr, ids, weights);
  EXPECT_EQ(std::min(ids[0], ids[1]), 3);
  EXPECT_EQ(std::max(ids[0], ids[1]), 4);
  r.topk_groups = 2;
  ops::moe_route_sigmoid(r, logits, 1, nullptr, ids, weights);
  EXPECT_EQ(ids[0], 0);
  r.top_k = 7;
  EXPECT_THROW(ops::moe_route_sigmoid(r, logits, 1, nullptr, ids, weights), Error);
}

// y[t] += sum_j w_j expert_j(x_t), evaluated naively in float64 per token.
TEST(KimiLinearMoe, GroupedExpertsEqualPerTokenReference) {
  Random rng(4);
  const int64_t T = 9, D = 20, I = 12, E = 5, k = 2;
  std::vector<std::vector<float>> gate_up, down;
  std::vector<ops::SwigluWeights> experts;
  for (int64_t e = 0; e < E; ++e) {
    gate_up.push_back(random_vector(rng, size_t(2 * I * D), 0.3f));
    down.push_back(random_vector(rng, size_t(D * I), 0.3f));
  }
  for (int64_t e = 0; e < E; ++e) experts.push_back({gate_up[e].data(), down[e].data()});
  const std::vector<float> x = random_vector(rng, size_t(T * D));
  std::vector<int32_t> ids(T * k);
  std::vector<float> w = random_vector(rng, size_t(T * k));
  for (int64_t t = 0; t < T; ++t) {  // two different experts per token; expert 4 never chosen
    ids[t * k] = int32_t(t % 4);
    ids[t * k + 1] = int32_t((t + 1 + t / 4) % 4);
    if (ids[t * k + 1] == ids[t * k]) ids[t * k + 1] = int32_t((ids[t * k] + 1) % 4);
  }
  std::vector<float> y = random_vector(rng, size_t(T * D));
  std::vector<double> want = to_double(y);
  auto expert_ref = [&](int64_t e, const float* xt, double* out, double scale) {
    for (int64_t d = 0; d < D; ++d) {
      double acc = 0;
      for (int64_t i = 0; i < I; ++i) {
        double g = 0, u = 0;
        for (int64_t j = 0; j < D; ++j) {
          g += double(gate_up[e][i * D + j]) * xt[j];
          u += double(gate_up[e][(I + i) * D + j]) * xt[j];
        }
        acc += double(down[e][d * I + i]) * g / (1 + std::exp(-g)) * u;
      }
      out[d] += scale * acc;
    }
  };
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j)
      expert_ref(ids[t * k + j], &x[t * D], &want[t * D], w[t * k + j]);
  ops::MoeWorkspace ws;
  ops::moe_experts_accumulate(x.data(), T, D, I, experts, ids.data(), w.data(), k, y.data(), ws);
  EXPECT_LE(rel_error(y, want), 1e-6);
  // One token (the decode shape) and the dense MLP.
  std::vector<float> y1 = poisoned(size_t(D));
  ops::swiglu_mlp(x.data(), 1, D, I, experts[4], y1.data(), ws);
  std::vector<double> want1(D, 0.0);
  expert_ref(4, x.data(), want1.data(), 1.0);
  EXPECT_LE(rel_error(y1, want1), 1e-6);
  ids[3] = 5;
  EXPECT_THROW(ops::moe_experts_accumulate(x.data(), T, D, I, experts, ids.data(), w.data(), k,
                                           y.data(), ws),
               Error);
}

// --- MLA ---

struct MlaCase {
  ops::MlaShape shape;
  int64_t past, T, page_tokens;
};

TEST(KimiLinearMla, AbsorbedAndExpandedMatchReference) {
  Random rng(5);
  ops::MlaShape s;
  s.H = 3;
  s.nope = 8;
  s.rope = 4;
  s.v = 6;
  s.latent = 10;
  ops::MlaShape no_rope = s;
  no_rope.rope = 0;
  ops::MlaShape scaled = s;
  scaled.scale = 0.3;
  for (const MlaCase& c : std::vector<MlaCase>{{s, 36, 1, 8},
                                               {s, 32, 5, 8},
                                               {s, 0, 37, 8},
                                               {s, 0, 1, 8},
                                               {s, 30, 70, 16},
                                               {no_rope, 9, 3, 4},
                                               {scaled, 20, 2, 256}}) {
    const ops::MlaShape& m = c.shape;
    const int64_t length = c.past + c.T, W = m.row_width();
    const std::vector<float> rows = random_vector(rng, size_t(length * W));
    const std::vector<float> kv_b =
        random_vector(rng, size_t(m.H * (m.nope + m.v) * m.latent), 0.4f);
    const std::vector<float> q = random_vector(rng, size_t(c.T * m.H * m.qk_dim()));
    std::vector<double> want(size_t(c.T * m.H * m.v));
    ops::mla_reference(m, to_double(q).data(), c.T, to_double(rows).data(), c.past,
                       to_double(kv_b).data(), want.data());
    // The cache as pages.
    std::vector<std::vector<float>> pages;
    std::vector<const float*> page_ptrs;
    for (int64_t first = 0; first < length; first += c.page_tokens) {
      pages.emplace_back(size_t(c.page_tokens * W), NAN);  // the unused tail stays poisoned
      const int64_t n = std::min(c.page_tokens, length - first);
      std::copy_n(rows.data() + first * W, n * W, pages.back().data());
      page_ptrs.push_back(pages.back().data());
    }
    ops::MlaWorkspace ws;
    std::vector<float> absorbed = poisoned(want.size()), expanded = poisoned(want.size());
    ops::mla_absorbed_forward(m, q.data(), c.T, {page_ptrs, c.page_tokens, length}, kv_b.data(),
                              absorbed.data(), ws);
    ops::mla_expanded_forward(m, q.data(), c.T, rows.data(), c.past, kv_b.data(), expanded.data(),
                              ws);
    EXPECT_LE(rel_error(absorbed, want), 1e-5) << "past " << c.past << " T " << c.T;
    EXPECT_LE(rel_error(expanded, want), 1e-5) << "past " << c.past << " T " << c.T;
  }
}

TEST(KimiLinearMla, BadArgumentsThrow) {
  ops::MlaShape s;
  s.H = 1;
  s.nope = 2;
  s.rope = 1;
  s.v = 2;
  s.latent = 2;
  std::vector<float> page(8 * 3, 0.5f), kv_b(4 * 2, 0.1f), q(3, 1.0f), o(2);
  const float* ptr = page.data();
  ops::MlaWorkspace ws;
  // More new tokens than the cache holds.
  EXPECT_THROW(ops::mla_absorbed_forward(s, q.data(), 2, {std::span(&ptr, 1), 8, 1}, kv_b.data(),
                                         o.data(), ws),
               Error);
  // Pages too few for the length.
  EXPECT_THROW(ops::mla_absorbed_forward(s, q.data(), 1, {std::span(&ptr, 1), 8, 9}, kv_b.data(),
                                         o.data(), ws),
               Error);
  s.latent = 0;
  EXPECT_THROW(ops::mla_expanded_forward(s, q.data(), 1, page.data(), 0, kv_b.data(), o.data(), ws),
               Error);
}

// --- paged latent cache ---

TEST(KimiLinearLatentCache, PagesLimitsAndRecycling) {
  Random rng(6);
  auto pool = std::make_shared<runtime::LatentPagePool>(3, 4, 4);
  runtime::LatentCache a(pool, 10);
  const std::vector<float> rows = random_vector(rng, 10 * 3);
  a.append(rows.data(), 3);
  a.append(rows.data() + 3 * 3, 6);  // crosses into pages 2 and 3
  EXPECT_EQ(a.length(), 9);
  EXPECT_EQ(a.pages().size(), 3u);
  EXPECT_EQ(pool->pages_in_use(), 3);
  std::vector<float> gathered = poisoned(9 * 3);
  a.gather(gathered.data());
  EXPECT_EQ(rel_error(gathered.data(), rows.data(), 27), 0.0);
  EXPECT_EQ(a.pages()[2][0], rows[8 * 3]);  // row 8 opens page 2
  EXPECT_EQ(a.bytes_used(), 9 * 3 * 4);
  EXPECT_EQ(a.bytes_reserved(), 3 * 4 * 3 * 4);

  // Past max_tokens: refused, nothing changes.
  EXPECT_THROW(a.append(rows.data(), 2), Error);
  EXPECT_EQ(a.length(), 9);
  // The pool runs out for a second sequence: refused, nothing changes.
  runtime::LatentCache b(pool, 100);
  b.append(rows.data(), 4);
  EXPECT_EQ(pool->pages_in_use(), 4);
  try {
    b.append(rows.data(), 1);
    FAIL() << "the pool is full";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("page pool has no room"), std::string::npos) << e.what();
  }
  EXPECT_EQ(b.length(), 4);
  a.append(rows.data() + 9 * 3, 1);  // fits in a's last page
  EXPECT_EQ(a.length(), 10);
  gathered = poisoned(10 * 3);
  a.gather(gathered.data());
  EXPECT_EQ(rel_error(gathered.data(), rows.data(), 30), 0.0);

  // Clearing returns the pages; they are reused rather than allocated again, and b reads back
  // its own rows from them, not a's stale ones.
  a.clear();
  EXPECT_EQ(pool->pages_in_use(), 1);
  const std::vector<float> more = random_vector(rng, 8 * 3);
  b.append(more.data(), 8);
  EXPECT_EQ(pool->pages_in_use(), 3);
  EXPECT_EQ(pool->pages_allocated(), 4);
  std::vector<float> b_rows(rows.begin(), rows.begin() + 4 * 3);
  b_rows.insert(b_rows.end(), more.begin(), more.end());
  gathered = poisoned(12 * 3);
  b.gather(gathered.data());
  EXPECT_EQ(rel_error(gathered.data(), b_rows.data(), 36), 0.0);
  {
    runtime::LatentCache moved = std::move(b);
    EXPECT_EQ(moved.length(), 12);
  }  // the moved-to cache releases the pages once
  EXPECT_EQ(pool->pages_in_use(), 0);
}

}  // namespace
}  // namespace kda
