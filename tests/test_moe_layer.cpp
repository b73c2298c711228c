// The training MoE feed-forward: forward equal to the inference ops (what kimi_moe_block runs),
// every gradient against float64 central differences of sum(y * dy) with the routing held away
// from ties, aux-loss-free balancing pulling an overloaded router back toward uniform load, and
// the guards (unwritten dx, bad shapes).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/random.h"
#include "delta_rule_test_util.h"
#include "ops/moe/moe.h"
#include "ops/nn/nn.h"
#include "train/moe_layer.h"

namespace kda {
namespace {

using testing::poisoned;
using testing::rel_error;
using train::MoeLayer;
using train::MoeParams;
using train::Param;

struct Sizes {
  int64_t E, K, groups, topk_groups;
  bool renormalize;
  double scaling;
  int64_t D, I, Is;  // Is = 0: no shared expert

  ops::MoeRouting routing() const { return {E, K, groups, topk_groups, renormalize, scaling}; }
};

// Owns the parameters (stable addresses) and the MoeParams that point at them.
struct MoeWeights {
  std::vector<std::unique_ptr<Param>> owned;
  MoeParams p;

  Param* add(const std::string& name, Shape shape, Random& rng, float sd) {
    auto param = std::make_unique<Param>();
    param->name = name;
    param->value = Tensor(DType::f32, shape);
    param->grad = Tensor(DType::f32, shape);
    rng.fill_normal(param->value.span_f32(), sd);
    owned.push_back(std::move(param));
    return owned.back().get();
  }
};

MoeWeights random_weights(const Sizes& s, Random& rng) {
  MoeWeights w;
  const float sd_in = 1.0f / std::sqrt(float(s.D));
  w.p.router = w.add("gate.weight", {s.E, s.D}, rng, 2.0f * sd_in);
  w.p.bias = w.add("gate.e_score_correction_bias", {s.E}, rng, 0.1f);
  for (int64_t e = 0; e < s.E; ++e) {
    const std::string n = "experts." + std::to_string(e) + ".";
    w.p.w1.push_back(w.add(n + "w1.weight", {s.I, s.D}, rng, sd_in));
    w.p.w2.push_back(w.add(n + "w2.weight", {s.D, s.I}, rng, 1.0f / std::sqrt(float(s.I))));
    w.p.w3.push_back(w.add(n + "w3.weight", {s.I, s.D}, rng, sd_in));
  }
  if (s.Is > 0) {
    w.p.shared_gate = w.add("shared_experts.gate_proj.weight", {s.Is, s.D}, rng, sd_in);
    w.p.shared_up = w.add("shared_experts.up_proj.weight", {s.Is, s.D}, rng, sd_in);
    w.p.shared_down =
        w.add("shared_experts.down_proj.weight", {s.D, s.Is}, rng, 1.0f / std::sqrt(float(s.Is)));
  }
  return w;
}

std::vector<float> random_vector(Random& rng, size_t n, float sd = 1.0f) {
  std::vector<float> x(n);
  rng.fill_normal(x, sd);
  return x;
}

std::vector<float> stack(const Tensor& top, const Tensor& bottom) {
  std::vector<float> out(top.f32(), top.f32() + top.numel());
  out.insert(out.end(), bottom.f32(), bottom.f32() + bottom.numel());
  return out;
}

// What model/kimi_moe_block.cpp runs at inference.
std::vector<float> inference_forward(const Sizes& s, const MoeParams& p, const float* x,
                                     int64_t T) {
  std::vector<float> logits(size_t(T * s.E)), weights(size_t(T * s.K)), y(size_t(T * s.D));
  std::vector<int32_t> ids(size_t(T * s.K));
  ops::MoeWorkspace ws;
  ops::linear(x, T, s.D, p.router->value.f32(), s.E, nullptr, logits.data());
  ops::moe_route_sigmoid(s.routing(), logits.data(), T, p.bias->value.f32(), ids.data(),
                         weights.data());
  if (s.Is > 0) {
    const std::vector<float> gate_up = stack(p.shared_gate->value, p.shared_up->value);
    ops::swiglu_mlp(x, T, s.D, s.Is, {gate_up.data(), p.shared_down->value.f32()}, y.data(), ws);
  } else {
    std::fill(y.begin(), y.end(), 0.0f);
  }
  std::vector<std::vector<float>> gate_ups;
  std::vector<ops::SwigluWeights> experts;
  for (int64_t e = 0; e < s.E; ++e) gate_ups.push_back(stack(p.w1[e]->value, p.w3[e]->value));
  for (int64_t e = 0; e < s.E; ++e) experts.push_back({gate_ups[e].data(), p.w2[e]->value.f32()});
  ops::moe_experts_accumulate(x, T, s.D, s.I, experts, ids.data(), weights.data(), s.K, y.data(),
                              ws);
  return y;
}

// --- float64 reference, for the finite differences ---

struct RefWeights {
  std::vector<double> router, bias, shared_gate, shared_up, shared_down;
  std::vector<std::vector<double>> w1, w2, w3;
};

std::vector<double> to_double(const Param* p) {
  return p ? std::vector<double>(p->value.f32(), p->value.f32() + p->value.numel())
           : std::vector<double>{};
}

RefWeights ref_weights(const MoeParams& p) {
  RefWeights r;
  r.router = to_double(p.router);
  r.bias = to_double(p.bias);
  r.shared_gate = to_double(p.shared_gate);
  r.shared_up = to_double(p.shared_up);
  r.shared_down = to_double(p.shared_down);
  for (size_t e = 0; e < p.w1.size(); ++e) {
    r.w1.push_back(to_double(p.w1[e]));
    r.w2.push_back(to_double(p.w2[e]));
    r.w3.push_back(to_double(p.w3[e]));
  }
  return r;
}

// out[n] += h(W_in x) for a SwiGLU MLP: W1, W3 [H, D], W2 [D, H].
void ref_swiglu(const double* x, const std::vector<double>& w1, const std::vector<double>& w3,
                const std::vector<double>& w2, int64_t D, int64_t H, double scale, double* out) {
  std::vector<double> h(static_cast<size_t>(H));
  for (int64_t i = 0; i < H; ++i) {
    double a = 0, b = 0;
    for (int64_t d = 0; d < D; ++d) {
      a += w1[i * D + d] * x[d];
      b += w3[i * D + d] * x[d];
    }
    h[i] = a / (1.0 + std::exp(-a)) * b;
  }
  for (int64_t d = 0; d < D; ++d) {
    double o = 0;
    for (int64_t i = 0; i < H; ++i) o += w2[d * H + i] * h[i];
    out[d] += scale * o;
  }
}

struct RefResult {
  std::vector<double> y;
  std::vector<std::vector<int32_t>> chosen;  // per token, sorted expert ids
  double margin = INFINITY;  // smallest gap at a selection boundary (groups and experts)
};

// Largest-first order, ties to the lower index (as the op).
std::vector<int32_t> ranked(const std::vector<double>& v) {
  std::vector<int32_t> order(v.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return v[a] > v[b]; });
  return order;
}

RefResult ref_forward(const Sizes& s, const RefWeights& w, const std::vector<double>& x,
                      int64_t T) {
  RefResult r;
  r.y.assign(size_t(T * s.D), 0.0);
  const int64_t per_group = s.E / s.groups;
  for (int64_t t = 0; t < T; ++t) {
    const double* xt = x.data() + t * s.D;
    double* yt = r.y.data() + t * s.D;
    std::vector<double> score(size_t(s.E)), choice(size_t(s.E));
    for (int64_t e = 0; e < s.E; ++e) {
      double l = 0;
      for (int64_t d = 0; d < s.D; ++d) l += w.router[e * s.D + d] * xt[d];
      score[e] = 1.0 / (1.0 + std::exp(-l));
      choice[e] = score[e] + w.bias[e];
    }
    if (s.groups > 1) {
      std::vector<double> group_score(size_t(s.groups));
      for (int64_t g = 0; g < s.groups; ++g) {
        std::vector<double> c(choice.begin() + g * per_group, choice.begin() + (g + 1) * per_group);
        std::sort(c.rbegin(), c.rend());
        group_score[g] = c[0] + c[1];
      }
      const std::vector<int32_t> order = ranked(group_score);
      if (s.topk_groups < s.groups)
        r.margin = std::min(
            r.margin, group_score[order[s.topk_groups - 1]] - group_score[order[s.topk_groups]]);
      for (int64_t g = s.topk_groups; g < s.groups; ++g)
        for (int64_t i = 0; i < per_group; ++i) choice[order[g] * per_group + i] = -INFINITY;
    }
    const std::vector<int32_t> order = ranked(choice);
    if (s.K < s.topk_groups * per_group)
      r.margin = std::min(r.margin, choice[order[s.K - 1]] - choice[order[s.K]]);
    double sum = 0;
    for (int64_t j = 0; j < s.K; ++j) sum += score[order[j]];
    const double norm = s.renormalize ? s.scaling / (sum + 1e-20) : s.scaling;
    std::vector<int32_t> chosen(order.begin(), order.begin() + s.K);
    for (int32_t e : chosen)
      ref_swiglu(xt, w.w1[e], w.w3[e], w.w2[e], s.D, s.I, score[e] * norm, yt);
    if (s.Is > 0) ref_swiglu(xt, w.shared_gate, w.shared_up, w.shared_down, s.D, s.Is, 1.0, yt);
    std::sort(chosen.begin(), chosen.end());
    r.chosen.push_back(chosen);
  }
  return r;
}

const std::vector<Sizes>& forward_cases() {
  static const std::vector<Sizes> cases = {
      {8, 2, 1, 1, true, 2.446, 32, 24, 24},  // Kimi Linear's shape: one shared expert
      {8, 3, 4, 2, false, 1.5, 32, 24, 48},   // groups, no renormalisation, two shared
      {8, 2, 2, 1, true, 1.0, 32, 24, 0},     // groups, no shared expert
      {6, 6, 1, 1, true, 2.0, 16, 8, 8},      // every expert chosen
  };
  return cases;
}

TEST(MoeLayer, ForwardEqualsTheInferencePath) {
  Random rng(101);
  double worst = 0, worst64 = 0;
  for (const Sizes& s : forward_cases()) {
    MoeWeights w = random_weights(s, rng);
    MoeLayer layer(s.routing(), s.D, s.I, s.Is, w.p);
    for (int64_t T : {37, 1, 64}) {  // buffers grow and shrink between calls
      const std::vector<float> x = random_vector(rng, size_t(T * s.D));
      std::vector<float> y = poisoned(size_t(T * s.D));
      layer.forward(x.data(), T, y.data());
      const std::vector<float> ref = inference_forward(s, w.p, x.data(), T);
      EXPECT_LE(rel_error(y, ref), 1e-6) << "E " << s.E << " groups " << s.groups << " T " << T;
      const RefResult r64 = ref_forward(s, ref_weights(w.p), testing::to_double(x), T);
      EXPECT_LE(rel_error(y, r64.y), 1e-5) << "float64, groups " << s.groups << " T " << T;
      worst = std::max(worst, rel_error(y, ref));
      worst64 = std::max(worst64, rel_error(y, r64.y));
    }
  }
  std::printf("forward vs inference ops %.2e, vs float64 %.2e\n", worst, worst64);
}

// d sum(y * dy) / d theta for every input and weight against float64 central differences of
// the float64 forward, with every routing decision at least 1e-3 away from a tie (re-drawn
// otherwise) and checked unchanged at every perturbed point.
TEST(MoeLayer, EveryGradientMatchesFloat64FiniteDifferences) {
  const std::vector<Sizes> cases = {
      {6, 2, 1, 1, true, 2.446, 16, 8, 8},
      {6, 2, 3, 2, false, 1.5, 16, 8, 0},
      {6, 2, 2, 1, true, 1.0, 16, 8, 16},
  };
  const int64_t T = 7;
  uint64_t seed = 200;
  for (const Sizes& s : cases) {
    // Draw until no routing decision is within 1e-3 of a tie.
    MoeWeights w;
    std::vector<float> x;
    RefResult base;
    for (int attempt = 0;; ++attempt) {
      ASSERT_LT(attempt, 50) << "no tie-free draw";
      Random rng(seed++);
      w = random_weights(s, rng);
      x = random_vector(rng, size_t(T * s.D));
      base = ref_forward(s, ref_weights(w.p), testing::to_double(x), T);
      if (base.margin >= 1e-3) break;
    }
    Random rng(seed++);
    const std::vector<float> dy = random_vector(rng, size_t(T * s.D));

    MoeLayer layer(s.routing(), s.D, s.I, s.Is, w.p);
    std::vector<float> y(size_t(T * s.D)), dx = poisoned(size_t(T * s.D));
    layer.forward(x.data(), T, y.data());
    layer.backward(dy.data(), dx.data());
    EXPECT_LE(rel_error(y, base.y), 1e-5);

    RefWeights rw = ref_weights(w.p);
    std::vector<double> x64 = testing::to_double(x);
    // central difference of L = sum(y * dy) along one float64 coordinate
    auto fd = [&](double& v) {
      const double keep = v, h = 1e-5;
      auto loss = [&](double at) {
        v = at;
        const RefResult r = ref_forward(s, rw, x64, T);
        EXPECT_EQ(r.chosen, base.chosen) << "routing moved under the finite-difference step";
        double l = 0;
        for (size_t i = 0; i < r.y.size(); ++i) l += r.y[i] * dy[i];
        return l;
      };
      const double g = (loss(keep + h) - loss(keep - h)) / (2 * h);
      v = keep;
      return g;
    };
    auto check = [&](const std::string& name, std::vector<double>& values, const float* grad) {
      std::vector<double> numeric(values.size());
      for (size_t i = 0; i < values.size(); ++i) numeric[i] = fd(values[i]);
      const double err = rel_error(grad, numeric.data(), numeric.size());
      EXPECT_LE(err, 1e-4) << name << " (groups " << s.groups << ")";
      return err;
    };
    double worst = 0;
    worst = std::max(worst, check("dx", x64, dx.data()));
    worst = std::max(worst, check("router", rw.router, w.p.router->grad.f32()));
    int64_t experts_used = 0;
    for (int64_t e = 0; e < s.E; ++e) {
      const std::string n = "expert " + std::to_string(e);
      worst = std::max(worst, check(n + " w1", rw.w1[e], w.p.w1[e]->grad.f32()));
      worst = std::max(worst, check(n + " w2", rw.w2[e], w.p.w2[e]->grad.f32()));
      worst = std::max(worst, check(n + " w3", rw.w3[e], w.p.w3[e]->grad.f32()));
      bool used = false;
      for (const auto& c : base.chosen) used |= std::count(c.begin(), c.end(), e) > 0;
      experts_used += used;
    }
    EXPECT_GE(experts_used, 3);  // the check covers several experts' gradients
    if (s.Is > 0) {
      worst = std::max(worst, check("shared gate", rw.shared_gate, w.p.shared_gate->grad.f32()));
      worst = std::max(worst, check("shared up", rw.shared_up, w.p.shared_up->grad.f32()));
      worst = std::max(worst, check("shared down", rw.shared_down, w.p.shared_down->grad.f32()));
    }
    // The correction bias steers selection only: no gradient, numerically or in the layer.
    for (double& b : rw.bias) EXPECT_EQ(fd(b), 0.0);
    for (float g : w.p.bias->grad.span_f32()) EXPECT_EQ(g, 0.0f);
    std::printf("[ groups %lld renorm %d shared %lld ] worst gradient error %.2e\n",
                (long long)s.groups, int(s.renormalize), (long long)s.Is, worst);
  }
}

// A router that sends every token to expert 0: sign-based bias updates pull the load toward
// uniform, lowering expert 0's bias, while the bias never receives a gradient.
TEST(MoeLayer, BiasUpdatesBalanceTheLoad) {
  const Sizes s{8, 2, 1, 1, true, 2.446, 16, 8, 8};
  Random rng(300);
  MoeWeights w = random_weights(s, rng);
  std::fill(w.p.bias->value.span_f32().begin(), w.p.bias->value.span_f32().end(), 0.0f);
  for (int64_t d = 0; d < s.D; ++d) w.p.router->value.f32()[d] += 1.0f;  // row 0 likes x ~ +1
  MoeLayer layer(s.routing(), s.D, s.I, s.Is, w.p);
  EXPECT_FALSE(w.p.bias->decay);
  const int64_t T = 128, steps = 200, tail = 20;
  auto ratio = [](const std::vector<int64_t>& load) {
    const auto [lo, hi] = std::minmax_element(load.begin(), load.end());
    return double(*hi) / double(std::max<int64_t>(*lo, 1));
  };
  double first_ratio = 0;
  std::vector<int64_t> tail_load(size_t(s.E), 0);
  std::vector<float> y(size_t(T * s.D)), dx(size_t(T * s.D));
  for (int64_t step = 0; step < steps; ++step) {
    std::vector<float> x = random_vector(rng, size_t(T * s.D));
    for (float& v : x) v += 1.0f;
    layer.forward(x.data(), T, y.data());
    const std::vector<float> dy = random_vector(rng, size_t(T * s.D));
    layer.backward(dy.data(), dx.data());
    const std::vector<int64_t> load(layer.expert_load().begin(), layer.expert_load().end());
    ASSERT_EQ(std::accumulate(load.begin(), load.end(), int64_t(0)), T * s.K);
    if (step == 0) {
      first_ratio = ratio(load);
      EXPECT_EQ(load[0], T);  // every token picked expert 0
    }
    if (step >= steps - tail)
      for (int64_t e = 0; e < s.E; ++e) tail_load[e] += load[e];
    // the update: each bias moves by exactly the rate toward the mean load (none at the mean)
    const std::vector<float> before(w.p.bias->value.f32(), w.p.bias->value.f32() + s.E);
    layer.update_bias(0.01f);
    const double mean = double(T * s.K) / double(s.E);
    for (int64_t e = 0; e < s.E; ++e) {
      const float sign = load[e] < mean ? 1.0f : load[e] > mean ? -1.0f : 0.0f;
      ASSERT_EQ(w.p.bias->value.f32()[e], before[e] + 0.01f * sign) << "expert " << e;
    }
    EXPECT_TRUE(std::all_of(layer.expert_load().begin(), layer.expert_load().end(),
                            [](int64_t l) { return l == 0; }));
  }
  const double last_ratio = ratio(tail_load);
  std::printf("max/min load: first step %.1f, last %lld steps %.2f; bias[0] %.3f\n", first_ratio,
              (long long)tail, last_ratio, w.p.bias->value.f32()[0]);
  EXPECT_LT(last_ratio, 2.0);
  EXPECT_LT(last_ratio, 0.25 * first_ratio);
  EXPECT_LT(w.p.bias->value.f32()[0], -0.1f);
  for (float g : w.p.bias->grad.span_f32()) EXPECT_EQ(g, 0.0f);
}

TEST(MoeLayer, BackwardWritesEveryDxAndAccumulatesGradients) {
  for (const Sizes& s : forward_cases()) {
    Random rng(400);
    MoeWeights w = random_weights(s, rng);
    MoeLayer layer(s.routing(), s.D, s.I, s.Is, w.p);
    const int64_t T = 19;
    const std::vector<float> x = random_vector(rng, size_t(T * s.D));
    const std::vector<float> dy = random_vector(rng, size_t(T * s.D));
    std::vector<float> y = poisoned(size_t(T * s.D)), dx = poisoned(size_t(T * s.D));
    layer.forward(x.data(), T, y.data());
    layer.backward(dy.data(), dx.data());
    EXPECT_TRUE(std::all_of(y.begin(), y.end(), [](float v) { return std::isfinite(v); }));
    EXPECT_TRUE(std::all_of(dx.begin(), dx.end(), [](float v) { return std::isfinite(v); }));
    // A second backward adds the same gradients again and rewrites the same dx.
    const std::vector<float> once(w.p.router->grad.f32(),
                                  w.p.router->grad.f32() + w.p.router->grad.numel());
    std::vector<float> dx2 = poisoned(dx.size());
    layer.backward(dy.data(), dx2.data());
    EXPECT_EQ(dx2, dx);
    for (size_t i = 0; i < once.size(); ++i)
      EXPECT_FLOAT_EQ(w.p.router->grad.f32()[i], 2 * once[i]);
    // rows = 0 is a no-op
    layer.forward(nullptr, 0, nullptr);
    layer.backward(nullptr, nullptr);
  }
}

TEST(MoeLayer, BadArgumentsThrow) {
  const Sizes s{6, 2, 1, 1, true, 1.0, 16, 8, 8};
  Random rng(500);
  auto build = [&](auto&& edit, int64_t Is = 8) {
    MoeWeights w = random_weights(s, rng);
    edit(w);
    MoeLayer layer(s.routing(), s.D, s.I, Is, w.p);
  };
  EXPECT_NO_THROW(build([](MoeWeights&) {}));
  EXPECT_THROW(build([&](MoeWeights& w) { w.p.router->value.reshape({s.D, s.E}); }), Error);
  EXPECT_THROW(build([&](MoeWeights& w) { w.p.router->grad = Tensor(); }), Error);
  EXPECT_THROW(build([](MoeWeights& w) { w.p.bias = nullptr; }), Error);
  EXPECT_THROW(build([](MoeWeights& w) { w.p.w2.pop_back(); }), Error);
  EXPECT_THROW(build([&](MoeWeights& w) { w.p.w2[3]->value.reshape({s.I, s.D}); }), Error);
  EXPECT_THROW(build([](MoeWeights& w) { w.p.shared_down = nullptr; }), Error);
  EXPECT_THROW(build([](MoeWeights&) {}, 16), Error);  // shared shapes disagree with Is
  EXPECT_THROW(build([](MoeWeights&) {}, 0), Error);   // shared weights given, Is = 0
  {
    MoeWeights w = random_weights(s, rng);
    ops::MoeRouting bad = s.routing();
    bad.top_k = 7;
    EXPECT_THROW(MoeLayer(bad, s.D, s.I, s.Is, w.p), Error);
    EXPECT_THROW(MoeLayer(s.routing(), 0, s.I, s.Is, w.p), Error);
  }
  MoeWeights w = random_weights(s, rng);
  MoeLayer layer(s.routing(), s.D, s.I, s.Is, w.p);
  std::vector<float> x = random_vector(rng, size_t(3 * s.D)), y(x.size());
  EXPECT_THROW(layer.backward(x.data(), y.data()), Error);  // no forward yet
  EXPECT_THROW(layer.forward(x.data(), -1, y.data()), Error);
  EXPECT_THROW(layer.forward(nullptr, 3, y.data()), Error);
  x[5] = NAN;  // a non-finite router logit
  EXPECT_THROW(layer.forward(x.data(), 3, y.data()), Error);
  EXPECT_THROW(layer.update_bias(NAN), Error);
  EXPECT_THROW(layer.update_bias(-1.0f), Error);
}

}  // namespace
}  // namespace kda
