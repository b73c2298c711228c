#include "train/lineage_model.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/random.h"
#include "train/kimi_train_layers.h"
#include "train/layers.h"
#include "train/mixer_layer.h"

namespace kda::train {

MixerKind mixer_from_letter(char letter) {
  switch (letter) {
    case 'A':
      return MixerKind::softmax;
    case 'L':
      return MixerKind::linear;
    case 'D':
      return MixerKind::delta;
    case 'G':
      return MixerKind::gated_delta;
    case 'K':
      return MixerKind::kda;
    case 'M':
      return MixerKind::mla;
  }
  throw Error(std::string("unknown mixer letter '") + letter +
              "' (A softmax, L linear, D DeltaNet, G Gated DeltaNet, K KDA, M MLA)");
}

std::string mixer_name(MixerKind kind) {
  switch (kind) {
    case MixerKind::softmax:
      return "softmax";
    case MixerKind::linear:
      return "linear";
    case MixerKind::delta:
      return "delta";
    case MixerKind::gated_delta:
      return "gated_delta";
    case MixerKind::kda:
      return "kda";
    case MixerKind::mla:
      return "mla";
  }
  return "?";
}

void LineageConfig::validate() const {
  require(vocab >= 2 && width >= 1 && heads >= 1 && head_dim >= 1 && mlp_hidden >= 1,
          "lineage model: sizes must be positive");
  require(!pattern.empty(), "lineage model: the layer pattern is empty");
  for (char c : pattern) mixer_from_letter(c);
  require(gate_dt_max > 0 && gate_dt_max <= 1, "lineage model: gate_dt_max must be in (0, 1]");
  require(kda_gate == "softplus" || kda_gate == "bounded",
          "lineage model: kda_gate must be softplus or bounded, not '" + kda_gate + "'");
}

ops::KdaOptions LineageConfig::kda_options() const {
  ops::KdaOptions o;
  o.gate = kda_gate == "bounded" ? ops::KdaGate::lower_bound : ops::KdaGate::softplus;
  o.lower_bound = kKdaLowerBound;
  return o;
}

struct LineageModel::Block {
  Param *norm1, *norm2, *W1, *W3, *W2;
  std::unique_ptr<MixerLayer> mixer;
  // MLA layers: Kimi Linear's NoPE MLA at the lineage's sizes (see LineageConfig)
  model::KimiLinearConfig mla_config;
  std::unique_ptr<KimiMlaTrainLayer> mla;
  // kept for the backward
  std::vector<float> h_in, a, inv1, h_mid, b, inv2, up_a, up_b, act;
};

Param* LineageModel::add(const std::string& name, Shape shape, bool decay) {
  auto p = std::make_unique<Param>();
  p->name = name;
  p->value = Tensor(DType::f32, shape);
  p->grad = Tensor(DType::f32, shape);
  p->decay = decay;
  params_.push_back(std::move(p));
  return params_.back().get();
}

LineageModel::LineageModel(const LineageConfig& config, uint64_t seed) : config_(config) {
  config_.validate();
  Random rng(seed);
  const int64_t d = config.width, H = config.heads, dh = config.head_dim, inner = H * dh,
                L = int64_t(config.pattern.size());
  auto normal = [&](Param* p, float sd) { rng.fill_normal(p->value.span_f32(), sd); };
  auto ones = [&](Param* p) {
    for (float& x : p->value.span_f32()) x = 1.0f;
  };
  const float sd = 0.02f, out_sd = 0.02f / std::sqrt(2.0f * float(L));
  embed_ = add("embed", {config.vocab, d}, true);
  normal(embed_, sd);
  for (int64_t l = 0; l < L; ++l) {
    const std::string pre = "layers." + std::to_string(l) + ".";
    const MixerKind kind = mixer_from_letter(config.pattern[l]);
    auto block = std::make_unique<Block>();
    block->norm1 = add(pre + "norm1", {d}, false);
    ones(block->norm1);
    if (kind == MixerKind::mla) {
      model::KimiLinearConfig& c = block->mla_config;
      c.hidden_size = d;
      c.mla_heads = H;
      c.qk_nope_head_dim = dh;
      c.qk_rope_head_dim = std::max<int64_t>(1, dh / 2);
      c.v_head_dim = dh;
      c.kv_lora_rank = 4 * dh;
      MlaLayerParams m;
      m.q_proj = add(pre + "mixer.q", {H * c.mla_qk_dim(), d}, true);
      m.kv_a = add(pre + "mixer.kv_a", {c.mla_row_width(), d}, true);
      m.kv_a_layernorm = add(pre + "mixer.kv_a_norm", {c.kv_lora_rank}, false);
      m.kv_b = add(pre + "mixer.kv_b", {H * (dh + dh), c.kv_lora_rank}, true);
      m.o_proj = add(pre + "mixer.o", {d, H * dh}, true);
      for (Param* p : {m.q_proj, m.kv_a, m.kv_b}) normal(p, sd);
      ones(m.kv_a_layernorm);
      normal(m.o_proj, out_sd);
      block->mla = std::make_unique<KimiMlaTrainLayer>(block->mla_config, m);
    }
    MixerWeights w;
    if (kind != MixerKind::mla) {
      w.Wq = add(pre + "mixer.q", {inner, d}, true);
      w.Wk = add(pre + "mixer.k", {inner, d}, true);
      w.Wv = add(pre + "mixer.v", {inner, d}, true);
      w.Wo = add(pre + "mixer.o", {d, inner}, true);
      for (Param* p : {w.Wq, w.Wk, w.Wv}) normal(p, sd);
      normal(w.Wo, out_sd);
      if (kind == MixerKind::delta || kind == MixerKind::gated_delta || kind == MixerKind::kda) {
        w.Wb = add(pre + "mixer.b", {H, d}, true);
        normal(w.Wb, sd);
        // torch's Conv1d default: uniform(+-1/sqrt(kernel width))
        const float bound = 1.0f / std::sqrt(float(kShortConvWidth));
        w.q_conv = add(pre + "mixer.q_conv", {inner, 1, kShortConvWidth}, false);
        w.k_conv = add(pre + "mixer.k_conv", {inner, 1, kShortConvWidth}, false);
        w.v_conv = add(pre + "mixer.v_conv", {inner, 1, kShortConvWidth}, false);
        for (Param* p : {w.q_conv, w.k_conv, w.v_conv})
          rng.fill_uniform(p->value.span_f32(), -bound, bound);
      }
      if (kind == MixerKind::gated_delta || kind == MixerKind::kda) {
        const int64_t gw = kind == MixerKind::kda ? inner : H;
        w.Wg = add(pre + "mixer.g", {gw, d}, true);
        normal(w.Wg, sd);
        w.A_log = add(pre + "mixer.A_log", {H}, false);
        for (float& a : w.A_log->value.span_f32()) a = std::log(rng.uniform(1.0f, 16.0f));
        w.dt_bias = add(pre + "mixer.dt_bias", {gw}, false);
        // Mamba's init: dt in [1e-3, 1e-1] log-uniformly, stored as softplus^-1(dt). One draw per
        // head, shared by all of a KDA head's channels: KDA starts as Gated DeltaNet does and its
        // channels specialise in training. fla draws dt per channel; in our 2-layer, head-32
        // models that mix of decay rates inside each head (memories from ~1 to ~1000 tokens) kept
        // KDA from learning MQAR (13.6 % vs 98.8 % at 2000 steps, docs/RECALL.md).
        // (--gate-dt-per-channel: one draw per KDA channel, as fla does)
        const int64_t per_head = gw / H;
        const int64_t draws = kind == MixerKind::kda && config.gate_dt_per_channel ? per_head : 1;
        for (int64_t h = 0; h < H; ++h) {
          const float a = std::exp(w.A_log->value.f32()[h]);
          for (int64_t c = 0; c < draws; ++c) {
            const float dt = std::exp(
                rng.uniform(std::log(config.gate_dt_max / 100.0f), std::log(config.gate_dt_max)));
            float b = dt + std::log(-std::expm1(-dt));
            if (kind == MixerKind::kda && config.kda_gate == "bounded") {
              // The bounded gate lower_bound sigmoid(exp(A_log) (graw + dt_bias)) multiplies the
              // random projection's noise (graw ~ 0.3 at init) by exp(A_log): at fla's 1..16 the
              // gate swings between no decay and the bound token by token and KDA learned
              // nothing (MQAR, docs/RECALL.md). So A_log starts at 0 and dt_bias gives the
              // softplus gate's starting decay a dt: sigmoid(b) = a dt / |lower_bound|, capped
              // at 90 %.
              const float p = std::min(0.9f, a * dt / float(-LineageConfig::kKdaLowerBound));
              b = std::log(p / (1.0f - p));
            }
            float* bias = w.dt_bias->value.f32() + h * per_head;
            if (draws == 1)
              std::fill_n(bias, per_head, b);
            else
              bias[c] = b;
          }
          if (kind == MixerKind::kda && config.kda_gate == "bounded")
            w.A_log->value.f32()[h] = 0.0f;
        }
      }
      block->mixer = std::make_unique<MixerLayer>(kind, d, H, dh, w, config.softmax_rope());
      block->mixer->set_kda_options(config.kda_options());
    }
    block->norm2 = add(pre + "norm2", {d}, false);
    ones(block->norm2);
    block->W1 = add(pre + "mlp.gate", {config.mlp_hidden, d}, true);
    block->W3 = add(pre + "mlp.up", {config.mlp_hidden, d}, true);
    block->W2 = add(pre + "mlp.down", {d, config.mlp_hidden}, true);
    normal(block->W1, sd);
    normal(block->W3, sd);
    normal(block->W2, out_sd);
    blocks_.push_back(std::move(block));
  }
  final_norm_ = add("final_norm", {d}, false);
  ones(final_norm_);
  lm_head_ = add("lm_head", {config.vocab, d}, true);
  normal(lm_head_, sd);
}

LineageModel::~LineageModel() = default;

std::vector<Param*> LineageModel::params() {
  std::vector<Param*> out;
  for (auto& p : params_) out.push_back(p.get());
  return out;
}

int64_t LineageModel::num_params() const {
  int64_t n = 0;
  for (const auto& p : params_) n += p->value.numel();
  return n;
}

StepResult LineageModel::forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B,
                                          int64_t T, bool backward,
                                          std::span<const int64_t> cu_seqlens) {
  const int64_t d = config_.width, rows = B * T, V = config_.vocab, F = config_.mlp_hidden;
  require(B >= 1 && T >= 1, "lineage model: B and T must be >= 1");
  const std::vector<int64_t> segments = document_segments(cu_seqlens, B, T, "lineage model");
  const float eps = config_.norm_eps;
  std::vector<float> h(rows * d), tmp(rows * d);
  embedding_forward(embed_->value.f32(), V, d, inputs, rows, h.data(), "lineage model");
  for (auto& blk : blocks_) {
    Block& b = *blk;
    b.h_in = h;
    b.a.resize(rows * d);
    b.inv1.resize(rows);
    rms_norm_forward(h.data(), rows, d, b.norm1->value.f32(), eps, b.a.data(), b.inv1.data());
    if (b.mla) {
      b.mla->forward(b.a.data(), rows, segments, tmp.data());
    } else {
      b.mixer->forward(b.a.data(), B, T, tmp.data(), cu_seqlens);
    }
    for (int64_t i = 0; i < rows * d; ++i) h[i] += tmp[i];
    b.h_mid = h;
    b.b.resize(rows * d);
    b.inv2.resize(rows);
    rms_norm_forward(h.data(), rows, d, b.norm2->value.f32(), eps, b.b.data(), b.inv2.data());
    b.up_a.resize(rows * F);
    b.up_b.resize(rows * F);
    b.act.resize(rows * F);
    linear_forward(b.b.data(), rows, d, b.W1->value.f32(), F, b.up_a.data());
    linear_forward(b.b.data(), rows, d, b.W3->value.f32(), F, b.up_b.data());
    swiglu_forward(b.up_a.data(), b.up_b.data(), rows * F, b.act.data());
    linear_forward(b.act.data(), rows, F, b.W2->value.f32(), d, tmp.data());
    for (int64_t i = 0; i < rows * d; ++i) h[i] += tmp[i];
  }
  std::vector<float> hf(rows * d), inv_f(rows);
  rms_norm_forward(h.data(), rows, d, final_norm_->value.f32(), eps, hf.data(), inv_f.data());
  std::vector<float> dhf(backward ? rows * d : 0);
  StepResult result;
  result.loss = lm_head_cross_entropy(hf.data(), targets, rows, d, lm_head_->value.f32(), V,
                                      backward ? dhf.data() : nullptr, lm_head_->grad.f32(),
                                      &result.scored, &result.correct);
  if (!backward) return result;

  std::vector<float> dh(rows * d), dtmp(rows * d);
  rms_norm_backward(h.data(), dhf.data(), rows, d, final_norm_->value.f32(), inv_f.data(),
                    dh.data(), final_norm_->grad.f32());
  for (auto it = blocks_.rbegin(); it != blocks_.rend(); ++it) {
    Block& b = **it;
    // MLP: h = h_mid + W2 swiglu(W1 b, W3 b), b = norm2(h_mid)
    std::vector<float> dact(rows * F), da(rows * F), db(rows * F), dbn(rows * d);
    linear_backward(b.act.data(), dh.data(), rows, F, b.W2->value.f32(), d, dact.data(),
                    b.W2->grad.f32());
    swiglu_backward(b.up_a.data(), b.up_b.data(), dact.data(), rows * F, da.data(), db.data());
    linear_backward(b.b.data(), da.data(), rows, d, b.W1->value.f32(), F, dbn.data(),
                    b.W1->grad.f32());
    linear_backward(b.b.data(), db.data(), rows, d, b.W3->value.f32(), F, dbn.data(),
                    b.W3->grad.f32(), true);
    residual_rms_norm_backward(b.h_mid.data(), dbn.data(), rows, d, b.norm2->value.f32(),
                               b.inv2.data(), b.norm2->grad.f32(), dh.data(), dtmp.data());
    // mixer: h_mid = h_in + mixer(norm1(h_in))
    std::vector<float> dan(rows * d);
    if (b.mla) {
      b.mla->backward(dh.data(), dan.data());
    } else {
      b.mixer->backward(dh.data(), dan.data());
    }
    residual_rms_norm_backward(b.h_in.data(), dan.data(), rows, d, b.norm1->value.f32(),
                               b.inv1.data(), b.norm1->grad.f32(), dh.data(), dtmp.data());
  }
  embedding_backward(inputs, dh.data(), rows, d, embed_->grad.f32());
  return result;
}

}  // namespace kda::train
