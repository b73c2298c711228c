// GPT-2 on the GPU (model/gpt2.cpp's computation): learned positions, pre-LayerNorm blocks of
// causal attention and a gelu_new MLP, the lm_head tied to the token embedding unless the folder
// holds its own; per sequence a K and V cache per layer ([max_context, H, head_dim] of the
// model's element type).
#include <algorithm>
#include <string>

#include "core/error.h"
#include "core/token_ids.h"
#include "model/cuda/cuda_models.h"
#include "model/cuda/device_tensor.h"
#include "model/cuda/kimi_cuda_blocks.h"
#include "model/gpt2.h"
#include "model/gpt2_config.h"
#include "model/model_folder.h"
#include "ops/attention/cuda/attention_cuda.h"
#include "ops/nn/cuda/nn_cuda.h"

namespace kda::model::cuda {
namespace {

namespace k = ops::cuda;

// A checkpoint's Conv1D weight [in, out] as the [out, in] the GEMMs take.
Tensor transposed(const Tensor& w) {
  const int64_t rows = w.dim(0), cols = w.dim(1);
  Tensor out(DType::f32, {cols, rows});
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out.f32()[c * rows + r] = w.f32()[r * cols + c];
  return out;
}

struct Gpt2DeviceLayer {
  DeviceBuffer ln1_weight, ln1_bias, ln2_weight, ln2_bias;      // fp32 [E]
  DeviceBuffer qkv_weight, out_weight, fc_weight, down_weight;  // (type) [out, in]
  DeviceBuffer qkv_bias, out_bias, fc_bias, down_bias;          // fp32
};

class Gpt2Cuda;

class Gpt2CudaSession final : public Session {
 public:
  Gpt2CudaSession(const Gpt2Cuda& model, int64_t max_context);
  Tensor feed(std::span<const int32_t> ids) override { return run(ids, false); }
  Tensor feed_last(std::span<const int32_t> ids) override { return run(ids, true); }
  int64_t length() const override { return length_; }
  int64_t max_context() const override { return max_context_; }
  MemoryReport memory() const override;
  std::unique_ptr<Session> clone() const override;

 private:
  Tensor run(std::span<const int32_t> ids, bool last_only);
  const Gpt2Cuda& model_;
  int64_t length_ = 0, max_context_ = 0;
  SessionDevice device_;
  std::vector<DeviceBuffer> keys_, values_;  // per layer [max_context, E]
};

class Gpt2Cuda final : public CausalLM {
 public:
  Gpt2Cuda(const ModelFolder& folder, ElementType type);

  const ArchitectureInfo& info() const override { return info_; }
  int64_t vocab_size() const override { return c_.vocab; }
  int64_t weight_bytes() const override { return weight_bytes_; }
  Tensor forward(std::span<const int32_t> ids) const override {
    Gpt2CudaSession session(*this, std::max<int64_t>(1, int64_t(ids.size())));
    return session.feed(ids);
  }
  std::unique_ptr<Session> start_session(int64_t max_context) const override {
    require(max_context >= 0 && max_context <= c_.positions,
            "gpt2 (cuda): max_context " + std::to_string(max_context) +
                " is outside [1, n_positions = " + std::to_string(c_.positions) + "]");
    return std::make_unique<Gpt2CudaSession>(*this, max_context == 0 ? c_.positions : max_context);
  }
  const Gpt2Config& config() const { return c_; }
  ElementType type() const { return type_; }
  // Tokens at positions past.. through every layer, appending to the caches.
  Tensor run(const int32_t* ids_device, int64_t T, int64_t past, bool last_only,
             std::vector<DeviceBuffer>& keys, std::vector<DeviceBuffer>& values,
             Context& ctx) const;

 private:
  Gpt2Config c_;
  ElementType type_;
  ArchitectureInfo info_;
  DeviceBuffer wte_, wpe_, ln_f_weight_, ln_f_bias_, lm_head_;
  std::vector<Gpt2DeviceLayer> layers_;
  int64_t weight_bytes_ = 0;
};

Gpt2Cuda::Gpt2Cuda(const ModelFolder& folder, ElementType type)
    : c_(Gpt2Config::from_json(folder.config())), type_(type) {
  require(c_.activation == Gpt2Activation::gelu_tanh,
          "gpt2 (cuda): activation '" + c_.activation_name + "' has no CUDA path (gelu_new)");
  folder.check_tensors(gpt2_expected_tensors(c_, folder));
  info_ = describe_gpt2(folder.config());
  const int64_t V = c_.vocab, P = c_.positions, E = c_.embd, I = c_.inner;
  const std::string prefix = gpt2_prefix(folder);
  auto name = [&](int64_t l, const std::string& rest) {
    return prefix + "h." + std::to_string(l) + "." + rest;
  };
  auto up = [&](const Tensor& t, ElementType as) {
    DeviceBuffer b = upload(t, as);
    weight_bytes_ += int64_t(b.bytes());
    return b;
  };
  const auto f32 = ElementType::f32;
  wte_ = up(folder.load(prefix + "wte.weight", {V, E}), type);
  wpe_ = up(folder.load(prefix + "wpe.weight", {P, E}), type);
  ln_f_weight_ = up(folder.load(prefix + "ln_f.weight", {E}), f32);
  ln_f_bias_ = up(folder.load(prefix + "ln_f.bias", {E}), f32);
  if (!c_.tied) lm_head_ = up(folder.load("lm_head.weight", {V, E}), type);
  for (int64_t l = 0; l < c_.layers; ++l) {
    Gpt2DeviceLayer d;
    d.ln1_weight = up(folder.load(name(l, "ln_1.weight"), {E}), f32);
    d.ln1_bias = up(folder.load(name(l, "ln_1.bias"), {E}), f32);
    d.ln2_weight = up(folder.load(name(l, "ln_2.weight"), {E}), f32);
    d.ln2_bias = up(folder.load(name(l, "ln_2.bias"), {E}), f32);
    d.qkv_weight = up(transposed(folder.load(name(l, "attn.c_attn.weight"), {E, 3 * E})), type);
    d.qkv_bias = up(folder.load(name(l, "attn.c_attn.bias"), {3 * E}), f32);
    d.out_weight = up(transposed(folder.load(name(l, "attn.c_proj.weight"), {E, E})), type);
    d.out_bias = up(folder.load(name(l, "attn.c_proj.bias"), {E}), f32);
    d.fc_weight = up(transposed(folder.load(name(l, "mlp.c_fc.weight"), {E, I})), type);
    d.fc_bias = up(folder.load(name(l, "mlp.c_fc.bias"), {I}), f32);
    d.down_weight = up(transposed(folder.load(name(l, "mlp.c_proj.weight"), {I, E})), type);
    d.down_bias = up(folder.load(name(l, "mlp.c_proj.bias"), {E}), f32);
    layers_.push_back(std::move(d));
  }
}

Tensor Gpt2Cuda::run(const int32_t* ids_device, int64_t T, int64_t past, bool last_only,
                     std::vector<DeviceBuffer>& keys, std::vector<DeviceBuffer>& values,
                     Context& ctx) const {
  const int64_t E = c_.embd, I = c_.inner, H = c_.heads, Dh = c_.head_dim(), V = c_.vocab;
  const float eps = float(c_.eps);
  const size_t es = ctx.esize();
  const cudaStream_t stream = ctx.stream();
  auto& s = ctx.s;
  float* x = take(s.h, T * E);
  void* normed = take<char>(s.xc, T * E, es);
  float* qkv = take(s.proj, T * 3 * E);
  void* q = take<char>(s.qc, T * E, es);
  float* attn = take(s.attn, T * E);
  void* attn_c = take<char>(s.normed, T * E, es);
  float* hidden = take(s.hidden, T * I);
  void* hidden_c = take<char>(s.lowrank, T * I, es);
  k::embedding(ids_device, T, wte_.data(), wpe_.data(), past, type_, E, x, stream);
  for (int64_t l = 0; l < c_.layers; ++l) {
    const Gpt2DeviceLayer& d = layers_[size_t(l)];
    k::layer_norm(x, T, E, d.ln1_weight.as<float>(), d.ln1_bias.as<float>(), eps, {normed, type_},
                  stream);
    ctx.gemm.linear(type_, T, 3 * E, E, {normed, E}, {d.qkv_weight.data(), E},
                    {qkv, ElementType::f32});
    k::add_bias(qkv, T, 3 * E, d.qkv_bias.as<float>(), stream);
    char* key_rows = keys[size_t(l)].as<char>() + size_t(past * E) * es;
    char* value_rows = values[size_t(l)].as<char>() + size_t(past * E) * es;
    k::copy_rows(qkv, T, E, 3 * E, {q, type_, E}, stream);
    k::copy_rows(qkv + E, T, E, 3 * E, {key_rows, type_, E}, stream);
    k::copy_rows(qkv + 2 * E, T, E, 3 * E, {value_rows, type_, E}, stream);
    k::AttentionArgs a;
    a.dtype = type_;
    a.Tq = T;
    a.Tk = past + T;
    a.Hq = a.Hkv = H;
    a.Dk = a.Dv = Dh;
    a.q = q;
    a.k = keys[size_t(l)].data();
    a.v = values[size_t(l)].data();
    a.q_offset = past;
    a.scale = float(c_.attention_scale(l));
    a.o = attn;
    const size_t ws = k::attention_workspace_bytes(a);
    k::attention_forward(a, take<char>(s.workspace, int64_t(ws), 1), ws, stream);
    k::convert(attn, ElementType::f32, attn_c, type_, T * E, stream);
    // x += c_proj(o) + bias
    ctx.gemm.linear(type_, T, E, E, {attn_c, E}, {d.out_weight.data(), E}, {x, ElementType::f32},
                    1.f, 1.f);
    k::add_bias(x, T, E, d.out_bias.as<float>(), stream);
    k::layer_norm(x, T, E, d.ln2_weight.as<float>(), d.ln2_bias.as<float>(), eps, {normed, type_},
                  stream);
    ctx.gemm.linear(type_, T, I, E, {normed, E}, {d.fc_weight.data(), E},
                    {hidden, ElementType::f32});
    k::add_bias(hidden, T, I, d.fc_bias.as<float>(), stream);
    k::gelu_tanh(hidden, T, I, {hidden_c, type_}, stream);
    ctx.gemm.linear(type_, T, E, I, {hidden_c, I}, {d.down_weight.data(), I}, {x, ElementType::f32},
                    1.f, 1.f);
    k::add_bias(x, T, E, d.down_bias.as<float>(), stream);
  }
  const int64_t rows = last_only ? 1 : T;
  k::layer_norm(x + (T - rows) * E, rows, E, ln_f_weight_.as<float>(), ln_f_bias_.as<float>(), eps,
                {normed, type_}, stream);
  float* logits = take(s.logits, rows * V);
  const DeviceBuffer& head = c_.tied ? wte_ : lm_head_;
  ctx.gemm.linear(type_, rows, V, E, {normed, E}, {head.data(), E}, {logits, ElementType::f32});
  Tensor result(DType::f32, {rows, V});
  k::check_cuda(
      cudaMemcpyAsync(result.f32(), logits, size_t(rows * V) * 4, cudaMemcpyDeviceToHost, stream),
      "cudaMemcpyAsync (logits)");
  k::check_cuda(cudaStreamSynchronize(stream), "gpt2 (cuda) forward");
  return result;
}

Gpt2CudaSession::Gpt2CudaSession(const Gpt2Cuda& model, int64_t max_context)
    : model_(model), max_context_(max_context), device_(model.type()) {
  const size_t bytes = size_t(max_context * model.config().embd) * k::element_bytes(model.type());
  for (int64_t l = 0; l < model.config().layers; ++l) {
    keys_.emplace_back(bytes);
    values_.emplace_back(bytes);
  }
}

// A snapshot: a new session with the key and value rows written so far, copied on the device.
std::unique_ptr<Session> Gpt2CudaSession::clone() const {
  k::check_cuda(cudaStreamSynchronize(device_.stream()), "gpt2 (cuda): clone");
  auto copy = std::make_unique<Gpt2CudaSession>(model_, max_context_);
  const size_t bytes = size_t(length_ * model_.config().embd) * k::element_bytes(model_.type());
  for (size_t l = 0; l < keys_.size(); ++l) {
    copy_device_bytes(copy->keys_[l], keys_[l], bytes, copy->device_.stream());
    copy_device_bytes(copy->values_[l], values_[l], bytes, copy->device_.stream());
  }
  copy->length_ = length_;
  k::check_cuda(cudaStreamSynchronize(copy->device_.stream()), "gpt2 (cuda): clone");
  return copy;
}

MemoryReport Gpt2CudaSession::memory() const {
  MemoryReport r;
  r.weight_bytes = model_.weight_bytes();
  r.cache_bytes = 2 * model_.config().layers * length_ * model_.config().embd *
                  int64_t(k::element_bytes(model_.type()));
  return r;
}

Tensor Gpt2CudaSession::run(std::span<const int32_t> ids, bool last_only) {
  const int64_t T = int64_t(ids.size());
  require(T >= 1, "gpt2 (cuda): no tokens to feed");
  require(length_ + T <= max_context_,
          "gpt2 (cuda): " + std::to_string(length_) + " tokens held + " + std::to_string(T) +
              " new exceed the context of " + std::to_string(max_context_) + " tokens");
  require_token_ids(ids, model_.vocab_size(), "gpt2 (cuda)");
  int32_t* ids_device = take<int32_t>(device_.ctx().s.ids, T);
  k::check_cuda(cudaMemcpyAsync(ids_device, ids.data(), size_t(T) * 4, cudaMemcpyHostToDevice,
                                device_.stream()),
                "cudaMemcpyAsync (ids)");
  Tensor logits = model_.run(ids_device, T, length_, last_only, keys_, values_, device_.ctx());
  length_ += T;
  return logits;
}

}  // namespace

std::unique_ptr<CausalLM> load_gpt2_cuda(const ModelFolder& folder, ElementType type) {
  return std::make_unique<Gpt2Cuda>(folder, type);
}

}  // namespace kda::model::cuda
