// Kimi Linear for training: embedding, per layer a pre-norm KDA or MLA mixer and a pre-norm
// dense SwiGLU MLP or MoE, final RMSNorm, untied lm_head; backward through all of it.
#include "train/hf_kimi_linear.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/random.h"
#include "model/kimi_linear_blocks.h"
#include "model/model_folder.h"
#include "train/kimi_train_layers.h"
#include "train/layers.h"
#include "train/moe_layer.h"

namespace kda::train {

using json = nlohmann::json;
using model::KimiFfn;
using model::KimiMixer;

namespace {

std::string layer_prefix(int64_t i) {
  return "model.layers." + std::to_string(i) + ".";
}

// A dense SwiGLU MLP: y = down(silu(gate x) * up x).
struct DenseMlp {
  Param *gate, *up, *down;
  int64_t D = 0, I = 0, N = 0;
  std::vector<float> x, a, b, h;

  void forward(const float* in, int64_t rows, float* y) {
    N = rows;
    x.assign(in, in + rows * D);
    a.resize(size_t(rows * I));
    b.resize(size_t(rows * I));
    h.resize(size_t(rows * I));
    linear_forward(in, rows, D, gate->value.f32(), I, a.data());
    linear_forward(in, rows, D, up->value.f32(), I, b.data());
    swiglu_forward(a.data(), b.data(), rows * I, h.data());
    linear_forward(h.data(), rows, I, down->value.f32(), D, y);
  }
  void backward(const float* dy, float* dx) {
    std::vector<float> dh(size_t(N * I)), da(size_t(N * I)), db(size_t(N * I));
    linear_backward(h.data(), dy, N, I, down->value.f32(), D, dh.data(), down->grad.f32());
    swiglu_backward(a.data(), b.data(), dh.data(), N * I, da.data(), db.data());
    linear_backward(x.data(), da.data(), N, D, gate->value.f32(), I, dx, gate->grad.f32());
    linear_backward(x.data(), db.data(), N, D, up->value.f32(), I, dx, up->grad.f32(), true);
  }
};

}  // namespace

struct KimiLinearTrainable::Layer {
  Param *input_norm = nullptr, *post_norm = nullptr;
  std::unique_ptr<KimiKdaTrainLayer> kda;
  std::unique_ptr<KimiMlaTrainLayer> mla;
  std::unique_ptr<DenseMlp> mlp;
  std::unique_ptr<MoeLayer> moe;
  // activations: h_in (layer input), a = norm1(h_in), h_mid = h_in + mixer(a), b = norm2(h_mid)
  std::vector<float> h_in, a, inv1, h_mid, b, inv2;
};

KimiLinearTrainable::KimiLinearTrainable(const json& config)
    : json_(config), c_(model::KimiLinearConfig::parse(config)) {}

KimiLinearTrainable::~KimiLinearTrainable() = default;

Param* KimiLinearTrainable::add(const std::string& name, Shape shape, bool decay) {
  auto p = std::make_unique<Param>();
  p->name = name;
  p->value = Tensor(DType::f32, shape);
  p->grad = Tensor(DType::f32, shape);
  p->decay = decay;
  params_.push_back(std::move(p));
  return params_.back().get();
}

void KimiLinearTrainable::build(const std::string& dense_prefix_name) {
  const model::KimiLinearConfig& c = c_;
  const int64_t D = c.hidden_size, V = c.vocab_size;
  embed_ = add("model.embed_tokens.weight", {V, D}, true);
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = layer_prefix(i);
    auto layer = std::make_unique<Layer>();
    layer->input_norm = add(p + "input_layernorm.weight", {D}, false);
    layer->post_norm = add(p + "post_attention_layernorm.weight", {D}, false);
    const std::string a = p + "self_attn.";
    if (c.mixers[i] == KimiMixer::kda) {
      const int64_t H = c.kda_heads, K = c.kda_head_dim, HK = c.kda_width(), W = c.conv_kernel;
      KdaLayerParams w;
      w.q_proj = add(a + "q_proj.weight", {HK, D}, true);
      w.k_proj = add(a + "k_proj.weight", {HK, D}, true);
      w.v_proj = add(a + "v_proj.weight", {HK, D}, true);
      w.q_conv = add(a + "q_conv1d.weight", {HK, 1, W}, false);
      w.k_conv = add(a + "k_conv1d.weight", {HK, 1, W}, false);
      w.v_conv = add(a + "v_conv1d.weight", {HK, 1, W}, false);
      w.f_a = add(a + "f_a_proj.weight", {K, D}, true);
      w.f_b = add(a + "f_b_proj.weight", {HK, K}, true);
      w.g_a = add(a + "g_a_proj.weight", {K, D}, true);
      w.g_b = add(a + "g_b_proj.weight", {HK, K}, true);
      w.b_proj = add(a + "b_proj.weight", {H, D}, true);
      w.A_log = add(a + "A_log", {1, 1, H, 1}, false);
      w.dt_bias = add(a + "dt_bias", {HK}, false);
      w.o_norm = add(a + "o_norm.weight", {K}, false);
      w.o_proj = add(a + "o_proj.weight", {D, HK}, true);
      layer->kda = std::make_unique<KimiKdaTrainLayer>(c_, w);
    } else {
      const int64_t H = c.mla_heads, L = c.kv_lora_rank;
      MlaLayerParams w;
      if (c.q_lora_rank > 0) {  // q = q_b(RMSNorm(q_a x))
        const int64_t R = c.q_lora_rank;
        w.q_a = add(a + "q_a_proj.weight", {R, D}, true);
        w.q_a_layernorm = add(a + "q_a_layernorm.weight", {R}, false);
        w.q_proj = add(a + "q_b_proj.weight", {H * c.mla_qk_dim(), R}, true);
      } else {
        w.q_proj = add(a + "q_proj.weight", {H * c.mla_qk_dim(), D}, true);
      }
      w.kv_a = add(a + "kv_a_proj_with_mqa.weight", {c.mla_row_width(), D}, true);
      w.kv_a_layernorm = add(a + "kv_a_layernorm.weight", {L}, false);
      w.kv_b = add(a + "kv_b_proj.weight", {H * (c.qk_nope_head_dim + c.v_head_dim), L}, true);
      w.o_proj = add(a + "o_proj.weight", {D, H * c.v_head_dim}, true);
      layer->mla = std::make_unique<KimiMlaTrainLayer>(c_, w);
    }
    if (c.ffns[i] == KimiFfn::dense) {
      const std::string d = p + dense_prefix_name;
      const int64_t I = c.dense_intermediate;
      auto mlp = std::make_unique<DenseMlp>();
      mlp->D = D;
      mlp->I = I;
      mlp->gate = add(d + "gate_proj.weight", {I, D}, true);
      mlp->up = add(d + "up_proj.weight", {I, D}, true);
      mlp->down = add(d + "down_proj.weight", {D, I}, true);
      layer->mlp = std::move(mlp);
    } else {
      const std::string m = p + "block_sparse_moe.";
      const int64_t I = c.moe_intermediate, E = c.num_experts;
      MoeParams w;
      w.router = add(m + "gate.weight", {E, D}, true);
      w.bias = add(m + "gate.e_score_correction_bias", {E}, false);
      for (int64_t e = 0; e < E; ++e) {
        const std::string ep = m + "experts." + std::to_string(e) + ".";
        w.w1.push_back(add(ep + "w1.weight", {I, D}, true));
        w.w2.push_back(add(ep + "w2.weight", {D, I}, true));
        w.w3.push_back(add(ep + "w3.weight", {I, D}, true));
      }
      const int64_t Is = I * c.num_shared_experts;
      if (Is > 0) {
        w.shared_gate = add(m + "shared_experts.gate_proj.weight", {Is, D}, true);
        w.shared_up = add(m + "shared_experts.up_proj.weight", {Is, D}, true);
        w.shared_down = add(m + "shared_experts.down_proj.weight", {D, Is}, true);
      }
      layer->moe = std::make_unique<MoeLayer>(model::kimi::moe_routing(c), D, I, Is, w);
    }
    layers_.push_back(std::move(layer));
  }
  final_norm_ = add("model.norm.weight", {D}, false);
  lm_head_ = add("lm_head.weight", {V, D}, true);
}

std::unique_ptr<KimiLinearTrainable> KimiLinearTrainable::from_folder(const std::string& dir) {
  const model::ModelFolder folder = model::ModelFolder::open(dir);
  require(folder.model_type() == "kimi_linear",
          dir + ": model_type is '" + folder.model_type() + "', not kimi_linear");
  std::unique_ptr<KimiLinearTrainable> m(new KimiLinearTrainable(folder.config()));
  // The dense MLP is saved as `mlp.*` (released checkpoint) or `block_sparse_moe.*`
  // (transformers 5.17): keep the folder's names so a saved folder matches it.
  const bool mlp_names = folder.has("model.layers.0.mlp.gate_proj.weight");
  m->build(mlp_names ? "mlp." : "block_sparse_moe.");
  std::map<std::string, Shape> expected;
  for (const auto& p : m->params_) expected[p->name] = p->value.shape();
  folder.check_tensors(expected);
  for (auto& p : m->params_) {
    const Tensor w = folder.load(p->name, p->value.shape());
    std::copy_n(w.f32(), w.numel(), p->value.f32());
  }
  return m;
}

std::unique_ptr<KimiLinearTrainable> KimiLinearTrainable::from_config(const json& config,
                                                                      uint64_t seed) {
  std::unique_ptr<KimiLinearTrainable> m(new KimiLinearTrainable(config));
  m->build("block_sparse_moe.");
  const float sd = float(model::config_double_or(config, "initializer_range", 0.02));
  Random rng(seed);
  for (auto& p : m->params_) {
    float* v = p->value.f32();
    const int64_t n = p->value.numel();
    const std::string& name = p->name;
    auto ends_with = [&](const std::string& s) {
      return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
    };
    if (ends_with("A_log")) {
      for (int64_t i = 0; i < n; ++i) v[i] = std::log(rng.uniform(1.0f, 16.0f));
    } else if (ends_with("dt_bias")) {
      for (int64_t i = 0; i < n; ++i) {
        const float dt = std::exp(rng.uniform(std::log(1e-3f), std::log(0.1f)));
        v[i] = dt + std::log(-std::expm1(-dt));  // softplus(v) = dt
      }
    } else if (ends_with("conv1d.weight")) {
      const float bound = 1.0f / std::sqrt(float(p->value.dim(2)));  // torch's Conv1d default
      rng.fill_uniform(p->value.span_f32(), -bound, bound);
    } else if (ends_with("e_score_correction_bias")) {
      std::fill_n(v, n, 0.0f);
    } else if (p->value.rank() == 1) {  // norms
      std::fill_n(v, n, 1.0f);
    } else {
      rng.fill_normal(p->value.span_f32(), sd);
    }
  }
  return m;
}

std::vector<Param*> KimiLinearTrainable::params() {
  std::vector<Param*> out;
  for (auto& p : params_) out.push_back(p.get());
  return out;
}

StepResult KimiLinearTrainable::forward_backward(const int32_t* inputs, const int32_t* targets,
                                                 int64_t B, int64_t T, bool backward,
                                                 std::span<const int64_t> cu_seqlens) {
  const int64_t D = c_.hidden_size, V = c_.vocab_size, N = B * T;
  const float eps = float(c_.rms_norm_eps);
  require(B >= 1 && T >= 1, "kimi_linear training: B and T must be >= 1");
  const std::vector<int64_t> segments = document_segments(cu_seqlens, B, T, "kimi_linear training");
  std::vector<float> h(size_t(N * D)), tmp(size_t(N * D));
  embedding_forward(embed_->value.f32(), V, D, inputs, N, h.data(), "kimi_linear training");
  for (auto& layer_ptr : layers_) {
    Layer& L = *layer_ptr;
    L.h_in = h;
    L.a.resize(size_t(N * D));
    L.inv1.resize(size_t(N));
    rms_norm_forward(h.data(), N, D, L.input_norm->value.f32(), eps, L.a.data(), L.inv1.data());
    if (L.kda) {
      L.kda->forward(L.a.data(), N, segments, tmp.data());
    } else {
      L.mla->forward(L.a.data(), N, segments, tmp.data());
    }
    for (int64_t i = 0; i < N * D; ++i) h[i] += tmp[i];
    L.h_mid = h;
    L.b.resize(size_t(N * D));
    L.inv2.resize(size_t(N));
    rms_norm_forward(h.data(), N, D, L.post_norm->value.f32(), eps, L.b.data(), L.inv2.data());
    if (L.mlp) {
      L.mlp->forward(L.b.data(), N, tmp.data());
    } else {
      L.moe->forward(L.b.data(), N, tmp.data());
    }
    for (int64_t i = 0; i < N * D; ++i) h[i] += tmp[i];
  }
  std::vector<float> hf(size_t(N * D)), inv_f(static_cast<size_t>(N));
  rms_norm_forward(h.data(), N, D, final_norm_->value.f32(), eps, hf.data(), inv_f.data());
  std::vector<float> dhf(backward ? size_t(N * D) : 0);
  StepResult result;
  result.loss = lm_head_cross_entropy(hf.data(), targets, N, D, lm_head_->value.f32(), V,
                                      backward ? dhf.data() : nullptr, lm_head_->grad.f32(),
                                      &result.scored, &result.correct);
  if (!backward) {  // evaluation passes do not count toward expert balancing
    for (auto& L : layers_)
      if (L->moe) L->moe->update_bias(0.0f);
    return result;
  }

  std::vector<float> dh(size_t(N * D)), dtmp(size_t(N * D)), dnorm(size_t(N * D));
  rms_norm_backward(h.data(), dhf.data(), N, D, final_norm_->value.f32(), inv_f.data(), dh.data(),
                    final_norm_->grad.f32());
  for (auto it = layers_.rbegin(); it != layers_.rend(); ++it) {
    Layer& L = **it;
    if (L.mlp) {
      L.mlp->backward(dh.data(), dnorm.data());
    } else {
      L.moe->backward(dh.data(), dnorm.data());
    }
    residual_rms_norm_backward(L.h_mid.data(), dnorm.data(), N, D, L.post_norm->value.f32(),
                               L.inv2.data(), L.post_norm->grad.f32(), dh.data(), dtmp.data());
    if (L.kda) {
      L.kda->backward(dh.data(), dnorm.data());
    } else {
      L.mla->backward(dh.data(), dnorm.data());
    }
    residual_rms_norm_backward(L.h_in.data(), dnorm.data(), N, D, L.input_norm->value.f32(),
                               L.inv1.data(), L.input_norm->grad.f32(), dh.data(), dtmp.data());
  }
  embedding_backward(inputs, dh.data(), N, D, embed_->grad.f32());
  return result;
}

void KimiLinearTrainable::after_optimizer_step() {
  for (auto& L : layers_)
    if (L->moe) L->moe->update_bias(bias_update_rate);
}

std::vector<double> KimiLinearTrainable::expert_load_imbalance() const {
  std::vector<double> out;
  for (const auto& L : layers_) {
    if (!L->moe) continue;
    const auto load = L->moe->expert_load();
    double total = 0, most = 0;
    for (int64_t n : load) {
      total += double(n);
      most = std::max(most, double(n));
    }
    out.push_back(total > 0 ? most / (total / double(load.size())) : 1.0);
  }
  return out;
}

}  // namespace kda::train
