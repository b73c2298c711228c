#include "train/hf_gpt2.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "core/blas.h"
#include "core/error.h"
#include "core/parallel.h"
#include "core/random.h"
#include "core/token_ids.h"
#include "model/model_folder.h"
#include "ops/attention/attention.h"
#include "train/layers.h"

namespace kda::train {

namespace {

using json = nlohmann::json;
using model::Gpt2Activation;

// Conv1D (weights [in, out]): y = x W + b, or y += x W + b with accumulate.
void conv1d_forward(const float* x, int64_t rows, int64_t in, const float* W, const float* b,
                    int64_t out, float* y, bool accumulate = false) {
  gemm_nn(int(rows), int(out), int(in), 1.0f, x, int(in), W, int(out), accumulate ? 1.0f : 0.0f, y,
          int(out));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o) y[r * out + o] += b[o];
}

// dx = dy W^T (overwritten); dW += x^T dy; db += column sums of dy.
void conv1d_backward(const float* x, const float* dy, int64_t rows, int64_t in, const float* W,
                     int64_t out, float* dx, float* dW, float* db) {
  gemm_nt(int(rows), int(in), int(out), 1.0f, dy, int(out), W, int(out), 0.0f, dx, int(in));
  gemm_tn(int(in), int(out), int(rows), 1.0f, x, int(in), dy, int(out), 1.0f, dW, int(out));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < out; ++o) db[o] += dy[r * out + o];
}

// y = (x - mean) * rstd * w + b per row; mean and rstd [rows] are kept for the backward.
void layer_norm_forward(const float* x, int64_t rows, int64_t D, const float* w, const float* b,
                        float eps, float* y, float* mean, float* rstd) {
  parallel_for_row_blocks(rows, 8.0 * double(D), [&](int64_t first, int64_t end) {
    for (int64_t r = first; r < end; ++r) {
      const float* xr = x + r * D;
      double m = 0, var = 0;
      for (int64_t i = 0; i < D; ++i) m += xr[i];
      m /= double(D);
      for (int64_t i = 0; i < D; ++i) var += (xr[i] - m) * (xr[i] - m);
      var /= double(D);
      const float inv = float(1.0 / std::sqrt(var + double(eps)));
      mean[r] = float(m);
      rstd[r] = inv;
      for (int64_t i = 0; i < D; ++i) y[r * D + i] = (xr[i] - float(m)) * inv * w[i] + b[i];
    }
  });
}

// dx += rstd (g - mean(g) - xhat mean(g xhat)) with g = dy w; dw += dy xhat; db += dy.
void layer_norm_backward(const float* x, const float* dy, int64_t rows, int64_t D, const float* w,
                         const float* mean, const float* rstd, float* dx, float* dw, float* db) {
  parallel_for_row_blocks(rows, 10.0 * double(D), [&](int64_t first, int64_t end) {
    for (int64_t r = first; r < end; ++r) {
      const float* xr = x + r * D;
      const float* dyr = dy + r * D;
      double sum_g = 0, sum_gx = 0;
      for (int64_t i = 0; i < D; ++i) {
        const double g = double(dyr[i]) * w[i];
        sum_g += g;
        sum_gx += g * (xr[i] - mean[r]) * rstd[r];
      }
      const float mg = float(sum_g / double(D)), mgx = float(sum_gx / double(D));
      for (int64_t i = 0; i < D; ++i) {
        const float xhat = (xr[i] - mean[r]) * rstd[r];
        dx[r * D + i] += rstd[r] * (dyr[i] * w[i] - mg - xhat * mgx);
      }
    }
  });
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < D; ++i) {
      dw[i] += dy[r * D + i] * (x[r * D + i] - mean[r]) * rstd[r];
      db[i] += dy[r * D + i];
    }
}

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

void activation_forward(Gpt2Activation act, const float* x, int64_t rows, int64_t width, float* y) {
  parallel_for_row_blocks(rows, 20.0 * double(width), [&](int64_t first, int64_t end) {
    for (int64_t i = first * width; i < end * width; ++i) {
      const float v = x[i];
      switch (act) {
        case Gpt2Activation::gelu_tanh:
          y[i] = 0.5f * v * (1.0f + std::tanh(kSqrt2OverPi * (v + kGeluCubic * v * v * v)));
          break;
        case Gpt2Activation::gelu_erf:
          y[i] = 0.5f * v * (1.0f + std::erf(v * float(M_SQRT1_2)));
          break;
        case Gpt2Activation::relu:
          y[i] = std::max(v, 0.0f);
          break;
        case Gpt2Activation::silu:
          y[i] = v / (1.0f + std::exp(-v));
          break;
      }
    }
  });
}

// dx = dy * act'(x), in place on dy.
void activation_backward(Gpt2Activation act, const float* x, int64_t rows, int64_t width,
                         float* dy) {
  parallel_for_row_blocks(rows, 25.0 * double(width), [&](int64_t first, int64_t end) {
    for (int64_t i = first * width; i < end * width; ++i) {
      const float v = x[i];
      float d = 0;
      switch (act) {
        case Gpt2Activation::gelu_tanh: {
          const float t = std::tanh(kSqrt2OverPi * (v + kGeluCubic * v * v * v));
          d = 0.5f * (1.0f + t) +
              0.5f * v * (1.0f - t * t) * kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * v * v);
          break;
        }
        case Gpt2Activation::gelu_erf:
          d = 0.5f * (1.0f + std::erf(v * float(M_SQRT1_2))) +
              v * std::exp(-0.5f * v * v) * float(0.5 * M_2_SQRTPI * M_SQRT1_2);
          break;
        case Gpt2Activation::relu:
          d = v > 0 ? 1.0f : 0.0f;
          break;
        case Gpt2Activation::silu: {
          const float s = 1.0f / (1.0f + std::exp(-v));
          d = s * (1.0f + v * (1.0f - s));
          break;
        }
      }
      dy[i] *= d;
    }
  });
}

// transformers' GPT-2 config, plus the one rule of training: the head must be tied.
model::Gpt2Config training_config(const json& config_json) {
  model::Gpt2Config c = model::Gpt2Config::from_json(config_json);
  require(c.tied,
          "gpt2 training: tie_word_embeddings = false (a separate lm_head.weight) is not "
          "supported; only the tied head of GPT2LMHeadModel is");
  return c;
}

}  // namespace

struct Gpt2Trainable::Layer {
  Param *ln1_w, *ln1_b, *attn_w, *attn_b, *attn_proj_w, *attn_proj_b;
  Param *ln2_w, *ln2_b, *fc_w, *fc_b, *mlp_proj_w, *mlp_proj_b;
  // kept from the forward for the backward
  std::vector<float> x_in, ln1, mean1, rstd1, q, k, v, o, lse;
  std::vector<float> x_mid, ln2, mean2, rstd2, pre, act;
};

Param* Gpt2Trainable::add(const std::string& name, Shape shape) {
  auto p = std::make_unique<Param>();
  p->name = name;
  p->decay = shape.size() == 2;  // llm.c / nanoGPT: every matrix (embeddings too), no vectors
  p->value = Tensor(DType::f32, shape);
  p->grad = Tensor(DType::f32, shape);
  params_.push_back(std::move(p));
  return params_.back().get();
}

Gpt2Trainable::Gpt2Trainable(const json& config_json, const std::string& prefix)
    : config_(training_config(config_json)), config_json_(config_json) {
  const int64_t V = config_.vocab, P = config_.positions, E = config_.embd, I = config_.inner;
  wte_ = add(prefix + "wte.weight", {V, E});
  wpe_ = add(prefix + "wpe.weight", {P, E});
  for (int64_t l = 0; l < config_.layers; ++l) {
    const std::string pre = prefix + "h." + std::to_string(l) + ".";
    auto layer = std::make_unique<Layer>();
    layer->ln1_w = add(pre + "ln_1.weight", {E});
    layer->ln1_b = add(pre + "ln_1.bias", {E});
    layer->attn_w = add(pre + "attn.c_attn.weight", {E, 3 * E});
    layer->attn_b = add(pre + "attn.c_attn.bias", {3 * E});
    layer->attn_proj_w = add(pre + "attn.c_proj.weight", {E, E});
    layer->attn_proj_b = add(pre + "attn.c_proj.bias", {E});
    layer->ln2_w = add(pre + "ln_2.weight", {E});
    layer->ln2_b = add(pre + "ln_2.bias", {E});
    layer->fc_w = add(pre + "mlp.c_fc.weight", {E, I});
    layer->fc_b = add(pre + "mlp.c_fc.bias", {I});
    layer->mlp_proj_w = add(pre + "mlp.c_proj.weight", {I, E});
    layer->mlp_proj_b = add(pre + "mlp.c_proj.bias", {E});
    layers_.push_back(std::move(layer));
  }
  ln_f_weight_ = add(prefix + "ln_f.weight", {E});
  ln_f_bias_ = add(prefix + "ln_f.bias", {E});
}

Gpt2Trainable::~Gpt2Trainable() = default;

std::unique_ptr<Gpt2Trainable> Gpt2Trainable::from_config(const json& config, uint64_t seed) {
  std::unique_ptr<Gpt2Trainable> m(new Gpt2Trainable(config, "transformer."));
  const model::Gpt2Config& c = m->config_;
  Random rng(seed);
  const float sd = float(c.initializer_range);
  const float proj_sd = float(c.initializer_range / std::sqrt(2.0 * double(c.layers)));
  const auto ends_with = [](const std::string& s, const std::string& tail) {
    return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
  };
  for (auto& p : m->params_) {
    std::span<float> w = p->value.span_f32();
    if (p->value.rank() == 2) {
      rng.fill_normal(w, ends_with(p->name, "c_proj.weight") ? proj_sd : sd);
    } else if (ends_with(p->name, "ln_1.weight") || ends_with(p->name, "ln_2.weight") ||
               ends_with(p->name, "ln_f.weight")) {
      std::fill(w.begin(), w.end(), 1.0f);
    } else {
      std::fill(w.begin(), w.end(), 0.0f);
    }
  }
  return m;
}

std::unique_ptr<Gpt2Trainable> Gpt2Trainable::from_folder(const std::string& dir) {
  const model::ModelFolder folder = model::ModelFolder::open(dir);
  // Checkpoints saved from GPT2LMHeadModel prefix the body with "transformer."; those saved
  // from GPT2Model (e.g. the original "gpt2" upload) do not. Names are kept as found.
  const std::string prefix =
      !folder.has("transformer.wte.weight") && folder.has("wte.weight") ? "" : "transformer.";
  std::unique_ptr<Gpt2Trainable> m(new Gpt2Trainable(folder.config(), prefix));
  std::map<std::string, Shape> expected;
  for (const auto& p : m->params_) expected[p->name] = p->value.shape();
  for (int64_t l = 0; l < m->config_.layers; ++l) {
    // Older transformers versions saved the causal mask buffers; they carry no weights.
    for (const char* buffer : {"attn.bias", "attn.masked_bias"}) {
      const std::string name = prefix + "h." + std::to_string(l) + "." + buffer;
      if (folder.has(name)) expected[name] = folder.view(name).shape;
    }
  }
  // A tied head may be saved too: it is the token embedding.
  if (folder.has("lm_head.weight"))
    expected["lm_head.weight"] = {m->config_.vocab, m->config_.embd};
  folder.check_tensors(expected);
  for (auto& p : m->params_) p->value = folder.load(p->name, p->value.shape());
  return m;
}

json Gpt2Trainable::config() const {
  json c = config_json_;
  c["model_type"] = "gpt2";
  c["architectures"] = json::array({"GPT2LMHeadModel"});
  c["vocab_size"] = config_.vocab;
  c["n_positions"] = config_.positions;
  c["n_embd"] = config_.embd;
  c["n_head"] = config_.heads;
  c["n_layer"] = config_.layers;
  c["n_inner"] = config_.inner;
  c["layer_norm_epsilon"] = config_.eps;
  c["initializer_range"] = config_.initializer_range;
  c["activation_function"] = config_.activation_name;
  c["scale_attn_weights"] = config_.scale_attn_weights;
  c["scale_attn_by_inverse_layer_idx"] = config_.scale_by_inverse_layer;
  c["tie_word_embeddings"] = true;
  // the weights we save are fp32 whatever the source checkpoint held
  c["dtype"] = "float32";
  if (c.contains("torch_dtype")) c["torch_dtype"] = "float32";
  return c;
}

std::vector<Param*> Gpt2Trainable::params() {
  std::vector<Param*> out;
  for (auto& p : params_) out.push_back(p.get());
  return out;
}

StepResult Gpt2Trainable::forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B,
                                           int64_t T, bool backward,
                                           std::span<const int64_t> cu_seqlens) {
  const int64_t V = config_.vocab, E = config_.embd, I = config_.inner, H = config_.heads,
                D = config_.head_dim(), rows = B * T;
  require(B >= 1 && T >= 1, "gpt2: B and T must be >= 1");
  // without cu_seqlens every row is one document: positions restart at each row start
  const std::vector<int64_t> segments = document_segments(cu_seqlens, B, T, "gpt2");
  cu_seqlens_.assign(cu_seqlens.begin(), cu_seqlens.end());
  positions_.resize(rows);
  for (size_t n = 0; n + 1 < segments.size(); ++n)
    for (int64_t r = segments[n]; r < segments[n + 1]; ++r) positions_[r] = r - segments[n];
  require_token_ids({inputs, size_t(rows)}, V, "gpt2");
  for (size_t n = 0; n + 1 < segments.size(); ++n) {  // a document's last position is its longest
    const int64_t last = segments[n + 1] - segments[n] - 1;
    require(last < config_.positions,
            "gpt2: position " + std::to_string(last) + " is past n_positions = " +
                std::to_string(config_.positions) + " (shorten the rows or documents)");
  }
  // the attention op sees a packed batch as one row of B * T tokens delimited by cu_seqlens
  const bool packed = !cu_seqlens_.empty();
  ops::AttentionShape shape;
  shape.B = packed ? 1 : B;
  shape.T = packed ? rows : T;
  shape.H = shape.HKV = H;
  shape.D = shape.DV = D;
  const std::span<const int64_t> cu(cu_seqlens_);

  std::vector<float> x(rows * E), qkv(rows * 3 * E);
  for (int64_t r = 0; r < rows; ++r) {
    const float* tok = wte_->value.f32() + int64_t(inputs[r]) * E;
    const float* pos = wpe_->value.f32() + positions_[r] * E;
    for (int64_t i = 0; i < E; ++i) x[r * E + i] = tok[i] + pos[i];
  }
  for (int64_t l = 0; l < config_.layers; ++l) {
    Layer& L = *layers_[l];
    // attention: x += c_proj(attention(split(c_attn(ln_1(x)))))
    L.x_in = x;
    L.ln1.resize(rows * E);
    L.mean1.resize(rows);
    L.rstd1.resize(rows);
    layer_norm_forward(x.data(), rows, E, L.ln1_w->value.f32(), L.ln1_b->value.f32(),
                       float(config_.eps), L.ln1.data(), L.mean1.data(), L.rstd1.data());
    conv1d_forward(L.ln1.data(), rows, E, L.attn_w->value.f32(), L.attn_b->value.f32(), 3 * E,
                   qkv.data());
    L.q.resize(rows * E);
    L.k.resize(rows * E);
    L.v.resize(rows * E);
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = qkv.data() + r * 3 * E;
      std::copy_n(row, E, L.q.data() + r * E);
      std::copy_n(row + E, E, L.k.data() + r * E);
      std::copy_n(row + 2 * E, E, L.v.data() + r * E);
    }
    shape.scale = config_.attention_scale(l);
    L.o.resize(rows * E);
    L.lse.resize(rows * H);
    ops::attention_flash_forward({shape, L.q.data(), L.k.data(), L.v.data(), cu}, L.o.data(),
                                 L.lse.data());
    conv1d_forward(L.o.data(), rows, E, L.attn_proj_w->value.f32(), L.attn_proj_b->value.f32(), E,
                   x.data(), true);
    // MLP: x += c_proj(act(c_fc(ln_2(x))))
    L.x_mid = x;
    L.ln2.resize(rows * E);
    L.mean2.resize(rows);
    L.rstd2.resize(rows);
    layer_norm_forward(x.data(), rows, E, L.ln2_w->value.f32(), L.ln2_b->value.f32(),
                       float(config_.eps), L.ln2.data(), L.mean2.data(), L.rstd2.data());
    L.pre.resize(rows * I);
    L.act.resize(rows * I);
    conv1d_forward(L.ln2.data(), rows, E, L.fc_w->value.f32(), L.fc_b->value.f32(), I,
                   L.pre.data());
    activation_forward(config_.activation, L.pre.data(), rows, I, L.act.data());
    conv1d_forward(L.act.data(), rows, I, L.mlp_proj_w->value.f32(), L.mlp_proj_b->value.f32(), E,
                   x.data(), true);
  }
  x_final_ = std::move(x);
  ln_f_out_.resize(rows * E);
  ln_f_mean_.resize(rows);
  ln_f_rstd_.resize(rows);
  layer_norm_forward(x_final_.data(), rows, E, ln_f_weight_->value.f32(), ln_f_bias_->value.f32(),
                     float(config_.eps), ln_f_out_.data(), ln_f_mean_.data(), ln_f_rstd_.data());
  // tied head: logits = ln_f(x) wte^T
  std::vector<float> dln(backward ? rows * E : 0);
  StepResult result;
  result.loss = lm_head_cross_entropy(ln_f_out_.data(), targets, rows, E, wte_->value.f32(), V,
                                      backward ? dln.data() : nullptr, wte_->grad.f32(),
                                      &result.scored, &result.correct);
  if (!backward) return result;

  std::vector<float> dh(rows * E, 0.0f);
  layer_norm_backward(x_final_.data(), dln.data(), rows, E, ln_f_weight_->value.f32(),
                      ln_f_mean_.data(), ln_f_rstd_.data(), dh.data(), ln_f_weight_->grad.f32(),
                      ln_f_bias_->grad.f32());
  std::vector<float> dpre(rows * I), d_o(rows * E), dq(rows * E), dk(rows * E), dv(rows * E),
      dqkv(rows * 3 * E);
  for (int64_t l = config_.layers - 1; l >= 0; --l) {
    Layer& L = *layers_[l];
    // MLP
    conv1d_backward(L.act.data(), dh.data(), rows, I, L.mlp_proj_w->value.f32(), E, dpre.data(),
                    L.mlp_proj_w->grad.f32(), L.mlp_proj_b->grad.f32());
    activation_backward(config_.activation, L.pre.data(), rows, I, dpre.data());
    conv1d_backward(L.ln2.data(), dpre.data(), rows, E, L.fc_w->value.f32(), I, dln.data(),
                    L.fc_w->grad.f32(), L.fc_b->grad.f32());
    layer_norm_backward(L.x_mid.data(), dln.data(), rows, E, L.ln2_w->value.f32(), L.mean2.data(),
                        L.rstd2.data(), dh.data(), L.ln2_w->grad.f32(), L.ln2_b->grad.f32());
    // attention
    conv1d_backward(L.o.data(), dh.data(), rows, E, L.attn_proj_w->value.f32(), E, d_o.data(),
                    L.attn_proj_w->grad.f32(), L.attn_proj_b->grad.f32());
    shape.scale = config_.attention_scale(l);
    ops::attention_flash_backward({shape, L.q.data(), L.k.data(), L.v.data(), cu}, L.o.data(),
                                  L.lse.data(), d_o.data(), {dq.data(), dk.data(), dv.data()});
    for (int64_t r = 0; r < rows; ++r) {
      float* row = dqkv.data() + r * 3 * E;
      std::copy_n(dq.data() + r * E, E, row);
      std::copy_n(dk.data() + r * E, E, row + E);
      std::copy_n(dv.data() + r * E, E, row + 2 * E);
    }
    conv1d_backward(L.ln1.data(), dqkv.data(), rows, E, L.attn_w->value.f32(), 3 * E, dln.data(),
                    L.attn_w->grad.f32(), L.attn_b->grad.f32());
    layer_norm_backward(L.x_in.data(), dln.data(), rows, E, L.ln1_w->value.f32(), L.mean1.data(),
                        L.rstd1.data(), dh.data(), L.ln1_w->grad.f32(), L.ln1_b->grad.f32());
  }
  // embeddings: the token embedding also received the head's gradient above
  float* dwte = wte_->grad.f32();
  float* dwpe = wpe_->grad.f32();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < E; ++i) {
      dwte[int64_t(inputs[r]) * E + i] += dh[r * E + i];
      dwpe[positions_[r] * E + i] += dh[r * E + i];
    }
  return result;
}

}  // namespace kda::train
