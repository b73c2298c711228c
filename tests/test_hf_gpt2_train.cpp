// GPT-2 as a training model: loss and every gradient against transformers' autograd (the
// gpt2_tiny fixture), every parameter tensor against float64 directional finite differences,
// packed documents against separate runs, a saved model against the inference engine, and the
// errors bad arguments must give.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/random.h"
#include "core/safetensors.h"
#include "model/causal_lm.h"
#include "train/hf_gpt2.h"
#include "train/layers.h"

namespace kda {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using train::Gpt2Trainable;
using train::Param;

const std::string kFixture = std::string(KDA_SHARED_DIR) + "/fixtures/models/gpt2_tiny";

// ||a - b|| / ||b||; infinity when anything is not finite or the sizes differ.
double relative_error(std::span<const float> a, std::span<const float> b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = double(a[i]) - double(b[i]);
    diff += d * d;
    norm += double(b[i]) * double(b[i]);
  }
  const double error = std::sqrt(diff / norm);
  return std::isfinite(error) ? error : std::numeric_limits<double>::infinity();
}

// A small config: vocab 37, width 16, 2 heads of 8, 2 layers, MLP 24.
json small_config(const std::string& activation = "gelu_new", bool inverse_layer_scale = false) {
  return {{"model_type", "gpt2"},
          {"vocab_size", 37},
          {"n_positions", 24},
          {"n_embd", 16},
          {"n_head", 2},
          {"n_layer", 2},
          {"n_inner", 24},
          {"activation_function", activation},
          {"scale_attn_by_inverse_layer_idx", inverse_layer_scale}};
}

// Larger weights than the training init (bigger gradients, far above fp32 loss noise), and
// biases and LayerNorm weights away from their 0 / 1 init so that every path carries signal.
void perturb(Gpt2Trainable& model, uint64_t seed) {
  Random rng(seed);
  for (Param* p : model.params()) {
    for (float& w : p->value.span_f32()) {
      if (p->value.rank() == 2)
        w *= 8.0f;
      else
        w += 0.2f * rng.normal();
    }
  }
}

std::vector<int32_t> random_ids(Random& rng, int64_t n, int64_t vocab) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int32_t& id : ids) id = int32_t(rng.integer(0, vocab - 1));
  return ids;
}

// Targets: random ids, about a quarter unscored (-1).
std::vector<int32_t> random_targets(Random& rng, int64_t n, int64_t vocab) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t& id : t) id = rng.uniform(0, 1) < 0.75f ? int32_t(rng.integer(0, vocab - 1)) : -1;
  return t;
}

std::map<std::string, std::vector<float>> grads_of(Gpt2Trainable& model) {
  std::map<std::string, std::vector<float>> out;
  for (Param* p : model.params())
    out[p->name].assign(p->grad.f32(), p->grad.f32() + p->grad.numel());
  return out;
}

TEST(HfGpt2Train, FixtureLossAndEveryGradientMatchTransformers) {
  if (!fs::exists(kFixture + "/grads/model.safetensors")) GTEST_SKIP() << "no " << kFixture;
  auto model = Gpt2Trainable::from_folder(kFixture);
  const SafetensorsFile ref = SafetensorsFile::open(kFixture + "/reference.safetensors");
  const TensorView ids_view = ref.view("input_ids");
  const int64_t T = ids_view.dim(1);
  std::vector<int32_t> ids(static_cast<size_t>(T)), targets(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) ids[t] = int32_t(ids_view.as<int64_t>()[t]);
  for (int64_t t = 0; t < T; ++t) targets[t] = t + 1 < T ? ids[t + 1] : -1;
  const double ref_loss = ref.load("loss").f32()[0];

  model->zero_grad();
  const train::StepResult r = model->forward_backward(ids.data(), targets.data(), 1, T, true);
  EXPECT_EQ(r.scored, T - 1);
  const double loss_error = std::abs(r.loss - ref_loss) / std::abs(ref_loss);
  EXPECT_LE(loss_error, 1e-5) << r.loss << " vs " << ref_loss;

  const SafetensorsFile grads = SafetensorsFile::open(kFixture + "/grads/model.safetensors");
  double worst = 0;
  std::string worst_name;
  size_t compared = 0;
  for (Param* p : model->params()) {
    ASSERT_TRUE(grads.contains(p->name)) << p->name;
    const Tensor g = grads.load(p->name, DType::f32);
    ASSERT_EQ(g.shape(), p->grad.shape()) << p->name;
    const double e = relative_error(p->grad.span_f32(), g.span_f32());
    EXPECT_LE(e, 1e-3) << p->name;
    if (!(e <= worst)) {
      worst = e;
      worst_name = p->name;
    }
    ++compared;
  }
  EXPECT_EQ(compared, grads.names().size());
  std::printf("gpt2_tiny: loss %.8f vs %.8f (rel %.2e); worst gradient %s rel %.2e\n", r.loss,
              ref_loss, loss_error, worst_name.c_str(), worst);

  // The backward adds into the gradients (accumulation over micro-batches): from random
  // starting values it must land on start + the same gradient in every element, so an element
  // it overwrites instead of adding to shows (from zero, as above, it cannot; an element it
  // never writes is the fixture comparison's and the finite differences' to find).
  const auto from_zero = grads_of(*model);
  Random rng(5);
  std::map<std::string, std::vector<float>> start;
  for (Param* p : model->params()) {
    const std::vector<float>& g = from_zero.at(p->name);
    double rms = 0;
    for (float x : g) rms += double(x) * x;
    rms = std::sqrt(rms / double(g.size()));
    for (float& x : p->grad.span_f32()) x = float(rms * rng.normal());
    start[p->name].assign(p->grad.f32(), p->grad.f32() + p->grad.numel());
  }
  model->forward_backward(ids.data(), targets.data(), 1, T, true);
  for (Param* p : model->params()) {
    const std::vector<float>& s = start.at(p->name);
    std::vector<float> added(s.size());
    for (size_t i = 0; i < s.size(); ++i) added[i] = p->grad.f32()[i] - s[i];
    EXPECT_LE(relative_error(added, from_zero.at(p->name)), 1e-5) << p->name << " accumulated";
  }
}

// d loss / d theta along two unit directions per tensor (the gradient's own and a random one),
// by Richardson-extrapolated central differences of the (double) loss; the error is measured
// against the tensor's gradient norm.
TEST(HfGpt2Train, EveryGradientMatchesDirectionalFiniteDifferences) {
  const json configs[] = {small_config("gelu_new"), small_config("gelu", true),
                          small_config("silu")};
  uint64_t seed = 100;
  double worst = 0;
  for (const json& config : configs) {
    auto model = Gpt2Trainable::from_config(config, ++seed);
    perturb(*model, ++seed);
    Random rng(++seed);
    const int64_t B = 2, T = 9, V = model->settings().vocab;
    const std::vector<int32_t> in = random_ids(rng, B * T, V), tg = random_targets(rng, B * T, V);
    model->zero_grad();
    const double loss = model->forward_backward(in.data(), tg.data(), B, T, true).loss;
    for (Param* p : model->params()) {
      const int64_t n = p->value.numel();
      double gnorm2 = 0;
      for (float g : p->grad.span_f32()) gnorm2 += double(g) * g;
      const double gnorm = std::sqrt(gnorm2);
      ASSERT_TRUE(std::isfinite(gnorm)) << p->name;
      ASSERT_GT(gnorm, 1e-6) << p->name;  // every tensor is used (wpe rows up to T, too)
      std::vector<double> random_dir(static_cast<size_t>(n));
      double rnorm2 = 0;
      for (double& u : random_dir) {
        u = rng.normal();
        rnorm2 += u * u;
      }
      for (double& u : random_dir) u /= std::sqrt(rnorm2);
      const std::vector<float> keep(p->value.f32(), p->value.f32() + n);
      for (int dir = 0; dir < 2; ++dir) {
        std::vector<double> u(static_cast<size_t>(n));
        double expected = 0;
        for (int64_t i = 0; i < n; ++i) {
          u[i] = dir == 0 ? p->grad.f32()[i] / gnorm : random_dir[i];
          expected += u[i] * p->grad.f32()[i];
        }
        auto loss_at = [&](double s) {
          for (int64_t i = 0; i < n; ++i) p->value.f32()[i] = float(keep[i] + s * u[i]);
          return model->forward_backward(in.data(), tg.data(), B, T, false).loss;
        };
        // fp32 losses carry ~1e-7 relative noise: step far enough to move the loss by ~2e-3
        const double eps = std::clamp(2e-3 * loss / gnorm, 1e-3, 0.3);
        auto central = [&](double e) { return (loss_at(e) - loss_at(-e)) / (2 * e); };
        const double fd = (4 * central(eps / 2) - central(eps)) / 3;
        std::copy(keep.begin(), keep.end(), p->value.f32());
        worst = std::max(worst, std::abs(fd - expected) / gnorm);
        EXPECT_NEAR(fd, expected, 1e-3 * gnorm)
            << config["activation_function"] << " " << p->name << " dir " << dir;
      }
    }
  }
  std::printf("worst |fd - g.u| / |g| over every tensor and direction: %.2e\n", worst);
}

// Documents packed in rows with cu_seqlens (one of length 1, a row holding several) give the
// loss and gradients of running each document alone, weighted by its scored targets.
TEST(HfGpt2Train, PackedDocumentsMatchSeparateRuns) {
  auto model = Gpt2Trainable::from_config(small_config(), 7);
  perturb(*model, 8);
  Random rng(9);
  const int64_t B = 2, T = 10, V = model->settings().vocab;
  const std::vector<int64_t> cu = {0, 3, 4, 10, 17, 20};
  const std::vector<int32_t> in = random_ids(rng, B * T, V), tg = random_targets(rng, B * T, V);
  model->zero_grad();
  const train::StepResult packed = model->forward_backward(in.data(), tg.data(), B, T, true, cu);
  const auto packed_grads = grads_of(*model);

  std::map<std::string, std::vector<double>> sum;
  double loss_sum = 0;
  int64_t scored = 0;
  for (size_t d = 0; d + 1 < cu.size(); ++d) {
    const int64_t len = cu[d + 1] - cu[d];
    model->zero_grad();
    const train::StepResult r =
        model->forward_backward(in.data() + cu[d], tg.data() + cu[d], 1, len, true);
    if (r.scored == 0) continue;
    loss_sum += r.loss * double(r.scored);
    scored += r.scored;
    for (Param* p : model->params()) {
      auto& s = sum[p->name];
      s.resize(size_t(p->grad.numel()));
      for (int64_t i = 0; i < p->grad.numel(); ++i) s[i] += double(p->grad.f32()[i]) * r.scored;
    }
  }
  ASSERT_EQ(scored, packed.scored);
  EXPECT_NEAR(packed.loss, loss_sum / double(scored), 1e-6 * packed.loss);
  for (const auto& [name, s] : sum) {
    std::vector<float> expected(s.size());
    for (size_t i = 0; i < s.size(); ++i) expected[i] = float(s[i] / double(scored));
    EXPECT_LE(relative_error(packed_grads.at(name), expected), 1e-5) << name;
  }

  // Two equal documents packed in one row equal the same documents as two rows.
  const std::vector<int64_t> halves = {0, T, 2 * T};
  model->zero_grad();
  const double one_row = model->forward_backward(in.data(), tg.data(), 1, 2 * T, true, halves).loss;
  const auto one_row_grads = grads_of(*model);
  model->zero_grad();
  const double two_rows = model->forward_backward(in.data(), tg.data(), 2, T, true).loss;
  const auto two_rows_grads = grads_of(*model);
  EXPECT_NEAR(one_row, two_rows, 1e-6 * two_rows);
  for (const auto& [name, g] : two_rows_grads)
    EXPECT_LE(relative_error(one_row_grads.at(name), g), 1e-5) << name;
}

// A randomly initialised model saved as a folder (its config() and its parameters) loads both
// in the inference engine, which gives the same loss, and back as a training model.
TEST(HfGpt2Train, SavedModelLoadsInInferenceAndTraining) {
  const fs::path dir =
      fs::temp_directory_path() / ("kda_hf_gpt2_train_" + std::to_string(::getpid()) + "_saved");
  fs::remove_all(dir);
  fs::create_directories(dir);
  auto model = Gpt2Trainable::from_config(small_config("gelu", true), 21);
  perturb(*model, 22);
  std::ofstream(dir / "config.json") << model->config().dump(2);
  std::vector<NamedTensor> named;
  for (Param* p : model->params()) named.push_back({p->name, &p->value});
  write_safetensors((dir / "model.safetensors").string(), named, {{"format", "pt"}});

  Random rng(23);
  const int64_t T = 13, V = model->settings().vocab;
  std::vector<int32_t> ids = random_ids(rng, T, V), targets(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) targets[t] = t + 1 < T ? ids[t + 1] : -1;
  const double loss = model->forward_backward(ids.data(), targets.data(), 1, T, false).loss;

  const auto lm = model::load_causal_lm(dir.string());
  const Tensor logits = lm->forward(ids);
  std::vector<float> dlogits(static_cast<size_t>(logits.numel()));
  const double inference_loss =
      train::cross_entropy(logits.f32(), targets.data(), T, V, dlogits.data(), nullptr, nullptr);
  EXPECT_NEAR(loss, inference_loss, 1e-5 * loss);

  auto reloaded = Gpt2Trainable::from_folder(dir.string());
  EXPECT_EQ(reloaded->config(), model->config());
  EXPECT_EQ(reloaded->forward_backward(ids.data(), targets.data(), 1, T, false).loss, loss);
  fs::remove_all(dir);
}

TEST(HfGpt2Train, InitFollowsTransformers) {
  auto model = Gpt2Trainable::from_config(small_config(), 3);
  int64_t matrices = 0;
  for (Param* p : model->params()) {
    const auto w = p->value.span_f32();
    const bool is_bias = p->name.ends_with(".bias");
    const bool is_ln = p->name.find(".ln_") != std::string::npos;
    EXPECT_EQ(p->decay, p->value.rank() == 2) << p->name;
    if (is_bias) {
      for (float x : w) ASSERT_EQ(x, 0.0f) << p->name;
    } else if (is_ln) {
      for (float x : w) ASSERT_EQ(x, 1.0f) << p->name;
    } else {
      ++matrices;
      double ss = 0;
      for (float x : w) ss += double(x) * x;
      const double sd = std::sqrt(ss / double(w.size()));
      const double want = p->name.ends_with("c_proj.weight") ? 0.02 / std::sqrt(4.0) : 0.02;
      EXPECT_NEAR(sd, want, 0.15 * want) << p->name;
    }
  }
  EXPECT_EQ(matrices, 2 + 2 * 4);
  EXPECT_EQ(model->params().front()->name, "transformer.wte.weight");
  const json saved = model->config();
  EXPECT_EQ(saved["model_type"], "gpt2");
  EXPECT_EQ(saved["layer_norm_epsilon"].get<double>(), 1e-5);
  EXPECT_EQ(saved["n_inner"], 24);
  EXPECT_TRUE(saved["tie_word_embeddings"].get<bool>());
}

TEST(HfGpt2Train, BadArgumentsThrow) {
  auto model = Gpt2Trainable::from_config(small_config(), 5);
  const int64_t P = model->settings().positions, V = model->settings().vocab;
  std::vector<int32_t> ids(size_t(P + 1), 1), tg(size_t(P + 1), 2);
  // one row longer than n_positions
  EXPECT_THROW(model->forward_backward(ids.data(), tg.data(), 1, P + 1, true), Error);
  // the same tokens as two documents each within n_positions are fine
  const std::vector<int64_t> cu = {0, P, P + 1};
  EXPECT_NO_THROW(model->forward_backward(ids.data(), tg.data(), 1, P + 1, true, cu));
  ids[3] = int32_t(V);
  EXPECT_THROW(model->forward_backward(ids.data(), tg.data(), 1, 8, false), Error);
  ids[3] = -1;
  EXPECT_THROW(model->forward_backward(ids.data(), tg.data(), 1, 8, false), Error);
  ids[3] = 0;
  const std::vector<int64_t> missing_row_start = {0, 3, 8};
  EXPECT_THROW(model->forward_backward(ids.data(), tg.data(), 2, 4, false, missing_row_start),
               Error);
  const std::vector<int64_t> wrong_end = {0, 4, 7};
  EXPECT_THROW(model->forward_backward(ids.data(), tg.data(), 2, 4, false, wrong_end), Error);
  EXPECT_THROW(model->forward_backward(ids.data(), tg.data(), 0, 4, false), Error);

  json untied = small_config();
  untied["tie_word_embeddings"] = false;
  EXPECT_THROW(Gpt2Trainable::from_config(untied, 1), Error);
  json odd = small_config();
  odd["n_head"] = 3;
  EXPECT_THROW(Gpt2Trainable::from_config(odd, 1), Error);
  json act = small_config("quick_gelu");
  EXPECT_THROW(Gpt2Trainable::from_config(act, 1), Error);
}

}  // namespace
}  // namespace kda
