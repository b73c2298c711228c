// Kimi Linear on the CPU: embedding, the layer stack (KDA or MLA mixer, dense MLP or MoE), the
// final norm and the untied lm_head; and per-sequence hybrid memory: a fixed-size recurrent and
// conv state per KDA layer plus a paged latent cache per MLA layer, bounded by max_context.
// A whole-sequence forward is a prefill into a throw-away session, so the two cannot drift.
#include "model/kimi_linear.h"

#include <algorithm>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/token_ids.h"
#include "model/kimi_linear_blocks.h"
#include "model/kimi_linear_config.h"
#include "ops/nn/nn.h"
#include "runtime/latent_cache.h"

namespace kda::model {
namespace kimi {

Tensor stack_rows(std::initializer_list<const Tensor*> parts) {
  int64_t rows = 0, cols = -1;
  for (const Tensor* t : parts) {
    const int64_t c = t->numel() / t->dim(0);
    require(cols < 0 || c == cols, "stack_rows: parts differ in width");
    cols = c;
    rows += t->dim(0);
  }
  Tensor out(DType::f32, {rows, cols});
  float* at = out.f32();
  for (const Tensor* t : parts) at = std::copy_n(t->f32(), t->numel(), at);
  return out;
}

int64_t tensor_bytes(const Tensor& t) {
  return t.empty() ? 0 : int64_t(t.nbytes());
}

std::string layer_prefix(int64_t i) {
  return "model.layers." + std::to_string(i) + ".";
}

TensorMap expected_tensors(const KimiLinearConfig& c, const ModelFolder& folder) {
  const int64_t D = c.hidden_size;
  TensorMap expected;
  expected["model.embed_tokens.weight"] = {c.vocab_size, D};
  expected["model.norm.weight"] = {D};
  expected["lm_head.weight"] = {c.vocab_size, D};
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = layer_prefix(i);
    expected[p + "input_layernorm.weight"] = {D};
    expected[p + "post_attention_layernorm.weight"] = {D};
    if (c.mixers[i] == KimiMixer::kda) {
      expect_kda(c, p + "self_attn.", folder, expected);
    } else {
      expect_mla(c, p + "self_attn.", expected);
    }
    expect_ffn(c, i, p, folder, expected);
  }
  return expected;
}

}  // namespace kimi

namespace {

using kimi::grow;

struct Layer {
  KimiMixer mixer;
  Tensor input_norm, post_norm;
  kimi::KdaWeights kda;
  kimi::MlaWeights mla;
  kimi::FfnWeights ffn;
};

// One sequence's hybrid memory.
struct SequenceMemory {
  std::vector<kimi::KdaState> kda;  // per layer (empty for MLA layers)
  std::shared_ptr<runtime::LatentPagePool> pool;
  std::vector<runtime::LatentCache> latent;  // one per MLA layer, in layer order
  std::vector<int64_t> latent_index;         // layer -> index into latent (-1 for KDA)
  int64_t length = 0, max_context = 0;
};

class KimiLinearModel final : public CausalLM {
 public:
  explicit KimiLinearModel(const ModelFolder& folder);

  const ArchitectureInfo& info() const override { return info_; }
  int64_t vocab_size() const override { return config_.vocab_size; }
  int64_t weight_bytes() const override { return weight_bytes_; }
  Tensor forward(std::span<const int32_t> ids) const override;
  std::unique_ptr<Session> start_session(int64_t max_context) const override;
  Tensor decode_batch(std::span<Session* const> sessions,
                      std::span<const int32_t> ids) const override;

  SequenceMemory new_memory(int64_t max_context) const;
  // Feeds ids through every layer, advancing `mem`; logits [ids.size(), vocab], or of the last
  // token only [1, vocab] (the lm_head runs on that row alone).
  Tensor run(std::span<const int32_t> ids, SequenceMemory& mem, kimi::Scratch& s,
             bool last_only = false) const;
  // One token for each of N sequences (ids[n] to mems[n], checked by the caller): every
  // projection, the MoE and the lm_head over the N rows at once; logits [N, vocab].
  Tensor run_batch(std::span<const int32_t> ids, std::span<SequenceMemory* const> mems,
                   kimi::Scratch& s) const;
  // The layer stack over the rows of ids, whose token mixing mix(layer index, layer, x, out)
  // does (the one step that reads or writes a sequence's memory); logits of the last out_rows.
  template <class Mix>
  Tensor stack(std::span<const int32_t> ids, int64_t out_rows, kimi::Scratch& s,
               const Mix& mix) const;

 private:
  KimiLinearConfig config_;
  ArchitectureInfo info_;
  Tensor embed_, final_norm_, lm_head_;
  std::vector<Layer> layers_;
  int64_t weight_bytes_ = 0;
};

class KimiLinearSession final : public Session {
 public:
  KimiLinearSession(const KimiLinearModel& model, int64_t max_context)
      : model_(model), memory_(model.new_memory(max_context)) {}

  // The fixed part (KDA states and conv windows) is copied whole; the MLA latent rows are copied
  // into pages of the copy's own pool.
  std::unique_ptr<Session> clone() const override {
    auto copy = std::make_unique<KimiLinearSession>(model_, memory_.max_context);
    copy->memory_.kda = memory_.kda;
    std::vector<float> rows;
    for (size_t i = 0; i < memory_.latent.size(); ++i) {
      const runtime::LatentCache& from = memory_.latent[i];
      rows.resize(size_t(from.length() * from.row_width()));
      from.gather(rows.data());
      copy->memory_.latent[i].append(rows.data(), from.length());
    }
    copy->memory_.length = memory_.length;
    return copy;
  }

  Tensor feed(std::span<const int32_t> ids) override { return model_.run(ids, memory_, scratch_); }
  Tensor feed_last(std::span<const int32_t> ids) override {
    return model_.run(ids, memory_, scratch_, true);
  }
  int64_t length() const override { return memory_.length; }
  int64_t max_context() const override { return memory_.max_context; }
  // for KimiLinearModel::decode_batch
  const KimiLinearModel& model() const { return model_; }
  SequenceMemory& sequence_memory() { return memory_; }
  kimi::Scratch& scratch() { return scratch_; }
  MemoryReport memory() const override {
    MemoryReport r;
    r.weight_bytes = model_.weight_bytes();
    for (const kimi::KdaState& s : memory_.kda) {
      r.state_bytes += int64_t((s.recurrent.size() + s.conv.size()) * sizeof(float));
    }
    for (const runtime::LatentCache& c : memory_.latent) r.cache_bytes += c.bytes_used();
    return r;
  }

 private:
  const KimiLinearModel& model_;
  SequenceMemory memory_;
  kimi::Scratch scratch_;
};

using kimi::layer_prefix;

KimiLinearModel::KimiLinearModel(const ModelFolder& folder)
    : config_(KimiLinearConfig::parse(folder.config())),
      info_(describe_kimi_linear(folder.config())) {
  const KimiLinearConfig& c = config_;
  const int64_t D = c.hidden_size;
  // Every name and shape first: a bad checkpoint fails before anything is loaded.
  const kimi::TensorMap expected = kimi::expected_tensors(c, folder);
  folder.check_tensors(expected);

  embed_ = folder.load("model.embed_tokens.weight", {c.vocab_size, D});
  final_norm_ = folder.load("model.norm.weight", {D});
  lm_head_ = folder.load("lm_head.weight", {c.vocab_size, D});
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = layer_prefix(i);
    Layer layer;
    layer.mixer = c.mixers[i];
    layer.input_norm = folder.load(p + "input_layernorm.weight", {D});
    layer.post_norm = folder.load(p + "post_attention_layernorm.weight", {D});
    if (layer.mixer == KimiMixer::kda) {
      layer.kda = kimi::load_kda(c, p + "self_attn.", folder);
    } else {
      layer.mla = kimi::load_mla(c, p + "self_attn.", folder);
    }
    layer.ffn = kimi::load_ffn(c, i, p, folder);
    layers_.push_back(std::move(layer));
  }

  using kimi::tensor_bytes;
  weight_bytes_ = tensor_bytes(embed_) + tensor_bytes(final_norm_) + tensor_bytes(lm_head_);
  for (const Layer& l : layers_) {
    for (const Tensor* t : {&l.input_norm,        &l.post_norm,   &l.kda.in_proj,
                            &l.kda.conv,          &l.kda.f_b,     &l.kda.g_b,
                            &l.kda.A_log,         &l.kda.dt_bias, &l.kda.o_norm,
                            &l.kda.o_proj,        &l.mla.q_proj,  &l.mla.q_a_proj,
                            &l.mla.q_a_layernorm, &l.mla.kv_a,    &l.mla.kv_a_layernorm,
                            &l.mla.kv_b,          &l.mla.o_proj,  &l.ffn.gate_up,
                            &l.ffn.down,          &l.ffn.router,  &l.ffn.correction_bias}) {
      weight_bytes_ += tensor_bytes(*t);
    }
    for (const Tensor& t : l.ffn.expert_gate_up) weight_bytes_ += tensor_bytes(t);
    for (const Tensor& t : l.ffn.expert_down) weight_bytes_ += tensor_bytes(t);
  }
}

SequenceMemory KimiLinearModel::new_memory(int64_t max_context) const {
  require(max_context >= 0, "kimi_linear: max_context must be non-negative");
  SequenceMemory m;
  m.max_context = max_context == 0 ? config_.max_context : max_context;
  const int64_t mla_layers = config_.count(KimiMixer::mla);
  const int64_t page = runtime::kDefaultPageTokens;
  if (mla_layers > 0) {
    m.pool = std::make_shared<runtime::LatentPagePool>(
        config_.mla_row_width(), page, mla_layers * ((m.max_context + page - 1) / page));
  }
  m.kda.resize(layers_.size());
  m.latent_index.assign(layers_.size(), -1);
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (layers_[i].mixer == KimiMixer::kda) {
      m.kda[i] = kimi::new_kda_state(config_);
    } else {
      m.latent_index[i] = int64_t(m.latent.size());
      m.latent.emplace_back(m.pool, m.max_context);
    }
  }
  return m;
}

template <class Mix>
Tensor KimiLinearModel::stack(std::span<const int32_t> ids, int64_t out_rows, kimi::Scratch& s,
                              const Mix& mix) const {
  const int64_t T = int64_t(ids.size()), D = config_.hidden_size, V = config_.vocab_size;
  float* h = grow(s.h, T * D);
  float* x = grow(s.x, T * D);
  float* out = grow(s.out, T * D);
  for (int64_t t = 0; t < T; ++t) std::copy_n(embed_.f32() + int64_t(ids[t]) * D, D, h + t * D);
  const float eps = float(config_.rms_norm_eps);
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& l = layers_[i];
    ops::rms_norm(h, T, D, l.input_norm.f32(), eps, x);
    mix(i, l, x, out);
    for (int64_t j = 0; j < T * D; ++j) h[j] += out[j];
    ops::rms_norm(h, T, D, l.post_norm.f32(), eps, x);
    kimi::ffn_forward(config_, l.ffn, x, T, out, s);
    for (int64_t j = 0; j < T * D; ++j) h[j] += out[j];
  }
  const float* last = h + (T - out_rows) * D;
  ops::rms_norm(last, out_rows, D, final_norm_.f32(), eps, x);
  Tensor logits(DType::f32, {out_rows, V});
  ops::linear(x, out_rows, D, lm_head_.f32(), V, nullptr, logits.f32());
  return logits;
}

Tensor KimiLinearModel::run(std::span<const int32_t> ids, SequenceMemory& mem, kimi::Scratch& s,
                            bool last_only) const {
  const int64_t T = int64_t(ids.size());
  require(T >= 1, "kimi_linear: no tokens to feed");
  require(mem.length + T <= mem.max_context, "kimi_linear: feeding " + std::to_string(T) +
                                                 " tokens after " + std::to_string(mem.length) +
                                                 " would pass the context limit of " +
                                                 std::to_string(mem.max_context));
  require_token_ids(ids, config_.vocab_size, "kimi_linear");
  for (const runtime::LatentCache& c : mem.latent) c.check_room(T);
  const auto mix = [&](size_t i, const Layer& l, const float* x, float* out) {
    if (l.mixer == KimiMixer::kda) {
      kimi::kda_forward(config_, l.kda, x, T, mem.kda[i], out, s);
    } else {
      kimi::mla_forward(config_, l.mla, x, T, mem.latent[mem.latent_index[i]], out, s);
    }
  };
  Tensor logits = stack(ids, last_only ? 1 : T, s, mix);
  mem.length += T;
  return logits;
}

Tensor KimiLinearModel::run_batch(std::span<const int32_t> ids,
                                  std::span<SequenceMemory* const> mems, kimi::Scratch& s) const {
  const int64_t N = int64_t(ids.size());
  for (const SequenceMemory* mem : mems)
    for (const runtime::LatentCache& c : mem->latent) c.check_room(1);
  std::vector<kimi::KdaState*> states(size_t(N), nullptr);
  std::vector<runtime::LatentCache*> caches(size_t(N), nullptr);
  const auto mix = [&](size_t i, const Layer& l, const float* x, float* out) {
    if (l.mixer == KimiMixer::kda) {
      for (int64_t n = 0; n < N; ++n) states[size_t(n)] = &mems[size_t(n)]->kda[i];
      kimi::kda_decode_batch(config_, l.kda, x, N, states, out, s);
    } else {
      for (int64_t n = 0; n < N; ++n) {
        SequenceMemory& mem = *mems[size_t(n)];
        caches[size_t(n)] = &mem.latent[size_t(mem.latent_index[i])];
      }
      kimi::mla_decode_batch(config_, l.mla, x, N, caches, out, s);
    }
  };
  Tensor logits = stack(ids, N, s, mix);
  for (SequenceMemory* mem : mems) mem->length += 1;
  return logits;
}

Tensor KimiLinearModel::decode_batch(std::span<Session* const> sessions,
                                     std::span<const int32_t> ids) const {
  check_decode_batch(*this, sessions, ids);
  std::vector<SequenceMemory*> mems;
  for (Session* session : sessions) {
    auto* own = dynamic_cast<KimiLinearSession*>(session);
    if (!own || &own->model() != this) return CausalLM::decode_batch(sessions, ids);
    mems.push_back(&own->sequence_memory());
  }
  return run_batch(ids, mems, static_cast<KimiLinearSession*>(sessions[0])->scratch());
}

Tensor KimiLinearModel::forward(std::span<const int32_t> ids) const {
  SequenceMemory mem = new_memory(std::max<int64_t>(1, int64_t(ids.size())));
  kimi::Scratch scratch;
  return run(ids, mem, scratch);
}

std::unique_ptr<Session> KimiLinearModel::start_session(int64_t max_context) const {
  return std::make_unique<KimiLinearSession>(*this, max_context);
}

}  // namespace

std::unique_ptr<CausalLM> load_kimi_linear(const ModelFolder& folder) {
  return std::make_unique<KimiLinearModel>(folder);
}

}  // namespace kda::model
