#include "model/gpt2.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "core/token_ids.h"
#include "model/gpt2_config.h"
#include "ops/attention/attention.h"
#include "ops/nn/nn.h"

namespace kda::model {

std::string gpt2_prefix(const ModelFolder& folder) {
  // Checkpoints saved from GPT2LMHeadModel prefix the body with "transformer."; those saved
  // from GPT2Model (e.g. the original "gpt2" upload) do not.
  return !folder.has("transformer.wte.weight") && folder.has("wte.weight") ? "" : "transformer.";
}

std::map<std::string, Shape> gpt2_expected_tensors(const Gpt2Config& c, const ModelFolder& folder) {
  const int64_t V = c.vocab, P = c.positions, E = c.embd, I = c.inner;
  const std::string prefix = gpt2_prefix(folder);
  std::map<std::string, Shape> expected = {
      {prefix + "wte.weight", {V, E}},
      {prefix + "wpe.weight", {P, E}},
      {prefix + "ln_f.weight", {E}},
      {prefix + "ln_f.bias", {E}},
  };
  const auto layer_name = [&](int64_t l, const std::string& rest) {
    return prefix + "h." + std::to_string(l) + "." + rest;
  };
  for (int64_t l = 0; l < c.layers; ++l) {
    expected[layer_name(l, "ln_1.weight")] = {E};
    expected[layer_name(l, "ln_1.bias")] = {E};
    expected[layer_name(l, "attn.c_attn.weight")] = {E, 3 * E};
    expected[layer_name(l, "attn.c_attn.bias")] = {3 * E};
    expected[layer_name(l, "attn.c_proj.weight")] = {E, E};
    expected[layer_name(l, "attn.c_proj.bias")] = {E};
    expected[layer_name(l, "ln_2.weight")] = {E};
    expected[layer_name(l, "ln_2.bias")] = {E};
    expected[layer_name(l, "mlp.c_fc.weight")] = {E, I};
    expected[layer_name(l, "mlp.c_fc.bias")] = {I};
    expected[layer_name(l, "mlp.c_proj.weight")] = {I, E};
    expected[layer_name(l, "mlp.c_proj.bias")] = {E};
    // Older transformers versions saved the causal mask buffers; they carry no weights.
    for (const char* buffer : {"attn.bias", "attn.masked_bias"}) {
      const std::string name = layer_name(l, buffer);
      if (folder.has(name)) expected[name] = folder.view(name).shape;
    }
  }
  // A tied lm_head may be saved too (it is the token embedding); an untied one must be.
  if (!c.tied || folder.has("lm_head.weight")) expected["lm_head.weight"] = {V, E};
  return expected;
}

namespace {

using json = nlohmann::json;

ArchitectureInfo describe(const Gpt2Config& c) {
  ArchitectureInfo info;
  info.model_type = "gpt2";
  info.summary = "GPT-2: " + std::to_string(c.layers) + " layers, width " + std::to_string(c.embd) +
                 ", " + std::to_string(c.heads) + " heads of " + std::to_string(c.head_dim()) +
                 ", MLP " + std::to_string(c.inner) + " (" + c.activation_name + "), vocab " +
                 std::to_string(c.vocab) + ", context " + std::to_string(c.positions) +
                 (c.tied ? ", tied embeddings" : ", separate lm_head");
  info.layer_kinds.assign(size_t(c.layers), "softmax attention + MLP");
  info.total_params = c.total_params();
  info.active_params = info.total_params;  // dense: every weight touches every token
  info.num_state_layers = 0;
  info.state_bytes_per_layer = 0;
  info.num_cache_layers = c.layers;
  info.cache_bytes_per_token_per_layer = 2 * c.embd * 2;  // K and V, bf16
  return info;
}

void layer_norm_rows(const float* x, int64_t rows, int64_t D, const Tensor& weight,
                     const Tensor& bias, float eps, float* y) {
  parallel_for_row_blocks(rows, 8.0 * double(D), [&](int64_t first, int64_t end) {
    ops::layer_norm(x + first * D, end - first, D, weight.f32(), bias.f32(), eps, y + first * D);
  });
}

void activate_rows(Gpt2Activation act, float* h, int64_t rows, int64_t width) {
  parallel_for_row_blocks(rows, 20.0 * double(width), [&](int64_t first, int64_t end) {
    float* p = h + first * width;
    const int64_t n = (end - first) * width;
    switch (act) {
      case Gpt2Activation::gelu_tanh:
        ops::gelu_tanh(p, n);
        break;
      case Gpt2Activation::gelu_erf:
        for (int64_t i = 0; i < n; ++i) p[i] = 0.5f * p[i] * (1.0f + std::erf(p[i] * M_SQRT1_2f));
        break;
      case Gpt2Activation::relu:
        for (int64_t i = 0; i < n; ++i) p[i] = std::max(p[i], 0.0f);
        break;
      case Gpt2Activation::silu:
        ops::silu(p, n);
        break;
    }
  });
}

void add_bias_rows(float* y, int64_t rows, const Tensor& bias) {
  const int64_t D = bias.numel();
  const float* b = bias.f32();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < D; ++i) y[r * D + i] += b[i];
}

// y[T, out] (= or +=) x[T, in] W[out, in]^T (+ bias). One token (decode) goes through a
// matrix-vector product: OpenBLAS 0.3.21's sgemm packs the whole weight even for one row, which
// made decode steps 2-10x slower per projection on this machine. Small weights stay on this
// thread (OpenBLAS would wake its threads for anything above ~10K elements, which costs more
// than the product, and much more on a busy machine).
void project(const float* x, int64_t T, int64_t in, const Tensor& W, const Tensor* bias,
             bool accumulate, float* y) {
  const int64_t out = W.dim(0);
  if (accumulate) {
    ops::linear_accumulate(x, T, in, W.f32(), out, y);
    if (bias) add_bias_rows(y, T, *bias);
  } else {
    ops::linear(x, T, in, W.f32(), out, bias ? bias->f32() : nullptr, y);
  }
}

// A checkpoint's Conv1D weight [in, out] as ops::linear's [out, in].
Tensor transposed(const Tensor& w) {
  const int64_t rows = w.dim(0), cols = w.dim(1);
  Tensor out(DType::f32, {cols, rows});
  const float* src = w.f32();
  float* dst = out.f32();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
  return out;
}

struct Gpt2Layer {
  Tensor ln1_weight, ln1_bias;
  Tensor qkv_weight, qkv_bias;  // [3E, E], [3E]: q, k, v stacked along the output
  Tensor out_weight, out_bias;  // [E, E], [E]
  Tensor ln2_weight, ln2_bias;
  Tensor fc_weight, fc_bias;      // [I, E], [I]
  Tensor down_weight, down_bias;  // [E, I], [E]
};

class Gpt2Model;

class Gpt2Session : public Session {
 public:
  Gpt2Session(const Gpt2Model& model, int64_t max_context);
  Tensor feed(std::span<const int32_t> ids) override;
  Tensor feed_last(std::span<const int32_t> ids) override;
  int64_t length() const override { return length_; }
  int64_t max_context() const override { return max_context_; }
  MemoryReport memory() const override;
  std::unique_ptr<Session> clone() const override;
  // for Gpt2Model::decode_batch
  const Gpt2Model& model() const { return model_; }
  std::vector<ops::KvCache>& caches() { return caches_; }
  void advance(int64_t tokens) { length_ += tokens; }

 private:
  const Gpt2Model& model_;
  int64_t max_context_;
  std::vector<ops::KvCache> caches_;  // one per layer, one slot
  int64_t length_ = 0;
};

class Gpt2Model : public CausalLM {
 public:
  Gpt2Model(const Gpt2Config& config, const ModelFolder& folder);

  const ArchitectureInfo& info() const override { return info_; }
  int64_t vocab_size() const override { return config_.vocab; }
  int64_t weight_bytes() const override { return weight_bytes_; }
  Tensor forward(std::span<const int32_t> ids) const override {
    check_ids(ids, 0, config_.positions);
    return run(ids, 0, nullptr, false);
  }
  std::unique_ptr<Session> start_session(int64_t max_context = 0) const override {
    require(max_context >= 0 && max_context <= config_.positions,
            "gpt2: max_context " + std::to_string(max_context) +
                " is outside [1, n_positions = " + std::to_string(config_.positions) + "]");
    return std::make_unique<Gpt2Session>(*this, max_context == 0 ? config_.positions : max_context);
  }

  const Gpt2Config& config() const { return config_; }

  // Throws unless `ids` is non-empty, in the vocabulary and fits after `past` tokens within
  // `limit` positions.
  void check_ids(std::span<const int32_t> ids, int64_t past, int64_t limit) const {
    require(!ids.empty(), "gpt2: no tokens to feed");
    require(past + int64_t(ids.size()) <= limit,
            "gpt2: " + std::to_string(past) + " tokens held + " + std::to_string(ids.size()) +
                " new exceed the context of " + std::to_string(limit) + " tokens");
    require_token_ids(ids, config_.vocab, "gpt2");
  }

  // Tokens `ids` at positions past.. through every layer. caches == nullptr: one causal pass
  // without caches; else each layer's keys and values are appended to its cache (prefill for
  // several tokens, a decode step for one). Returns logits [T, V] or, with last_only, [1, V].
  Tensor run(std::span<const int32_t> ids, int64_t past, std::vector<ops::KvCache>* caches,
             bool last_only) const;
  // One token for each of N sequences (row n at position positions[n], its keys and values
  // appended to caches[n]'s layers): logits [N, V], the projections over all N rows at once.
  Tensor run_batch(std::span<const int32_t> ids, std::span<const int64_t> positions,
                   std::span<std::vector<ops::KvCache>* const> caches) const;
  Tensor decode_batch(std::span<Session* const> sessions,
                      std::span<const int32_t> ids) const override;

 private:
  template <class Attend>
  Tensor stack(std::span<const int32_t> ids, std::span<const int64_t> positions, int64_t out_rows,
               const Attend& attend) const;

  Gpt2Config config_;
  ArchitectureInfo info_;
  Tensor token_embedding_, position_embedding_;  // [V, E] (also the lm_head), [P, E]
  Tensor final_norm_weight_, final_norm_bias_;
  Tensor lm_head_;  // [V, E]; empty when tied to the token embedding
  std::vector<Gpt2Layer> layers_;
  int64_t weight_bytes_ = 0;
};

Gpt2Model::Gpt2Model(const Gpt2Config& config, const ModelFolder& folder)
    : config_(config), info_(describe(config)) {
  const std::string prefix = gpt2_prefix(folder);
  const std::map<std::string, Shape> expected = gpt2_expected_tensors(config_, folder);
  const auto layer_name = [&](int64_t l, const std::string& rest) {
    return prefix + "h." + std::to_string(l) + "." + rest;
  };
  folder.check_tensors(expected);

  const auto load = [&](const std::string& name) {
    Tensor t = folder.load(name, expected.at(name));
    weight_bytes_ += int64_t(t.nbytes());
    return t;
  };
  token_embedding_ = load(prefix + "wte.weight");
  position_embedding_ = load(prefix + "wpe.weight");
  final_norm_weight_ = load(prefix + "ln_f.weight");
  final_norm_bias_ = load(prefix + "ln_f.bias");
  if (!config_.tied) lm_head_ = load("lm_head.weight");
  layers_.resize(size_t(config_.layers));
  for (int64_t l = 0; l < config_.layers; ++l) {
    Gpt2Layer& layer = layers_[size_t(l)];
    layer.ln1_weight = load(layer_name(l, "ln_1.weight"));
    layer.ln1_bias = load(layer_name(l, "ln_1.bias"));
    layer.qkv_weight = transposed(load(layer_name(l, "attn.c_attn.weight")));
    layer.qkv_bias = load(layer_name(l, "attn.c_attn.bias"));
    layer.out_weight = transposed(load(layer_name(l, "attn.c_proj.weight")));
    layer.out_bias = load(layer_name(l, "attn.c_proj.bias"));
    layer.ln2_weight = load(layer_name(l, "ln_2.weight"));
    layer.ln2_bias = load(layer_name(l, "ln_2.bias"));
    layer.fc_weight = transposed(load(layer_name(l, "mlp.c_fc.weight")));
    layer.fc_bias = load(layer_name(l, "mlp.c_fc.bias"));
    layer.down_weight = transposed(load(layer_name(l, "mlp.c_proj.weight")));
    layer.down_bias = load(layer_name(l, "mlp.c_proj.bias"));
  }
}

// The layer stack over T rows whose attention `attend(l, shape, q, k, v, o)` supplies (the
// only step that looks across rows): rows at positions[t], logits of the last `out_rows`.
template <class Attend>
Tensor Gpt2Model::stack(std::span<const int32_t> ids, std::span<const int64_t> positions,
                        int64_t out_rows, const Attend& attend) const {
  const int64_t T = int64_t(ids.size()), E = config_.embd, I = config_.inner;
  const int64_t H = config_.heads, D = config_.head_dim();
  std::vector<float> x(size_t(T * E)), normed(size_t(T * E)), qkv(size_t(T * 3 * E));
  std::vector<float> q(size_t(T * E)), k(size_t(T * E)), v(size_t(T * E)), o(size_t(T * E));
  std::vector<float> hidden(size_t(T * I));

  for (int64_t t = 0; t < T; ++t) {
    const float* tok = token_embedding_.f32() + int64_t(ids[size_t(t)]) * E;
    const float* pos = position_embedding_.f32() + positions[size_t(t)] * E;
    for (int64_t i = 0; i < E; ++i) x[size_t(t * E + i)] = tok[i] + pos[i];
  }

  for (int64_t l = 0; l < config_.layers; ++l) {
    const Gpt2Layer& layer = layers_[size_t(l)];
    // Attention: x += c_proj(attention(split(c_attn(ln_1(x)))))
    layer_norm_rows(x.data(), T, E, layer.ln1_weight, layer.ln1_bias, float(config_.eps),
                    normed.data());
    project(normed.data(), T, E, layer.qkv_weight, &layer.qkv_bias, false, qkv.data());
    for (int64_t t = 0; t < T; ++t) {
      const float* row = qkv.data() + t * 3 * E;
      std::memcpy(q.data() + t * E, row, size_t(E) * sizeof(float));
      std::memcpy(k.data() + t * E, row + E, size_t(E) * sizeof(float));
      std::memcpy(v.data() + t * E, row + 2 * E, size_t(E) * sizeof(float));
    }
    ops::AttentionShape shape;
    shape.B = 1;
    shape.T = T;
    shape.H = shape.HKV = H;
    shape.D = shape.DV = D;
    shape.scale = config_.attention_scale(l);
    attend(l, shape, q.data(), k.data(), v.data(), o.data());
    project(o.data(), T, E, layer.out_weight, &layer.out_bias, true, x.data());

    // MLP: x += c_proj(act(c_fc(ln_2(x))))
    layer_norm_rows(x.data(), T, E, layer.ln2_weight, layer.ln2_bias, float(config_.eps),
                    normed.data());
    project(normed.data(), T, E, layer.fc_weight, &layer.fc_bias, false, hidden.data());
    activate_rows(config_.activation, hidden.data(), T, I);
    project(hidden.data(), T, I, layer.down_weight, &layer.down_bias, true, x.data());
  }

  const int64_t first = T - out_rows, rows = out_rows;
  layer_norm_rows(x.data() + first * E, rows, E, final_norm_weight_, final_norm_bias_,
                  float(config_.eps), normed.data());
  Tensor logits(DType::f32, {rows, config_.vocab});
  const Tensor& head = config_.tied ? token_embedding_ : lm_head_;
  project(normed.data(), rows, E, head, nullptr, false, logits.f32());
  return logits;
}

Tensor Gpt2Model::run(std::span<const int32_t> ids, int64_t past, std::vector<ops::KvCache>* caches,
                      bool last_only) const {
  const int64_t T = int64_t(ids.size());
  std::vector<int64_t> positions(static_cast<size_t>(T), 0);
  for (int64_t t = 0; t < T; ++t) positions[size_t(t)] = past + t;
  const auto attend = [&](int64_t l, const ops::AttentionShape& shape, const float* q,
                          const float* k, const float* v, float* o) {
    const ops::AttentionInputs<float> in{shape, q, k, v};
    if (!caches) {
      ops::attention_flash_forward(in, o, nullptr);
    } else if (T == 1) {
      ops::attention_decode_step(shape, (*caches)[size_t(l)], q, k, v, o);
    } else {
      ops::attention_prefill(in, (*caches)[size_t(l)], o, nullptr);
    }
  };
  return stack(ids, positions, last_only ? 1 : T, attend);
}

Tensor Gpt2Model::run_batch(std::span<const int32_t> ids, std::span<const int64_t> positions,
                            std::span<std::vector<ops::KvCache>* const> caches) const {
  const int64_t N = int64_t(ids.size()), E = config_.embd;
  const auto attend = [&](int64_t l, const ops::AttentionShape& shape, const float* q,
                          const float* k, const float* v, float* o) {
    ops::AttentionShape one = shape;
    one.T = 1;
    for (int64_t n = 0; n < N; ++n) {
      ops::attention_decode_step(one, (*caches[size_t(n)])[size_t(l)], q + n * E, k + n * E,
                                 v + n * E, o + n * E);
    }
  };
  return stack(ids, positions, N, attend);
}

Gpt2Session::Gpt2Session(const Gpt2Model& model, int64_t max_context)
    : model_(model), max_context_(max_context) {
  const Gpt2Config& c = model.config();
  caches_.reserve(size_t(c.layers));
  for (int64_t l = 0; l < c.layers; ++l)
    caches_.emplace_back(1, c.heads, c.head_dim(), c.head_dim(), max_context);
}

std::unique_ptr<Session> Gpt2Session::clone() const {
  auto copy = std::make_unique<Gpt2Session>(model_, max_context_);
  for (size_t l = 0; l < caches_.size(); ++l) {
    const ops::KvCache& from = caches_[l];
    if (from.length(0) > 0)
      copy->caches_[l].append(0, from.keys(0), from.values(0), from.length(0));
  }
  copy->length_ = length_;
  return copy;
}

Tensor Gpt2Model::decode_batch(std::span<Session* const> sessions,
                               std::span<const int32_t> ids) const {
  check_decode_batch(*this, sessions, ids);
  std::vector<int64_t> positions;
  std::vector<std::vector<ops::KvCache>*> caches;
  std::vector<Gpt2Session*> own;
  for (Session* session : sessions) {
    auto* s = dynamic_cast<Gpt2Session*>(session);
    if (!s || &s->model() != this) return CausalLM::decode_batch(sessions, ids);
    own.push_back(s);
    positions.push_back(s->length());
    caches.push_back(&s->caches());
  }
  Tensor logits = run_batch(ids, positions, caches);
  for (Gpt2Session* s : own) s->advance(1);
  return logits;
}

Tensor Gpt2Session::feed(std::span<const int32_t> ids) {
  model_.check_ids(ids, length_, max_context_);
  Tensor logits = model_.run(ids, length_, &caches_, false);
  length_ += int64_t(ids.size());
  return logits;
}

Tensor Gpt2Session::feed_last(std::span<const int32_t> ids) {
  model_.check_ids(ids, length_, max_context_);
  Tensor logits = model_.run(ids, length_, &caches_, true);
  length_ += int64_t(ids.size());
  return logits;
}

MemoryReport Gpt2Session::memory() const {
  MemoryReport report;
  report.weight_bytes = model_.weight_bytes();
  for (const ops::KvCache& cache : caches_) report.cache_bytes += cache.bytes_used();
  return report;
}

}  // namespace

ArchitectureInfo describe_gpt2(const json& config) {
  return describe(Gpt2Config::from_json(config));
}

std::unique_ptr<CausalLM> load_gpt2(const ModelFolder& folder) {
  return std::make_unique<Gpt2Model>(Gpt2Config::from_json(folder.config()), folder);
}

}  // namespace kda::model
