// Kimi Linear training: loss and every gradient against transformers' autograd (the
// kimi_linear_tiny fixture, and data/kimi_linear_qlora that transformers made), gradients of a
// fresh model against finite differences, packed documents against separate rows, a saved model
// against the inference path, and the MoE's auxiliary-loss-free balancing.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <vector>

#include "core/error.h"
#include "core/random.h"
#include "core/safetensors.h"
#include "gradient_fd_check.h"
#include "model/causal_lm.h"
#include "train/hf_kimi_linear.h"

namespace kda {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using train::KimiLinearTrainable;

const std::string kTiny = std::string(KDA_SHARED_DIR) + "/fixtures/models/kimi_linear_tiny";

double rel_diff(const float* a, const float* b, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  if (!std::isfinite(num)) return INFINITY;
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Two layers (KDA then MLA), MoE in the second; sizes small enough for finite differences.
json small_config(int64_t experts, int64_t top_k) {
  return {{"model_type", "kimi_linear"},
          {"vocab_size", 40},
          {"hidden_size", 32},
          {"num_hidden_layers", 2},
          {"intermediate_size", 48},
          {"moe_intermediate_size", 16},
          {"num_experts", experts},
          {"num_experts_per_token", top_k},
          {"num_shared_experts", 1},
          {"first_k_dense_replace", 1},
          {"moe_layer_freq", 1},
          {"moe_renormalize", true},
          {"routed_scaling_factor", 2.0},
          {"num_expert_group", 1},
          {"topk_group", 1},
          {"num_attention_heads", 2},
          {"num_key_value_heads", 2},
          {"kv_lora_rank", 16},
          {"q_lora_rank", nullptr},
          {"qk_nope_head_dim", 8},
          {"qk_rope_head_dim", 4},
          {"v_head_dim", 8},
          {"mla_use_nope", true},
          {"rms_norm_eps", 1e-5},
          {"model_max_length", 256},
          {"tie_word_embeddings", false},
          {"linear_attn_config",
           {{"kda_layers", {1}},
            {"full_attn_layers", {2}},
            {"num_heads", 2},
            {"head_dim", 16},
            {"short_conv_kernel_size", 4}}}};
}

// Made by transformers from a config with q_lora_rank, a width-3 convolution, grouped routing,
// two shared experts and two MLA layers (data/kimi_linear_qlora/README.md).
const std::string kQLora = (fs::path(__FILE__).parent_path() / "data/kimi_linear_qlora").string();

std::vector<int32_t> fixture_ids(const std::string& folder) {
  const SafetensorsFile ref = SafetensorsFile::open(folder + "/reference.safetensors");
  const Tensor t = ref.load("input_ids", DType::f64);
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < t.numel(); ++i) ids.push_back(int32_t(t.data<double>()[i]));
  return ids;
}

// The folder's loss and every gradient against transformers' autograd; then the backward's
// accumulation into gradients that are not zero.
void expect_matches_transformers(const std::string& folder) {
  auto model = KimiLinearTrainable::from_folder(folder);
  const std::vector<int32_t> ids = fixture_ids(folder);
  const int64_t T = int64_t(ids.size());
  std::vector<int32_t> targets(ids.begin() + 1, ids.end());
  targets.push_back(-1);
  model->zero_grad();
  const train::StepResult r = model->forward_backward(ids.data(), targets.data(), 1, T, true);
  const SafetensorsFile ref = SafetensorsFile::open(folder + "/reference.safetensors");
  const double ref_loss = ref.load("loss", DType::f64).data<double>()[0];
  EXPECT_LE(std::abs(r.loss - ref_loss) / ref_loss, 1e-5) << r.loss << " vs " << ref_loss;

  const SafetensorsFile grads = SafetensorsFile::open(folder + "/grads/model.safetensors");
  double worst = 0;
  std::string worst_name;
  size_t compared = 0;
  for (train::Param* p : model->params()) {
    const Tensor g = grads.load(p->name, DType::f32);
    ASSERT_EQ(g.numel(), p->grad.numel()) << p->name;
    const double e = rel_diff(p->grad.f32(), g.f32(), g.numel());
    EXPECT_LE(e, 1e-3) << p->name;
    if (e > worst) worst = e, worst_name = p->name;
    ++compared;
  }
  EXPECT_EQ(compared, grads.names().size());
  std::printf("loss %.8f (ref %.8f); %zu gradients, worst %.2e (%s)\n", r.loss, ref_loss, compared,
              worst, worst_name.c_str());

  // The backward adds into the gradients (accumulation over micro-batches): from random
  // starting values it must land on start + the same gradient in every element, so an element
  // it overwrites instead of adding to shows (from zero, as above, it cannot; an element it
  // never writes is the fixture comparison's and the finite differences' to find);
  // a tensor without a gradient (the router's correction bias) keeps its start bit for bit.
  std::map<std::string, std::vector<float>> from_zero, start;
  Random rng(5);
  for (train::Param* p : model->params()) {
    const int64_t n = p->grad.numel();
    from_zero[p->name].assign(p->grad.f32(), p->grad.f32() + n);
    double rms = 0;
    for (int64_t i = 0; i < n; ++i) rms += double(p->grad.f32()[i]) * p->grad.f32()[i];
    rms = std::sqrt(rms / double(n));
    for (float& x : p->grad.span_f32()) x = float((rms > 0 ? rms : 1.0) * rng.normal());
    start[p->name].assign(p->grad.f32(), p->grad.f32() + n);
  }
  model->forward_backward(ids.data(), targets.data(), 1, T, true);
  for (train::Param* p : model->params()) {
    const std::vector<float>& s0 = start.at(p->name);
    const std::vector<float>& g0 = from_zero.at(p->name);
    std::vector<float> added(s0.size());
    for (size_t i = 0; i < s0.size(); ++i) added[i] = p->grad.f32()[i] - s0[i];
    if (std::all_of(g0.begin(), g0.end(), [](float x) { return x == 0.0f; })) {
      EXPECT_TRUE(std::equal(s0.begin(), s0.end(), p->grad.f32())) << p->name << " touched";
      continue;
    }
    EXPECT_LE(rel_diff(added.data(), g0.data(), int64_t(g0.size())), 1e-5)
        << p->name << " accumulated";
  }
}

TEST(HfKimiTrain, LossAndEveryGradientMatchTransformers) {
  expect_matches_transformers(kTiny);
}

TEST(HfKimiTrain, QLoraGroupedRoutingAndTwoSharedExpertsMatchTransformers) {
  expect_matches_transformers(kQLora);
}

// With every expert selected (top_k = E) the selection cannot flip, so the loss is smooth.
void expect_gradients_match_finite_differences(const json& config) {
  auto model = KimiLinearTrainable::from_config(config, 21);
  for (train::Param* p : model->params())
    if (p->decay)
      for (float& w : p->value.span_f32()) w *= 4.0f;  // bigger gradients than the init
  Random rng(22);
  const int64_t B = 2, T = 11;
  std::vector<int32_t> in(B * T), tg(B * T);
  for (auto& x : in) x = int32_t(rng.integer(0, 39));
  for (auto& x : tg) x = rng.uniform(0, 1) < 0.8 ? int32_t(rng.integer(0, 39)) : -1;
  model->zero_grad();
  const double loss = model->forward_backward(in.data(), tg.data(), B, T, true).loss;
  size_t checked = 0;
  for (train::Param* p : model->params()) {
    double gnorm2 = 0;
    for (float g : p->grad.span_f32()) gnorm2 += double(g) * g;
    const double gnorm = std::sqrt(gnorm2);
    ASSERT_TRUE(std::isfinite(gnorm)) << p->name;
    if (p->name.find("e_score_correction_bias") != std::string::npos) {
      EXPECT_EQ(gnorm, 0.0) << p->name;  // steers the selection only: no gradient
      continue;
    }
    ASSERT_GT(gnorm, 1e-7) << p->name;  // every other tensor takes part
    ++checked;
    testing::GradientFdOptions opt;
    opt.max_step = 0.1;
    testing::check_gradient_fd(
        p, [&] { return model->forward_backward(in.data(), tg.data(), B, T, false).loss; }, loss,
        rng, opt, p->name);
  }
  EXPECT_GT(checked, 0u);
}

TEST(HfKimiTrain, EveryGradientMatchesDirectionalFiniteDifferences) {
  expect_gradients_match_finite_differences(small_config(4, 4));
}

// The query through q_a_proj, q_a_layernorm and q_b_proj; a width-3 convolution, two shared
// experts.
TEST(HfKimiTrain, QLoraGradientsMatchDirectionalFiniteDifferences) {
  json c = small_config(4, 4);
  c["q_lora_rank"] = 8;
  c["num_shared_experts"] = 2;
  c["linear_attn_config"]["short_conv_kernel_size"] = 3;
  auto model = KimiLinearTrainable::from_config(c, 1);
  size_t q_lora_tensors = 0;
  for (train::Param* p : model->params())
    q_lora_tensors += p->name.find("self_attn.q_a_") != std::string::npos ||
                      p->name.find("self_attn.q_b_proj") != std::string::npos;
  EXPECT_EQ(q_lora_tensors, 3u);
  expect_gradients_match_finite_differences(c);
}

TEST(HfKimiTrain, PackedDocumentsEqualSeparateRows) {
  auto model = KimiLinearTrainable::from_config(small_config(6, 2), 31);
  Random rng(32);
  const int64_t T = 9;
  std::vector<int32_t> in(2 * T), tg(2 * T);
  for (auto& x : in) x = int32_t(rng.integer(0, 39));
  for (auto& x : tg) x = int32_t(rng.integer(0, 39));
  auto grads = [&](int64_t B, int64_t rowT, std::vector<int64_t> cu) {
    model->zero_grad();
    const double loss = model->forward_backward(in.data(), tg.data(), B, rowT, true, cu).loss;
    std::vector<float> all{float(loss)};
    for (train::Param* p : model->params())
      all.insert(all.end(), p->grad.f32(), p->grad.f32() + p->grad.numel());
    return all;
  };
  const std::vector<float> rows = grads(2, T, {});
  const std::vector<float> packed = grads(1, 2 * T, {0, T, 2 * T});
  EXPECT_LE(rel_diff(packed.data(), rows.data(), int64_t(rows.size())), 1e-5);
  EXPECT_NEAR(packed[0], rows[0], 1e-5 * rows[0]);
  // and packing matters: one undivided row differs
  const std::vector<float> joined = grads(1, 2 * T, {});
  EXPECT_GT(rel_diff(joined.data(), rows.data(), int64_t(rows.size())), 1e-3);
}

TEST(HfKimiTrain, SavedModelLoadsForInferenceWithTheSameLoss) {
  auto model = KimiLinearTrainable::from_config(small_config(6, 2), 41);
  const fs::path dir = fs::temp_directory_path() / ("kda_kimi_train_" + std::to_string(getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << model->config().dump(2);
  std::vector<NamedTensor> named;
  for (train::Param* p : model->params()) named.push_back({p->name, &p->value});
  write_safetensors((dir / "model.safetensors").string(), named);
  const auto lm = model::load_causal_lm(dir.string());
  Random rng(42);
  std::vector<int32_t> ids(70);  // longer than one 64-token chunk
  for (auto& x : ids) x = int32_t(rng.integer(0, 39));
  const Tensor logits = lm->forward(ids);
  const int64_t V = 40;
  double loss = 0;
  for (size_t t = 0; t + 1 < ids.size(); ++t) {
    const float* row = logits.f32() + t * V;
    double mx = row[0], sum = 0;
    for (int64_t v = 1; v < V; ++v) mx = std::max(mx, double(row[v]));
    for (int64_t v = 0; v < V; ++v) sum += std::exp(double(row[v]) - mx);
    loss += mx + std::log(sum) - row[ids[t + 1]];
  }
  loss /= double(ids.size() - 1);
  std::vector<int32_t> targets(ids.begin() + 1, ids.end());
  targets.push_back(-1);
  const double train_loss =
      model->forward_backward(ids.data(), targets.data(), 1, int64_t(ids.size()), false).loss;
  EXPECT_NEAR(train_loss, loss, 1e-5 * loss);
  fs::remove_all(dir);
}

TEST(HfKimiTrain, SelectionBiasMovesTowardBalancedLoad) {
  auto model = KimiLinearTrainable::from_config(small_config(6, 2), 51);
  // a selection bias that sends every token to expert 0
  for (train::Param* p : model->params())
    if (p->name.find("e_score_correction_bias") != std::string::npos) p->value.f32()[0] = 1.0f;
  Random rng(52);
  const int64_t T = 64;
  std::vector<int32_t> in(T), tg(T);
  for (auto& x : in) x = int32_t(rng.integer(0, 39));
  for (auto& x : tg) x = int32_t(rng.integer(0, 39));
  model->bias_update_rate = 0.01f;
  model->forward_backward(in.data(), tg.data(), 1, T, true);
  const double before = model->expert_load_imbalance().at(0);
  EXPECT_NEAR(before, 3.0, 1e-9);  // expert 0 takes all 64 tokens, the mean load is 64 / 3
  for (int step = 0; step < 150; ++step) {
    model->after_optimizer_step();
    model->forward_backward(in.data(), tg.data(), 1, T, true);
  }
  const double after = model->expert_load_imbalance().at(0);
  EXPECT_LT(after, 2.0);
  std::printf("max/mean expert load: %.2f -> %.2f\n", before, after);
  model->forward_backward(in.data(), tg.data(), 1, T, false);  // evaluation: not counted
  EXPECT_NEAR(model->expert_load_imbalance().at(0), 1.0, 1e-12);
}

TEST(HfKimiTrain, BadInputsThrow) {
  auto model = KimiLinearTrainable::from_config(small_config(6, 2), 61);
  std::vector<int32_t> in{1, 2, 99}, tg{2, 3, -1};
  EXPECT_THROW(model->forward_backward(in.data(), tg.data(), 1, 3, false), Error);
  in[2] = 3;
  const std::vector<int64_t> bad_cu{0, 2};
  EXPECT_THROW(model->forward_backward(in.data(), tg.data(), 1, 3, false, bad_cu), Error);
}

}  // namespace
}  // namespace kda
