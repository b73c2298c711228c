// The training model of the lineage family: gradients of every parameter tensor against
// directional finite differences, a loss that falls on a learnable task, and the tasks' shape.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <set>

#include "core/error.h"
#include "core/random.h"
#include "gradient_fd_check.h"
#include "train/adamw.h"
#include "train/lineage_model.h"
#include "train/model_factory.h"
#include "train/tasks.h"

namespace kda {
namespace {

using train::LineageConfig;
using train::LineageModel;

// d loss / d theta by central differences, per parameter tensor: along grad / |grad| and along
// sparse random directions (gradient_fd_check.h).
TEST(LineageModel, EveryParameterGradientMatchesDirectionalFiniteDifferences) {
  struct Case {
    const char* pattern;
    const char* gate;
    bool hybrid_rope = false;
  };
  const std::vector<Case> cases = {
      {"AK", "softplus"}, {"LD", "softplus"}, {"GK", "softplus"}, {"KKKA", "softplus"},
      {"AA", "softplus"}, {"KM", "softplus"}, {"KA", "bounded"},  {"DA", "softplus", true}};
  for (const auto& [pattern, gate, hybrid_rope] : cases) {
    LineageConfig config{32, 16, 2, 8, 24, pattern};
    config.kda_gate = gate;
    config.hybrid_rope = hybrid_rope;
    LineageModel model(config, 11);
    Random rng(12);
    // larger weights than the training init: bigger gradients, far above fp32 loss noise
    for (train::Param* p : model.params())
      if (p->decay) {
        for (float& w : p->value.span_f32()) w *= 5.0f;
      } else if (p->name.find("dt_bias") != std::string::npos ||
                 p->name.find("A_log") != std::string::npos) {
        // The init (dt_bias ~-5, exp(A_log) up to 16) leaves the softplus gate's decay near 0
        // and saturates the bounded gate's sigmoid: gradients of ~1e-6 to 1e-5, below what fp32
        // finite differences resolve (an unwritten element would pass), or a sigmoid so steep
        // that the steps see its curvature. Near 0 (exp(A_log) ~1, softplus ~0.7, sigmoid
        // ~0.5) the gates are alive and smooth; varied so that no two channels are alike.
        for (float& w : p->value.span_f32()) w = 0.3f * rng.normal();
      }
    const int64_t B = 2, T = 9;
    std::vector<int32_t> in(B * T), tg(B * T);
    for (auto& x : in) x = int32_t(rng.integer(0, 31));
    for (auto& x : tg) x = rng.uniform(0, 1) < 0.7 ? int32_t(rng.integer(0, 31)) : -1;
    model.zero_grad();
    const double loss = model.forward_backward(in.data(), tg.data(), B, T, true).loss;
    for (train::Param* p : model.params()) {
      double gnorm2 = 0;
      for (float g : p->grad.span_f32()) gnorm2 += double(g) * g;
      const double gnorm = std::sqrt(gnorm2);
      ASSERT_TRUE(std::isfinite(gnorm)) << p->name;
      ASSERT_GT(gnorm, 1e-7) << pattern << " " << p->name;  // every tensor takes part
      // at most 0.05 along a unit direction: beyond it the short conv + SiLU + L2 norm path's
      // curvature shows through the extrapolation
      testing::GradientFdOptions opt;
      opt.max_step = 0.05;
      testing::check_gradient_fd(
          p, [&] { return model.forward_backward(in.data(), tg.data(), B, T, false).loss; }, loss,
          rng, opt, std::string(pattern) + " " + p->name);
    }
  }
}

// KDA's per-channel decay starts shared within each head (one Mamba dt draw per head, as Gated
// DeltaNet's), in fla's range: a mix of fast and slow channels inside one head kept the lineage
// KDA from learning MQAR (docs/RECALL.md).
TEST(LineageModel, KdaDecayStartsSharedWithinEachHead) {
  const int64_t H = 2, dh = 8;
  LineageModel model({32, 16, H, dh, 24, "KG"}, 7);
  int kda_seen = 0, gdn_seen = 0;
  for (train::Param* p : model.params()) {
    if (p->name.find("dt_bias") == std::string::npos) continue;
    const bool kda = p->name.rfind("layers.0.", 0) == 0;
    const int64_t per_head = kda ? dh : 1;
    ASSERT_EQ(p->value.numel(), H * per_head) << p->name;
    std::set<float> heads;
    for (int64_t h = 0; h < H; ++h) {
      const float b = p->value.f32()[h * per_head];
      const double dt = std::log1p(std::exp(double(b)));  // softplus
      EXPECT_GE(dt, 0.999e-3) << p->name;
      EXPECT_LE(dt, 1.001e-1) << p->name;
      for (int64_t c = 0; c < per_head; ++c) EXPECT_EQ(p->value.f32()[h * per_head + c], b);
      heads.insert(b);
    }
    EXPECT_EQ(heads.size(), size_t(H)) << p->name << ": heads draw their own dt";
    (kda ? kda_seen : gdn_seen)++;
  }
  EXPECT_EQ(kda_seen, 1);
  EXPECT_EQ(gdn_seen, 1);
}

// --gate-dt-per-channel: KDA's dt drawn per channel (fla's init), within the range, for both
// gates; Gated DeltaNet keeps one per head (the default's per-head draws:
// KdaDecayStartsSharedWithinEachHead).
TEST(LineageModel, KdaDecayPerChannelOption) {
  const int64_t H = 2, dh = 8;
  for (const std::string gate : {"softplus", "bounded"}) {
    LineageConfig shared{32, 16, H, dh, 24, "KG"};
    shared.kda_gate = gate;
    LineageConfig per_channel = shared;
    per_channel.gate_dt_per_channel = true;
    LineageModel b(per_channel, 7);
    for (size_t i = 0; i < b.params().size(); ++i) {
      const train::Param* p = b.params()[i];
      if (p->name.find("dt_bias") == std::string::npos) continue;
      const bool kda = p->name.rfind("layers.0.", 0) == 0;
      const train::Param* A_log = b.params()[i - 1];
      ASSERT_NE(A_log->name.find("A_log"), std::string::npos);
      if (!kda) {  // Gated DeltaNet: one draw per head either way
        ASSERT_EQ(p->value.numel(), H);
        continue;
      }
      std::set<float> channels;
      for (int64_t c = 0; c < H * dh; ++c) {
        const double z = double(p->value.f32()[c]);
        const double alpha = std::exp(double(A_log->value.f32()[c / dh]));
        // the starting decay rate -g: softplus a sp(b), bounded 5 sigmoid(b) (= a dt, A_log 0)
        const double rate =
            gate == "softplus" ? alpha * std::log1p(std::exp(z)) : 5.0 / (1.0 + std::exp(-z));
        if (gate == "bounded") {
          EXPECT_EQ(A_log->value.f32()[c / dh], 0.0f);
        } else {
          EXPECT_GE(rate / alpha, 0.999e-3);
          EXPECT_LE(rate / alpha, 1.001e-1);
        }
        EXPECT_GT(rate, 0.0);
        channels.insert(p->value.f32()[c]);
      }
      EXPECT_EQ(channels.size(), size_t(H * dh)) << gate << ": every channel draws its own dt";
    }
    const nlohmann::json j = train::lineage_config_json(per_channel);
    EXPECT_TRUE(train::lineage_config_from_json(j).gate_dt_per_channel);
  }
}

// The bounded gate (fla's safe gate) is what the KDA layers compute when the config asks for it;
// unknown gate names are refused.
TEST(LineageModel, KdaGateOptionChangesTheLayerAndIsValidated) {
  Random rng(31);
  const int64_t B = 2, T = 7;
  std::vector<int32_t> in(B * T), tg(B * T);
  for (auto& x : in) x = int32_t(rng.integer(0, 31));
  for (auto& x : tg) x = int32_t(rng.integer(0, 31));
  LineageConfig soft{32, 16, 2, 8, 24, "KK"};
  LineageConfig bounded = soft;
  bounded.kda_gate = "bounded";
  LineageModel a(soft, 5), b(bounded, 5);
  const double la = a.forward_backward(in.data(), tg.data(), B, T, false).loss;
  const double lb = b.forward_backward(in.data(), tg.data(), B, T, false).loss;
  EXPECT_TRUE(std::isfinite(la) && std::isfinite(lb));
  EXPECT_NE(la, lb);  // same weights (same seed), different gate
  // the bounded gate starts at the softplus gate's decay rates (same seed: same A_log and dt)
  double worst = 0;
  for (size_t i = 0; i < a.params().size(); ++i) {
    const train::Param* pa = a.params()[i];
    if (pa->name.find("dt_bias") == std::string::npos) continue;
    const train::Param* pb = b.params()[i];
    const train::Param* A_soft = a.params()[i - 1];
    const train::Param* A_bounded = b.params()[i - 1];
    ASSERT_NE(A_soft->name.find("A_log"), std::string::npos);
    for (int64_t c = 0; c < pa->value.numel(); ++c) {
      const double alpha = std::exp(double(A_soft->value.f32()[c / 8]));
      const double g_soft = -alpha * std::log1p(std::exp(double(pa->value.f32()[c])));
      EXPECT_EQ(A_bounded->value.f32()[c / 8], 0.0f);  // exp(A_log) = 1 inside the sigmoid
      const double g_bounded = -5.0 / (1.0 + std::exp(-double(pb->value.f32()[c])));
      worst = std::max(worst, std::abs(g_bounded - std::max(g_soft, -4.5)) / std::abs(g_soft));
    }
  }
  EXPECT_LT(worst, 1e-4);
  LineageConfig bad = soft;
  bad.kda_gate = "sigmoid";
  EXPECT_THROW(bad.validate(), Error);
}

// Checkpoint configs keep the gate settings, and older ones (without them) read as the defaults.
TEST(LineageModel, ConfigJsonKeepsTheGateSettings) {
  LineageConfig c{64, 32, 2, 16, 64, "KKKA"};
  c.kda_gate = "bounded";
  c.gate_dt_max = 0.01f;
  const LineageConfig back = train::lineage_config_from_json(train::lineage_config_json(c));
  EXPECT_EQ(back.kda_gate, "bounded");
  EXPECT_EQ(back.gate_dt_max, 0.01f);
  EXPECT_EQ(back.pattern, "KKKA");
  nlohmann::json older = train::lineage_config_json(LineageConfig{64, 32, 2, 16, 64, "KA"});
  older.erase("kda_gate");
  older.erase("gate_init_dt_max");
  const LineageConfig old_back = train::lineage_config_from_json(older);
  EXPECT_EQ(old_back.kda_gate, "softplus");
  EXPECT_EQ(old_back.gate_dt_max, 0.1f);
  EXPECT_FALSE(old_back.gate_dt_per_channel);
}

// --hybrid-rope: RoPE on a hybrid's softmax layer (default NoPE); models without a softmax layer
// and all-softmax models (always RoPE) are the same either way; checkpoints keep the choice.
TEST(LineageModel, HybridRopeOptionRotatesOnlyTheHybridsSoftmaxLayers) {
  Random rng(41);
  const int64_t B = 2, T = 11;
  std::vector<int32_t> in(B * T), tg(B * T);
  for (auto& x : in) x = int32_t(rng.integer(0, 31));
  for (auto& x : tg) x = int32_t(rng.integer(0, 31));
  auto loss = [&](const std::string& pattern, bool hybrid_rope) {
    LineageConfig c{32, 16, 2, 8, 24, pattern};
    c.hybrid_rope = hybrid_rope;
    EXPECT_EQ(c.softmax_rope(), hybrid_rope || pattern == "AA") << pattern;
    LineageModel m(c, 9);
    const double l = m.forward_backward(in.data(), tg.data(), B, T, false).loss;
    EXPECT_TRUE(std::isfinite(l)) << pattern;
    return l;
  };
  EXPECT_NE(loss("KA", true), loss("KA", false));
  EXPECT_NE(loss("AK", true), loss("AK", false));
  EXPECT_EQ(loss("AA", true), loss("AA", false));
  EXPECT_EQ(loss("KD", true), loss("KD", false));
  LineageConfig c{64, 32, 2, 16, 64, "KKKA"};
  c.hybrid_rope = true;
  nlohmann::json j = train::lineage_config_json(c);
  EXPECT_TRUE(train::lineage_config_from_json(j).hybrid_rope);
  j.erase("hybrid_softmax_rope");  // an older checkpoint: NoPE, as it was trained
  EXPECT_FALSE(train::lineage_config_from_json(j).hybrid_rope);
}

TEST(LineageModel, AdamWFitsAFixedBatch) {
  // Every architecture can memorise one small batch: the loss must fall well below chance.
  train::TaskSpec spec{train::Task::palindrome, 16, 16, 0};
  const train::Batch b = train::TaskStream(spec, 3, 0).next(8);
  LineageModel model({16, 32, 2, 16, 64, "KA"}, 5);
  train::AdamW opt(model.params(), {.lr = 1e-2f, .warmup_steps = 5, .total_steps = 60});
  double first = 0, last = 0;
  for (int step = 0; step < 60; ++step) {
    model.zero_grad();
    const auto r = model.forward_backward(b.inputs.data(), b.targets.data(), b.B, b.T, true);
    opt.step();
    if (step == 0) first = r.loss;
    last = r.loss;
  }
  EXPECT_LT(last, 0.3 * first);
}

TEST(Tasks, MqarFollowsZoology) {
  train::TaskSpec spec{train::Task::mqar, 64, 64, 8};
  train::TaskStream stream(spec, 1, 0);
  const train::Batch b = stream.next(20);
  for (int64_t i = 0; i < b.B; ++i) {
    const int32_t* x = &b.inputs[i * b.T];
    const int32_t* y = &b.targets[i * b.T];
    std::set<int32_t> keys, values;
    for (int64_t j = 0; j < 8; ++j) {
      EXPECT_GE(x[2 * j], 1);
      EXPECT_LT(x[2 * j], 32);
      EXPECT_GE(x[2 * j + 1], 32);
      EXPECT_LT(x[2 * j + 1], 64);
      keys.insert(x[2 * j]);
      values.insert(x[2 * j + 1]);
    }
    EXPECT_EQ(keys.size(), 8u);  // without replacement
    EXPECT_EQ(values.size(), 8u);
    int64_t scored = 0;
    for (int64_t t = 0; t < b.T; ++t) {
      if (y[t] < 0) continue;
      ++scored;
      // the query at t is a key whose value is the target
      int64_t j = 0;
      while (j < 8 && x[2 * j] != x[t]) ++j;
      ASSERT_LT(j, 8);
      EXPECT_EQ(y[t], x[2 * j + 1]);
      EXPECT_GE(t, 16);
    }
    EXPECT_EQ(scored, 8);  // every key queried exactly once
  }
}

// draw_discrete is std::discrete_distribution's draw (libstdc++) without its table: the same
// index and the same engine state after each draw, over power-law and random weights with
// entries zeroed as MQAR's sampling without replacement does, and the one- and two-weight edges.
TEST(Tasks, DrawDiscreteMatchesTheStandardDistribution) {
#ifndef __GLIBCXX__
  GTEST_SKIP() << "draw_discrete follows libstdc++'s discrete_distribution";
#endif
  std::mt19937_64 weights_rng(5);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  int64_t draws = 0;
  for (int trial = 0; trial < 40; ++trial) {
    const size_t n = trial == 0 ? 1 : trial == 1 ? 2 : 3 + size_t(trial) * 37;
    std::vector<double> w(n);
    for (size_t i = 0; i < n; ++i)
      w[i] = trial % 2 ? uniform(weights_rng) : 0.01 * std::pow(double(i + 1), -0.99);
    std::mt19937_64 ours(100 + trial), theirs(100 + trial);
    for (size_t k = 0; k + 1 < n || (n <= 2 && k < 3); ++k) {
      std::discrete_distribution<int64_t> pick(w.begin(), w.end());
      const int64_t expected = pick(theirs);
      const int64_t got = train::draw_discrete(w, ours);
      ASSERT_EQ(got, expected) << "trial " << trial << " draw " << k;
      ASSERT_EQ(ours(), theirs()) << "engine states diverged";
      ++draws;
      if (n > 2) w[size_t(got)] = 0;  // without replacement
    }
  }
  EXPECT_GT(draws, 10000);
}

// DrawWithoutReplacement (MQAR's gap sampler, a Fenwick tree) draws what draw_discrete draws
// over the same weights with each drawn index zeroed: the same index and engine state at every
// draw, until every index is drawn, over power-law weights (MQAR's, at lengths 64 to 2048) and
// random ones, and the one- and two-weight edges.
TEST(Tasks, DrawWithoutReplacementMatchesDrawDiscrete) {
  std::mt19937_64 weights_rng(11);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  int64_t draws = 0;
  for (int trial = 0; trial < 60; ++trial) {
    const size_t n = trial == 0   ? 1
                     : trial == 1 ? 2
                     : trial < 10 ? 24 + size_t(trial) * 83
                                  : 3 + size_t(trial) * 13;
    std::vector<double> w(n);
    for (size_t i = 0; i < n; ++i)
      w[i] = trial % 2 ? uniform(weights_rng) : 0.01 * std::pow(double(i + 1), -0.99);
    train::DrawWithoutReplacement sampler(w);
    std::mt19937_64 ours(300 + trial), theirs(300 + trial);
    for (size_t k = 0; k < (n == 1 ? 3 : n); ++k) {  // one weight: draws nothing, index 0
      const int64_t expected = train::draw_discrete(w, theirs);
      const int64_t got = sampler.draw(ours);
      ASSERT_EQ(got, expected) << "trial " << trial << " draw " << k << " of " << n;
      ASSERT_EQ(ours(), theirs()) << "engine states diverged";
      ++draws;
      if (n > 1) w[size_t(got)] = 0;
    }
  }
  EXPECT_GT(draws, 10000);
}

TEST(Tasks, StackAndPalindromeTargetsAreRecoverable) {
  for (train::Task task : {train::Task::palindrome, train::Task::stack}) {
    train::TaskSpec spec{task, 50, 40, 0};
    const train::Batch b = train::TaskStream(spec, 2, 0).next(10);
    int64_t scored = 0;
    for (int64_t i = 0; i < b.B * b.T; ++i) {
      if (b.targets[i] < 0) continue;
      ++scored;
      EXPECT_GE(b.targets[i], 2);
      if ((i + 1) % b.T) {
        EXPECT_EQ(b.inputs[i + 1], b.targets[i]);  // teacher forcing
      }
    }
    EXPECT_GT(scored, 10 * 5);
  }
}

// What the examples hold, replayed from the inputs alone: a palindrome's second half is its
// first reversed (every mirrored token scored, nothing else); a stack's pops (token 1) are each
// scored with the token on top of the stack that the pushes so far built, which the next input
// then reveals.
TEST(Tasks, PalindromeAndStackExamplesHoldWhatTheTasksSay) {
  for (const int64_t T : {40, 41, 256}) {
    const train::Batch pal = train::TaskStream({train::Task::palindrome, 50, T, 0}, 3, 0).next(8);
    for (int64_t b = 0; b < pal.B; ++b) {
      const int32_t* in = pal.inputs.data() + b * T;
      const int32_t* tg = pal.targets.data() + b * T;
      const int64_t n = T / 2;  // the separator's position
      ASSERT_EQ(in[n], 1) << "T " << T << " row " << b;
      for (int64_t t = 0; t < n; ++t) EXPECT_GE(in[t], 2) << t;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t i = t - n;  // target t predicts the token after position t
        const bool mirrored = i >= 0 && i < n;
        EXPECT_EQ(tg[t], mirrored ? in[n - 1 - i] : -1) << "T " << T << " row " << b << " t " << t;
      }
    }
    const train::Batch st = train::TaskStream({train::Task::stack, 50, T, 0}, 4, 0).next(8);
    int64_t pops = 0;
    for (int64_t b = 0; b < st.B; ++b) {
      const int32_t* in = st.inputs.data() + b * T;
      const int32_t* tg = st.targets.data() + b * T;
      std::vector<int32_t> stack;
      for (int64_t t = 0; t < T; ++t) {
        if (in[t] == 1) {  // a pop: scored with the top, which the next input reveals
          ASSERT_FALSE(stack.empty()) << "pop of an empty stack at " << t;
          EXPECT_EQ(tg[t], stack.back()) << "row " << b << " t " << t;
          if (t + 1 < T) {
            EXPECT_EQ(in[t + 1], stack.back());
            EXPECT_EQ(tg[t + 1], -1);
          }
          stack.pop_back();
          ++pops;
          ++t;
        } else {
          EXPECT_GE(in[t], 2);
          EXPECT_EQ(tg[t], -1) << "a push is not scored, row " << b << " t " << t;
          stack.push_back(in[t]);
        }
      }
    }
    EXPECT_GT(pops, 8 * T / 8);
  }
}

TEST(Tasks, TrainStreamNeverYieldsTestExamples) {
  train::TaskSpec spec{train::Task::palindrome, 4, 8, 0};  // 16 possible examples: collisions
  const train::TestSet test = train::make_test_set(spec, 9, 30);
  train::TaskStream train_stream(spec, 9, 0);
  train_stream.forbid(test.hashes);
  const train::Batch b = train_stream.next(200);
  for (int64_t i = 0; i < b.B; ++i) {
    EXPECT_EQ(test.hashes.count(train::TaskStream::hash_example(&b.inputs[i * b.T], b.T)), 0u);
  }
}

// A batch's examples are made on several threads; the stream must be the one-at-a-time one,
// forbidden examples skipped in the same places and the position left at the same seed.
TEST(Tasks, ThreadedBatchesEqualExamplesMadeOneAtATime) {
  for (const train::TaskSpec spec :
       {train::TaskSpec{train::Task::palindrome, 4, 8, 0},  // 16 possible examples: collisions
        train::TaskSpec{train::Task::mqar, 64, 64, 0},
        train::TaskSpec{train::Task::stack, 32, 40}}) {
    const train::TestSet test = train::make_test_set(spec, 5, 30);
    train::TaskStream batched(spec, 5, 0), single(spec, 5, 0);
    batched.forbid(test.hashes);
    single.forbid(test.hashes);
    const train::Batch b = batched.next(97);
    for (int64_t i = 0; i < b.B; ++i) {
      const train::Batch one = single.next(1);
      ASSERT_TRUE(std::equal(one.inputs.begin(), one.inputs.end(), &b.inputs[i * b.T]));
      ASSERT_TRUE(std::equal(one.targets.begin(), one.targets.end(), &b.targets[i * b.T]));
    }
    EXPECT_EQ(batched.position(), single.position());
    EXPECT_EQ(batched.next(3).inputs, single.next(3).inputs);
  }
}

}  // namespace
}  // namespace kda
