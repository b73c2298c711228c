// Kimi Linear on the GPU against the CPU model from the same weights: a small config in the
// shape of ../shared/fixtures/models/kimi_linear_tiny (3 KDA + 1 MLA layers, the first layer
// dense, MoE with a shared expert; KDA head_dim 64, the chunked kernels' smallest), B = 2 rows
// of T = 100 and packed documents (and once with q_lora_rank). Checked: the loss; every gradient
// (3e-2, gate parameters against the bound of lineage_train_check.cpp's check_gradients); gradients
// accumulating across calls; the MoE selection bias after an optimizer step and
// after_optimizer_step (equal to the CPU's); pull_values / push_values (exact); a few steps on one
// batch lower the loss.
//
// Expert routing must be the same on both sides, or the comparison means nothing: a near-tie
// between the k-th and (k+1)-th expert flips under bf16 noise. So the check makes ties
// impossible by construction: the residual stream's first E dimensions ("lanes") hold only the
// embedding (every weight writing into the residual has zero rows there), each token's
// embedding names its two experts in the lanes (values in [0.4, 0.7] for them, [-0.4, -0.1]
// for the others), and the router reads only the lanes (a diagonal; zero elsewhere). Each
// token's logits are then its lanes times a common positive factor (its inverse RMS): its two
// positive lanes win on both sides whatever the rounding, and the gradients of every router
// column are still compared.
#include "bench/gpu/train/kimi_train_check.h"
#include "bench/gpu/train/train_check_util.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/random.h"
#include "train/adamw.h"
#include "train/cuda/kimi_cuda_model.h"
#include "train/hf_kimi_linear.h"

namespace {

using namespace kda;
using json = nlohmann::json;
using train::KimiLinearTrainable;
using train::cuda::KimiCudaModel;

int kimi_failed = 0;

void report(const std::string& name, double rel, double tol) {
  const bool ok = std::isfinite(rel) && rel <= tol;
  std::printf("CHECK %-64s %s rel=%.3e tol=%.1e\n", name.c_str(), ok ? "PASS" : "FAIL", rel, tol);
  std::fflush(stdout);
  if (!ok) ++kimi_failed;
}

constexpr int64_t kExperts = 8;
constexpr int64_t kVocab = 256;
// Projection weights are scaled up from the init so that gradients sit above bf16 noise, but
// less than lineage_train_check.cpp's 3x: at 3x this small model is chaotic (a 2^-8 nudge of
// the weights moves the CPU's own gradients by ~4 %, lm_head's included, and the GPU's error,
// ~0.7x that, crosses 3e-2); at 1.5x the worst gradient sits at ~2e-2.
constexpr float kProjectionScale = 1.5f;

// q_lora_rank 0: a single q_proj (the released checkpoint's null)
json check_config(int64_t q_lora_rank = 0) {
  return json{{"model_type", "kimi_linear"},
              {"architectures", {"KimiLinearForCausalLM"}},
              {"vocab_size", kVocab},
              {"hidden_size", 128},
              {"num_hidden_layers", 4},
              {"intermediate_size", 256},
              {"rms_norm_eps", 1e-5},
              {"initializer_range", 0.02},
              {"hidden_act", "silu"},
              {"tie_word_embeddings", false},
              {"model_max_length", 4096},
              {"linear_attn_config",
               {{"kda_layers", {1, 2, 3}},
                {"full_attn_layers", {4}},
                {"num_heads", 2},
                {"head_dim", 64},
                {"short_conv_kernel_size", 4}}},
              {"num_attention_heads", 4},
              {"num_key_value_heads", 4},
              {"q_lora_rank", q_lora_rank > 0 ? json(q_lora_rank) : json(nullptr)},
              {"kv_lora_rank", 64},
              {"qk_nope_head_dim", 32},
              {"qk_rope_head_dim", 16},
              {"v_head_dim", 32},
              {"mla_use_nope", true},
              {"first_k_dense_replace", 1},
              {"moe_layer_freq", 1},
              {"num_experts", kExperts},
              {"num_experts_per_token", 2},
              {"num_shared_experts", 1},
              {"moe_intermediate_size", 32},
              {"moe_renormalize", true},
              {"moe_router_activation_func", "sigmoid"},
              {"routed_scaling_factor", 2.446},
              {"use_grouped_topk", true},
              {"num_expert_group", 1},
              {"topk_group", 1}};
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// The check's weights (see the top): projections x kProjectionScale, then the routing lanes.
void prepare_weights(KimiLinearTrainable& m, uint64_t seed) {
  Random rng(seed + 101);
  for (train::Param* p : m.params()) {
    if (p->decay)
      for (float& w : p->value.span_f32()) w *= kProjectionScale;
    const std::string& name = p->name;
    float* v = p->value.f32();
    if (ends_with(name, "o_proj.weight") || ends_with(name, "down_proj.weight") ||
        ends_with(name, "w2.weight")) {  // [D, *]: writes into the residual stream
      std::fill_n(v, kExperts * p->value.dim(1), 0.0f);
    } else if (name == "model.embed_tokens.weight") {
      const int64_t D = p->value.dim(1);
      for (int64_t t = 0; t < kVocab; ++t) {
        float* row = v + t * D;
        for (int64_t e = 0; e < kExperts; ++e) row[e] = rng.uniform(-0.4f, -0.1f);
        const int64_t a = rng.integer(0, kExperts - 1);
        int64_t b = rng.integer(0, kExperts - 2);
        if (b >= a) ++b;
        row[a] = rng.uniform(0.4f, 0.7f);
        row[b] = rng.uniform(0.4f, 0.7f);
      }
    } else if (ends_with(name, "block_sparse_moe.gate.weight")) {  // [E, D]: lanes only
      const int64_t D = p->value.dim(1);
      std::fill_n(v, p->value.numel(), 0.0f);
      for (int64_t e = 0; e < kExperts; ++e) v[e * D + e] = 0.3f;
    }
  }
}

std::unique_ptr<KimiLinearTrainable> copy_of(KimiLinearTrainable& from, uint64_t seed,
                                             float nudge_scale) {
  auto m = KimiLinearTrainable::from_config(from.config(), seed);
  Random nudge(seed + 7);
  const auto src = from.params();
  const auto dst = m->params();
  for (size_t i = 0; i < src.size(); ++i) {
    const float* a = src[i]->value.f32();
    float* b = dst[i]->value.f32();
    for (int64_t j = 0; j < src[i]->value.numel(); ++j)
      b[j] = nudge_scale > 0 ? a[j] * (1.0f + float(nudge.uniform(-1, 1)) * nudge_scale) : a[j];
  }
  return m;
}

struct Batch {
  std::vector<int32_t> inputs, targets;
};

Batch random_batch(int64_t rows, uint64_t seed) {
  Random rng(seed);
  Batch b{std::vector<int32_t>(size_t(rows)), std::vector<int32_t>(size_t(rows))};
  for (auto& x : b.inputs) x = int32_t(rng.integer(0, kVocab - 1));
  for (auto& x : b.targets) x = rng.uniform(0, 1) < 0.8 ? int32_t(rng.integer(0, kVocab - 1)) : -1;
  return b;
}

bool gate_parameter(const std::string& name) {
  for (const char* part : {"A_log", "dt_bias", "f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj",
                           "block_sparse_moe.gate.weight"})
    if (name.find(part) != std::string::npos) return true;
  return false;
}

void check_model(bool packed, uint64_t seed, int64_t q_lora_rank = 0) {
  const json config = check_config(q_lora_rank);
  auto cpu = KimiLinearTrainable::from_config(config, seed);
  prepare_weights(*cpu, seed);
  // the CPU model again with every weight moved by up to 2^-8 (bf16's rounding): how much its
  // own gradients move measures how ill-conditioned each one is
  auto nudged = copy_of(*cpu, seed, 1.0f / 256.0f);
  KimiCudaModel gpu(copy_of(*cpu, seed, 0.0f));
  const int64_t B = 2, T = 100;
  const Batch b = random_batch(B * T, seed + 1);
  // packed: documents of 37, 63, 1 and 99 tokens (every row start a boundary)
  const std::vector<int64_t> cu =
      packed ? std::vector<int64_t>{0, 37, 100, 101, 200} : std::vector<int64_t>{};
  const std::string tag = std::string("kimi_train ") + (packed ? "packed" : "B=2 T=100") +
                          (q_lora_rank > 0 ? " q_lora" : "");
  cpu->zero_grad();
  gpu.zero_grad();
  nudged->zero_grad();
  const auto rc = cpu->forward_backward(b.inputs.data(), b.targets.data(), B, T, true, cu);
  const auto rg = gpu.forward_backward(b.inputs.data(), b.targets.data(), B, T, true, cu);
  nudged->forward_backward(b.inputs.data(), b.targets.data(), B, T, true, cu);
  report(tag + " loss", std::abs(rg.loss - rc.loss) / std::abs(rc.loss), 5e-3);
  report(tag + " scored", rg.scored == rc.scored ? 0.0 : 1.0, 0);

  // every gradient: 3e-2; gate parameters max(8e-2, 4x the nudge's effect on the CPU)
  double worst = 0, worst_gate = 0;
  std::string worst_name, worst_gate_name;
  const auto cpu_params = cpu->params();
  const auto nudged_params = nudged->params();
  for (size_t i = 0; i < cpu_params.size(); ++i) {
    const train::Param* p = cpu_params[i];
    const std::vector<float> g = gpu.gradient(p->name);
    const double rel = rel_error(g.data(), p->grad.f32(), g.size());
    if (!gate_parameter(p->name)) {
      if (!(rel <= worst)) worst = rel, worst_name = p->name;
      continue;
    }
    const double noise =
        rel_error(nudged_params[i]->grad.f32(), p->grad.f32(), size_t(p->grad.numel()));
    const double bound = std::max(8e-2, 4 * noise);
    if (!(rel / bound <= worst_gate)) {
      worst_gate = rel / bound;
      char detail[160];
      std::snprintf(detail, sizeof detail, "%s %.2e, bound %.2e", p->name.c_str(), rel, bound);
      worst_gate_name = detail;
    }
  }
  report(tag + " gradients (worst: " + worst_name + ")", worst, 3e-2);
  report(tag + " gate grads / bound (" + worst_gate_name + ")", worst_gate, 1.0);

  // one optimizer step on each side, then the bias update: the selection biases agree exactly
  // (same routing, same loads, the CPU's float arithmetic)
  train::AdamWConfig opt;
  opt.lr = 1e-3f;
  opt.total_steps = 10;
  opt.warmup_steps = 1;
  train::AdamW cpu_opt(cpu->params(), opt);
  const auto gpu_opt = gpu.make_optimizer(opt);
  cpu_opt.step();
  gpu_opt->step();
  cpu->after_optimizer_step();
  gpu.after_optimizer_step();
  double worst_bias = 0;
  bool moved = false;
  for (const train::Param* p : cpu->params()) {
    if (!ends_with(p->name, "e_score_correction_bias")) continue;
    const std::vector<float> v = gpu.value(p->name);
    worst_bias = std::max(worst_bias, rel_error(v.data(), p->value.f32(), v.size()));
    for (int64_t e = 0; e < p->value.numel(); ++e) moved = moved || p->value.f32()[e] != 0.0f;
  }
  report(tag + " MoE selection bias after a step (equal to the CPU's)", moved ? worst_bias : 1.0,
         0);

  // pull_values / push_values: the host mirrors get the device weights bit for bit, and back
  gpu.pull_values();
  std::vector<std::vector<float>> pulled;
  for (train::Param* p : gpu.params())
    pulled.emplace_back(p->value.f32(), p->value.f32() + p->value.numel());
  gpu.push_values();
  double worst_trip = 0;
  const auto gpu_params = gpu.params();
  for (size_t i = 0; i < gpu_params.size(); ++i) {
    const std::vector<float> v = gpu.value(gpu_params[i]->name);
    worst_trip = std::max(worst_trip, rel_error(v.data(), pulled[i].data(), v.size()));
  }
  report(tag + " pull_values / push_values round trip", worst_trip, 0);
}

// A second call adds its gradients: twice the same batch = 2x one (deterministic parameters:
// everything but KDA's A_log / dt_bias, which the kernel sums with atomics).
void check_accumulation() {
  const json config = check_config();
  auto host = KimiLinearTrainable::from_config(config, 31);
  prepare_weights(*host, 31);
  KimiCudaModel gpu(std::move(host));
  const Batch b = random_batch(2 * 64, 32);
  const std::vector<std::string> names = {"model.layers.0.self_attn.q_proj.weight",
                                          "model.layers.0.self_attn.o_norm.weight",
                                          "model.layers.1.block_sparse_moe.experts.0.w1.weight",
                                          "model.layers.2.block_sparse_moe.gate.weight",
                                          "model.layers.3.self_attn.kv_b_proj.weight",
                                          "model.embed_tokens.weight"};
  gpu.zero_grad();
  gpu.forward_backward(b.inputs.data(), b.targets.data(), 2, 64, true);
  std::vector<std::vector<float>> once;
  for (const auto& n : names) once.push_back(gpu.gradient(n));
  gpu.forward_backward(b.inputs.data(), b.targets.data(), 2, 64, true);
  double worst = 0;
  for (size_t i = 0; i < names.size(); ++i) {
    std::vector<float> twice = gpu.gradient(names[i]);
    for (float& x : twice) x *= 0.5f;
    worst = std::max(worst, rel_error(twice.data(), once[i].data(), once[i].size()));
  }
  report("kimi_train gradients accumulate across calls", worst, 1e-6);
  // a smaller batch after a larger one (buffers reused), and an evaluation pass: same loss as
  // the training pass of the same batch
  const Batch small = random_batch(1 * 37, 33);
  const double train_loss =
      gpu.forward_backward(small.inputs.data(), small.targets.data(), 1, 37, true).loss;
  const double eval_loss =
      gpu.forward_backward(small.inputs.data(), small.targets.data(), 1, 37, false).loss;
  report("kimi_train evaluation pass = training pass (smaller batch)",
         std::abs(eval_loss - train_loss) / train_loss, 1e-6);
}

// A few AdamW steps on one batch lower its loss (the whole loop on the device).
void check_learns() {
  auto host = KimiLinearTrainable::from_config(check_config(), 41);
  KimiCudaModel gpu(std::move(host));
  train::AdamWConfig opt;
  opt.lr = 3e-3f;
  opt.total_steps = 30;
  opt.warmup_steps = 3;
  const auto o = gpu.make_optimizer(opt);
  const Batch b = random_batch(4 * 64, 42);
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    gpu.zero_grad();
    const double loss = gpu.forward_backward(b.inputs.data(), b.targets.data(), 4, 64, true).loss;
    o->step();
    gpu.after_optimizer_step();
    if (step == 0) first = loss;
    last = loss;
  }
  std::printf("kimi_train one batch, 30 steps: loss %.3f -> %.3f\n", first, last);
  report("kimi_train 30 steps on one batch: loss fell (final / first)", last / first, 0.9);
}

}  // namespace

int run_kimi_train_checks() {
  kimi_failed = 0;
  try {
    check_model(false, 51);
    check_model(true, 52);
    check_model(true, 53, 48);  // the MLA query through q_a, its norm and q_b
    check_accumulation();
    check_learns();
  } catch (const std::exception& e) {
    std::printf("CHECK %-64s FAIL rel=inf tol=0 (%s)\n", "kimi_train (exception)", e.what());
    std::fflush(stdout);
    ++kimi_failed;
  }
  return kimi_failed;
}
