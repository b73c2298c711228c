// AdamW and its schedule against the formulas written out here in double: decoupled weight
// decay only where `decay` is set, bias-corrected moments, global-norm clipping (above and below
// the threshold), the norm returned before clipping, warmup + cosine, and the moments' round
// trip through state() / load_state().
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/random.h"
#include "train/adamw.h"
#include "train/hf_gpt2.h"
#include "train/hf_kimi_linear.h"
#include "train/lineage_model.h"

namespace kda {
namespace {

using train::AdamW;
using train::AdamWConfig;
using train::Param;

// warmup: lr (s + 1) / W; then lr (r + (1 - r) (1 + cos(pi min(1, (s - W) / max(1, S - W)))) / 2)
double schedule(const AdamWConfig& c, int64_t s) {
  if (s < c.warmup_steps) return double(c.lr) * double(s + 1) / double(c.warmup_steps);
  const double span = double(std::max<int64_t>(1, c.total_steps - c.warmup_steps));
  const double progress = std::min(1.0, double(s - c.warmup_steps) / span);
  const double r = c.min_lr_ratio;
  return double(c.lr) * (r + (1 - r) * 0.5 * (1 + std::cos(M_PI * progress)));
}

TEST(AdamW, ScheduleIsWarmupThenCosine) {
  for (const int64_t warmup : {int64_t(0), int64_t(10)}) {
    const AdamWConfig c{
        .lr = 2e-3f, .warmup_steps = warmup, .total_steps = 110, .min_lr_ratio = 0.1f};
    for (const int64_t s : {int64_t(0), int64_t(4), int64_t(9), int64_t(10), int64_t(11),
                            int64_t(60), int64_t(109), int64_t(110), int64_t(500)})
      EXPECT_NEAR(train::scheduled_lr(c, s), schedule(c, s), 1e-9)
          << "warmup " << warmup << " step " << s;
  }
  const AdamWConfig c{.lr = 1e-3f, .warmup_steps = 10, .total_steps = 110, .min_lr_ratio = 0.1f};
  EXPECT_NEAR(train::scheduled_lr(c, 9), 1e-3, 1e-9);     // the last warmup step reaches lr
  EXPECT_NEAR(train::scheduled_lr(c, 60), 5.5e-4, 1e-9);  // halfway down the cosine
  EXPECT_NEAR(train::scheduled_lr(c, 110), 1e-4, 1e-9);   // then lr * min_lr_ratio
  EXPECT_NEAR(train::scheduled_lr(c, 999), 1e-4, 1e-9);
}

TEST(AdamW, StepsFollowTheFormulaInDouble) {
  Random rng(41);
  // a matrix with decay and a norm-like vector without, large enough gradients to clip some steps
  std::vector<Param> params(2);
  params[0] = {"w", Tensor(DType::f32, {6, 5}), Tensor(DType::f32, {6, 5}), true};
  params[1] = {"norm", Tensor(DType::f32, {7}), Tensor(DType::f32, {7}), false};
  for (Param& p : params) rng.fill_normal(p.value.span_f32(), 1.0f);
  const AdamWConfig c{.lr = 1e-2f,
                      .beta1 = 0.9f,
                      .beta2 = 0.95f,
                      .eps = 1e-8f,
                      .weight_decay = 0.1f,
                      .clip_norm = 4.0f,
                      .warmup_steps = 2,
                      .total_steps = 8,
                      .min_lr_ratio = 0.1f};
  AdamW opt({&params[0], &params[1]}, c);
  std::vector<std::vector<double>> w(2), m(2), v(2);
  for (size_t i = 0; i < 2; ++i) {
    w[i].assign(params[i].value.f32(), params[i].value.f32() + params[i].value.numel());
    m[i].assign(w[i].size(), 0.0);
    v[i].assign(w[i].size(), 0.0);
  }
  int clipped = 0, unclipped = 0;
  for (int64_t s = 0; s < 8; ++s) {
    // gradients of norm ~2 or ~8 in turn: below and above the clip norm of 4
    const float scale = s % 2 ? 1.5f : 0.35f;
    double norm2 = 0;
    for (Param& p : params) {
      rng.fill_normal(p.grad.span_f32(), scale);
      for (const float g : p.grad.span_f32()) norm2 += double(g) * g;
    }
    const double norm = std::sqrt(norm2), clip = norm > c.clip_norm ? c.clip_norm / norm : 1.0;
    (norm > c.clip_norm ? clipped : unclipped)++;
    const double lr = schedule(c, s);
    for (size_t i = 0; i < 2; ++i)
      for (size_t j = 0; j < w[i].size(); ++j) {
        const double g = double(params[i].grad.f32()[j]) * clip;
        m[i][j] = c.beta1 * m[i][j] + (1 - double(c.beta1)) * g;
        v[i][j] = c.beta2 * v[i][j] + (1 - double(c.beta2)) * g * g;
        const double mh = m[i][j] / (1 - std::pow(double(c.beta1), double(s + 1)));
        const double vh = v[i][j] / (1 - std::pow(double(c.beta2), double(s + 1)));
        if (params[i].decay) w[i][j] -= lr * c.weight_decay * w[i][j];
        w[i][j] -= lr * mh / (std::sqrt(vh) + c.eps);
      }
    EXPECT_NEAR(opt.step(), norm, 1e-9 * norm) << "the norm before clipping, step " << s;
    for (size_t i = 0; i < 2; ++i) {
      double num = 0, den = 0;
      for (size_t j = 0; j < w[i].size(); ++j) {
        const double d = params[i].value.f32()[j] - w[i][j];
        num += d * d;
        den += w[i][j] * w[i][j];
      }
      EXPECT_LE(std::sqrt(num / den), 1e-6) << params[i].name << " after step " << s + 1;
    }
  }
  EXPECT_GT(clipped, 0);
  EXPECT_GT(unclipped, 0);

  // the moments through state() / load_state(): a second optimizer takes the next step alike
  std::vector<Param> copy = {
      {"w", params[0].value.to(DType::f32), params[0].grad.to(DType::f32), true},
      {"norm", params[1].value.to(DType::f32), params[1].grad.to(DType::f32), false}};
  AdamW resumed({&copy[0], &copy[1]}, c);
  resumed.load_state(opt.state(), opt.steps_taken());
  opt.step();
  resumed.step();
  for (size_t i = 0; i < 2; ++i)
    for (int64_t j = 0; j < params[i].value.numel(); ++j)
      ASSERT_EQ(copy[i].value.f32()[j], params[i].value.f32()[j]) << params[i].name << " " << j;
}

// Zero gradients: a parameter without decay stays bit for bit, one with decay shrinks by exactly
// lr * weight_decay (the Adam part is 0 / (0 + eps) = 0).
TEST(AdamW, DecayOnlyWhereMarked) {
  std::vector<Param> params = {{"w", Tensor::filled({4}, 2.0f), Tensor::filled({4}, 0.0f), true},
                               {"b", Tensor::filled({4}, 2.0f), Tensor::filled({4}, 0.0f), false}};
  const AdamWConfig c{.lr = 0.5f, .weight_decay = 0.1f, .warmup_steps = 0, .total_steps = 10};
  AdamW opt({&params[0], &params[1]}, c);
  opt.step();
  for (int64_t j = 0; j < 4; ++j) {
    EXPECT_EQ(params[0].value.f32()[j], 2.0f * (1.0f - 0.5f * 0.1f));
    EXPECT_EQ(params[1].value.f32()[j], 2.0f);
  }
}

// Which parameters decay, by name, in every model the trainer builds: the matrices (embeddings
// and heads too, as llm.c and nanoGPT); never norms, biases, the short convolutions, the gates'
// A_log / dt_bias or the router's selection bias.
TEST(AdamW, NoDecayOnNormsBiasesConvolutionsAndGates) {
  const std::string shared = std::string(KDA_SHARED_DIR) + "/fixtures/models/";
  train::LineageModel lineage({32, 16, 2, 8, 24, "KAGDLM"}, 3);
  const auto kimi = train::KimiLinearTrainable::from_folder(shared + "kimi_linear_tiny");
  const auto gpt2 = train::Gpt2Trainable::from_folder(shared + "gpt2_tiny");
  for (const std::vector<Param*>& params : {lineage.params(), kimi->params(), gpt2->params()}) {
    int decayed = 0, kept = 0;
    for (const Param* p : params) {
      const std::string& n = p->name;
      const bool exempt =
          n.find("norm") != std::string::npos || n.find("ln_") != std::string::npos ||
          n.find("bias") != std::string::npos || n.find("conv") != std::string::npos ||
          n.find("A_log") != std::string::npos;
      EXPECT_EQ(p->decay, !exempt) << n;
      EXPECT_EQ(p->decay, p->value.shape().size() == 2) << n << ": decay is for matrices";
      (p->decay ? decayed : kept)++;
    }
    EXPECT_GT(decayed, 0);
    EXPECT_GT(kept, 0);
  }
}

}  // namespace
}  // namespace kda
