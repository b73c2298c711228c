// KDA with the layer's in-op options (L2 norm, softplus or bounded gate, sigmoid beta), and the
// golden op fixtures through `verify::check_op_fixture` (the code behind `kda verify`).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <string>

#include "core/error.h"
#include "core/random.h"
#include "core/safetensors.h"
#include "delta_rule_test_util.h"
#include "ops/delta_rule/delta_rule.h"
#include "ops/kda/kda.h"
#include "scratch_dir.h"
#include "verify/op_fixture.h"

namespace kda {
namespace {

using ops::DeltaRuleShape;
using ops::Gate;
using testing::rel_error;

const std::string kOpsDir = std::string(KDA_SHARED_DIR) + "/fixtures/ops";

class OpFixture : public ::testing::TestWithParam<std::string> {};

TEST_P(OpFixture, EveryPathWithinTolerance) {
  const std::string path = kOpsDir + "/" + GetParam() + ".safetensors";
  const verify::FixtureReport report = verify::check_op_fixture(path);
  ASSERT_FALSE(report.rows.empty());
  for (const verify::CheckRow& row : report.rows) {
    EXPECT_TRUE(row.passed()) << row.path << " " << row.quantity << " error " << row.error << " > "
                              << row.tolerance;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, OpFixture,
                         ::testing::Values("kda_small", "kda_gva", "kda_k128", "kda_varlen", "gdn",
                                           "delta", "linear_attn", "linear_attn_norm",
                                           "softmax_gqa"));

struct LayerProblem {
  DeltaRuleShape shape;
  ops::KdaOptions options;
  std::vector<float> q, k, v, graw, braw, A_log, dt_bias, h0;
  ops::KdaInputs<float> inputs() const {
    return {shape,       options,      q.data(),       k.data(),  v.data(), graw.data(),
            braw.data(), A_log.data(), dt_bias.data(), h0.data(), {}};
  }
};

LayerProblem random_layer(uint64_t seed, DeltaRuleShape shape, ops::KdaOptions options) {
  Random rng(seed);
  LayerProblem p{shape, options};
  const int64_t tokens = shape.B * shape.T;
  auto normal = [&](std::vector<float>& x, int64_t n, float sd) {
    x.resize(n);
    rng.fill_normal(x, sd);
  };
  normal(p.q, tokens * shape.H * shape.K, 1.0f);
  normal(p.k, tokens * shape.H * shape.K, 1.0f);
  normal(p.v, tokens * shape.HV * shape.V, 1.0f);
  normal(p.graw, tokens * shape.HV * shape.K, 1.0f);
  normal(p.braw, tokens * shape.HV, 1.0f);
  p.A_log.resize(shape.HV);
  rng.fill_uniform(p.A_log, -1.0f, 1.0f);
  normal(p.dt_bias, shape.HV * shape.K, 0.5f);
  normal(p.h0, shape.B * shape.HV * shape.K * shape.V, 0.5f);
  return p;
}

// The problem's inputs in double, by name (for the float64 reference and finite differences).
std::map<std::string, std::vector<double>> inputs_in_double(const LayerProblem& p) {
  return {{"q", testing::to_double(p.q)},
          {"k", testing::to_double(p.k)},
          {"v", testing::to_double(p.v)},
          {"graw", testing::to_double(p.graw)},
          {"braw", testing::to_double(p.braw)},
          {"A_log", testing::to_double(p.A_log)},
          {"dt_bias", testing::to_double(p.dt_bias)},
          {"h0", testing::to_double(p.h0)}};
}

// ops::kda_reference on inputs in double (x, by name) with p's shape and options.
void run_kda_reference(const LayerProblem& p, const std::map<std::string, std::vector<double>>& x,
                       double* o, double* ht) {
  auto ptr = [&](const char* n) { return x.at(n).data(); };
  ops::kda_reference({p.shape,
                      p.options,
                      ptr("q"),
                      ptr("k"),
                      ptr("v"),
                      ptr("graw"),
                      ptr("braw"),
                      ptr("A_log"),
                      ptr("dt_bias"),
                      ptr("h0"),
                      {}},
                     o, ht);
}

double layer_loss(const LayerProblem& p, const std::map<std::string, std::vector<double>>& x,
                  const std::vector<double>& d_o, const std::vector<double>& d_ht) {
  std::vector<double> o(d_o.size()), ht(d_ht.size());
  run_kda_reference(p, x, o.data(), ht.data());
  double l = 0;
  for (size_t i = 0; i < o.size(); ++i) l += o[i] * d_o[i];
  for (size_t i = 0; i < ht.size(); ++i) l += ht[i] * d_ht[i];
  return l;
}

TEST(KdaLayer, GradientsOfEveryInputMatchFiniteDifferences) {
  uint64_t seed = 500;
  for (ops::KdaGate gate : {ops::KdaGate::softplus, ops::KdaGate::lower_bound}) {
    const DeltaRuleShape shape{2, 9, 1, 2, 6, 5, Gate::channel, 0};
    ops::KdaOptions options;
    options.gate = gate;
    options.lower_bound = -3.0;
    const LayerProblem p = random_layer(seed++, shape, options);
    Random rng(seed++);
    std::vector<float> d_o(shape.B * shape.T * shape.HV * shape.V), d_ht(p.h0.size());
    rng.fill_normal(d_o);
    rng.fill_normal(d_ht);
    std::map<std::string, std::vector<float>> grads;
    for (const char* n : {"q", "k", "v", "graw", "braw", "A_log", "dt_bias", "h0"}) {
      const LayerProblem* pp = &p;
      const std::vector<float>& src = n == std::string("q")         ? pp->q
                                      : n == std::string("k")       ? pp->k
                                      : n == std::string("v")       ? pp->v
                                      : n == std::string("graw")    ? pp->graw
                                      : n == std::string("braw")    ? pp->braw
                                      : n == std::string("A_log")   ? pp->A_log
                                      : n == std::string("dt_bias") ? pp->dt_bias
                                                                    : pp->h0;
      grads[n] = testing::poisoned(src.size());
    }
    // a chunk of 4 puts several chunks inside T = 9
    ops::kda_chunk_backward(
        p.inputs(), d_o.data(), d_ht.data(),
        {grads["q"].data(), grads["k"].data(), grads["v"].data(), grads["graw"].data(),
         grads["braw"].data(), grads["A_log"].data(), grads["dt_bias"].data(), grads["h0"].data()},
        4);
    std::map<std::string, std::vector<double>> x = inputs_in_double(p);
    const auto d_o64 = testing::to_double(d_o), d_ht64 = testing::to_double(d_ht);
    for (auto& [name, values] : x) {
      std::vector<double> fd(values.size());
      for (size_t i = 0; i < values.size(); ++i) {
        const double keep = values[i], eps = 1e-6;
        values[i] = keep + eps;
        const double up = layer_loss(p, x, d_o64, d_ht64);
        values[i] = keep - eps;
        const double down = layer_loss(p, x, d_o64, d_ht64);
        values[i] = keep;
        fd[i] = (up - down) / (2 * eps);
      }
      EXPECT_LE(rel_error(grads[name], fd), 1e-4)
          << name << (gate == ops::KdaGate::softplus ? " softplus" : " lower_bound");
    }
  }
}

// The layer's activations written out here in double, independently of kda_activations.h:
// q, k L2-normalised (or not), g from the gate, beta = sigmoid(braw); then the plain delta-rule
// recurrence. o [B, T, HV, V] and the final states.
void independent_reference(const LayerProblem& p, std::vector<double>& o, std::vector<double>& ht) {
  const DeltaRuleShape& s = p.shape;
  const int64_t tokens = s.B * s.T;
  auto l2 = [&](const std::vector<float>& x) {
    std::vector<double> y(x.begin(), x.end());
    if (!p.options.l2norm_qk) return y;
    for (int64_t r = 0; r < tokens * s.H; ++r) {
      double n2 = 0;
      for (int64_t i = 0; i < s.K; ++i) n2 += y[r * s.K + i] * y[r * s.K + i];
      for (int64_t i = 0; i < s.K; ++i) y[r * s.K + i] /= std::max(std::sqrt(n2), 1e-6);
    }
    return y;
  };
  const std::vector<double> q = l2(p.q), k = l2(p.k), v(p.v.begin(), p.v.end()),
                            h0(p.h0.begin(), p.h0.end());
  std::vector<double> g(tokens * s.HV * s.K), beta(tokens * s.HV);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t hv = 0; hv < s.HV; ++hv) {
      beta[t * s.HV + hv] = 1.0 / (1.0 + std::exp(-double(p.braw[t * s.HV + hv])));
      for (int64_t c = 0; c < s.K; ++c) {
        const int64_t i = (t * s.HV + hv) * s.K + c;
        const double x = double(p.graw[i]) + p.dt_bias[hv * s.K + c],
                     a = std::exp(double(p.A_log[hv]));
        g[i] = p.options.gate == ops::KdaGate::softplus
                   ? -a * std::log1p(std::exp(x))
                   : p.options.lower_bound / (1.0 + std::exp(-a * x));
      }
    }
  o.assign(tokens * s.HV * s.V, 0.0);
  ht.assign(h0.size(), 0.0);
  ops::delta_rule_reference({s, q.data(), k.data(), v.data(), g.data(), beta.data(), h0.data(), {}},
                            o.data(), ht.data());
}

TEST(KdaLayer, ChunkedRecurrentAndDecodeAgreeWithReference) {
  const DeltaRuleShape shape{2, 150, 2, 4, 32, 16, Gate::channel, 0};
  uint64_t seed = 600;
  for (const ops::KdaGate gate : {ops::KdaGate::softplus, ops::KdaGate::lower_bound})
    for (const bool l2norm : {true, false}) {
      ops::KdaOptions options;
      options.gate = gate;
      options.lower_bound = -2.5;
      options.l2norm_qk = l2norm;
      LayerProblem p = random_layer(seed++, shape, options);
      if (!l2norm) {  // unnormalised keys of norm ~sqrt(K) would make the delta rule diverge
        for (float& x : p.q) x /= std::sqrt(float(shape.K));
        for (float& x : p.k) x /= std::sqrt(float(shape.K));
      }
      const std::string what =
          std::string(gate == ops::KdaGate::softplus ? "softplus" : "bounded") +
          (l2norm ? ", l2norm" : ", raw q/k");
      std::vector<double> o_ref, ht_ref;
      independent_reference(p, o_ref, ht_ref);

      // the op's own float64 reference agrees with the one written out above
      const std::map<std::string, std::vector<double>> x = inputs_in_double(p);
      std::vector<double> o64(o_ref.size(), NAN), ht64(ht_ref.size(), NAN);
      run_kda_reference(p, x, o64.data(), ht64.data());
      EXPECT_LE(rel_error(o64, o_ref), 1e-12) << what;
      EXPECT_LE(rel_error(ht64, ht_ref), 1e-12) << what;

      auto o = testing::poisoned(o_ref.size()), ht = testing::poisoned(ht_ref.size());
      ops::kda_chunk_forward(p.inputs(), o.data(), ht.data());
      EXPECT_LE(rel_error(o, o_ref), 1e-5) << what << " chunked";
      EXPECT_LE(rel_error(ht, ht_ref), 1e-5) << what << " chunked";
      o = testing::poisoned(o_ref.size());
      ht = testing::poisoned(ht_ref.size());
      ops::kda_recurrent_forward(p.inputs(), o.data(), ht.data());
      EXPECT_LE(rel_error(o, o_ref), 1e-5) << what << " recurrent";
      EXPECT_LE(rel_error(ht, ht_ref), 1e-5) << what << " recurrent";

      // decode: one token of each sequence per step, the state updated in place
      const int64_t H = shape.H, HV = shape.HV, K = shape.K, V = shape.V, T = shape.T;
      std::vector<float> state = p.h0;
      o = testing::poisoned(o_ref.size());
      DeltaRuleShape one = shape;
      one.B = 1;
      one.T = 1;
      for (int64_t t = 0; t < T; ++t)
        for (int64_t b = 0; b < shape.B; ++b) {
          const int64_t tok = b * T + t;
          ops::kda_decode_step(one, options, p.q.data() + tok * H * K, p.k.data() + tok * H * K,
                               p.v.data() + tok * HV * V, p.graw.data() + tok * HV * K,
                               p.braw.data() + tok * HV, p.A_log.data(), p.dt_bias.data(),
                               state.data() + b * HV * K * V, o.data() + tok * HV * V);
        }
      EXPECT_LE(rel_error(o, o_ref), 1e-5) << what << " decode";
      EXPECT_LE(rel_error(state, ht_ref), 1e-5) << what << " decode";
    }
}

TEST(KdaLayer, RejectsBadArguments) {
  const DeltaRuleShape shape{1, 8, 2, 2, 8, 8, Gate::channel, 0};
  LayerProblem p = random_layer(700, shape, {});
  std::vector<float> o(8 * 2 * 8), ht(2 * 8 * 8);
  auto in = p.inputs();
  in.options.gate = ops::KdaGate::lower_bound;
  in.options.lower_bound = -7.0;  // outside [-5, 0)
  EXPECT_THROW(ops::kda_chunk_forward(in, o.data(), ht.data()), Error);
  p.A_log[1] = NAN;
  EXPECT_THROW(ops::kda_chunk_forward(p.inputs(), o.data(), ht.data()), Error);
  p.A_log[1] = 0.5f;
  in = p.inputs();
  in.shape.gate = Gate::scalar;
  EXPECT_THROW(ops::kda_chunk_forward(in, o.data(), ht.data()), Error);
}

// A fixture `kda verify` has never seen: other shapes, other name, made here by the float64
// reference; then the same file with one output value changed must fail.
TEST(KdaVerify, UnseenFixtureFileOfTheSameFormat) {
  const kda::testing::ScratchDir scratch;  // this test's own folder
  const DeltaRuleShape shape{1, 77, 1, 3, 24, 40, Gate::channel, 0.2};
  const std::vector<int64_t> cu = {0, 30, 31, 77};
  auto p = testing::random_delta_problem(800, shape, cu, true);
  p.shape.B = 1;
  const auto ref = testing::run_reference(p);
  auto tensor = [](const std::vector<float>& x, Shape s) {
    Tensor t(DType::f32, std::move(s));
    std::copy(x.begin(), x.end(), t.f32());
    return t;
  };
  const Tensor q = tensor(p.q, {1, 77, 1, 24}), k = tensor(p.k, {1, 77, 1, 24}),
               v = tensor(p.v, {1, 77, 3, 40}), g = tensor(p.g, {1, 77, 3, 24}),
               beta = tensor(p.beta, {1, 77, 3}), h0 = tensor(p.h0, {3, 3, 24, 40});
  Tensor o = tensor({ref.o.begin(), ref.o.end()}, {1, 77, 3, 40});
  const Tensor ht = tensor({ref.ht.begin(), ref.ht.end()}, {3, 3, 24, 40});
  Tensor cu_t(DType::i64, {4});
  std::copy(cu.begin(), cu.end(), cu_t.data<int64_t>());
  const std::map<std::string, std::string> meta = {{"op", "\"kda\""}, {"scale", "0.2"}};
  const std::filesystem::path path = scratch.file("kda_unseen_case.safetensors");
  auto write = [&] {
    write_safetensors(path.string(),
                      {{"q", &q},
                       {"k", &k},
                       {"v", &v},
                       {"g", &g},
                       {"beta", &beta},
                       {"h0", &h0},
                       {"o", &o},
                       {"ht", &ht},
                       {"cu_seqlens", &cu_t}},
                      meta);
  };
  write();
  const verify::FixtureReport good = verify::check_op_fixture(path.string());
  EXPECT_TRUE(good.passed());
  EXPECT_GE(good.rows.size(), 8u);
  o.f32()[1000] += 0.05f;  // one wrong output element
  write();
  EXPECT_FALSE(verify::check_op_fixture(path.string()).passed());
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace kda
