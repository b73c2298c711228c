#include "model/cuda/gpt2_cuda_train.h"
#include "model/gpt2.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/random.h"
#include "core/token_ids.h"
#include "model/cuda/gpt2_train_kernels.h"
#include "model/model_folder.h"
#include "ops/attention/cuda/attention_cuda.h"
#include "ops/gemm/cuda/gemm_cuda.h"
#include "ops/nn/cuda/nn_cuda.h"
#include "ops/nn/cuda/train_cuda.h"

namespace kda::model::cuda {

namespace k = ops::cuda;
using k::DeviceBuffer;
using k::ElementType;

namespace {

constexpr ElementType kF32 = ElementType::f32;

DeviceBuffer zeros(size_t bytes, cudaStream_t stream) {
  DeviceBuffer b(bytes);
  if (bytes) k::check_cuda(cudaMemsetAsync(b.data(), 0, bytes, stream), "cudaMemsetAsync");
  return b;
}

template <class T = char>
T* at(const DeviceBuffer& b, int64_t elements, size_t element_bytes) {
  return reinterpret_cast<T*>(b.as<char>() + size_t(elements) * element_bytes);
}

}  // namespace

// A parameter: fp32 value, gradient and AdamW moments on the device in the GEMM layout
// ([out, in] for Conv1D weights, whose checkpoint layout is [in, out]), and for matrices the
// GEMMs read in bf16, a bf16 compute copy.
struct Gpt2CudaTrainer::Param {
  std::string name;
  int64_t rows = 1, cols = 1;  // device layout
  bool conv1d = false;         // the checkpoint holds [cols, rows]
  bool decay = false;          // matrices and embeddings (train/hf_gpt2.cpp's rule)
  DeviceBuffer value, grad, m, v, copy;
  int64_t numel() const { return rows * cols; }
  const void* compute() const { return copy.data() ? copy.data() : value.data(); }
  float* f() const { return value.as<float>(); }
  float* g() const { return grad.as<float>(); }
};

struct Gpt2CudaTrainer::Layer {
  Param *ln1_w, *ln1_b, *qkv_w, *qkv_b, *out_w, *out_b;
  Param *ln2_w, *ln2_b, *fc_w, *fc_b, *down_w, *down_b;
};

struct Gpt2CudaTrainer::Engines {
  explicit Engines(cudaStream_t stream) : gemm(stream), wgrad(stream) {}
  k::Gemm gemm;
  WeightGradGemm wgrad;
  k::TrainScratch scratch;
};

// What the forward keeps for the backward, and the backward's scratch, for B rows of T tokens.
struct Gpt2CudaTrainer::Activations {
  int64_t B = 0, T = 0;
  std::vector<DeviceBuffer> h;  // residual stream fp32 [R, E]: h[2l] enters layer l's attention,
                                // h[2l + 1] its MLP, h[2L] the final norm
  struct PerLayer {
    DeviceBuffer ln1c, qkvc, o32, oc, lse, ln2c, pre32, actc;
  };
  std::vector<PerLayer> layers;
  DeviceBuffer lnfc, logits, qkv32, dy_c, dbig32, dln32, dh, do_c, dq, dk, dv, ones, ids, targets,
      workspace, loss;
  size_t workspace_bytes = 0;
};

Gpt2CudaTrainer::Param* Gpt2CudaTrainer::add(const std::string& name, int64_t rows, int64_t cols,
                                             bool conv1d, bool compute_copy) {
  auto p = std::make_unique<Param>();
  p->name = name;
  p->rows = rows;
  p->cols = cols;
  p->conv1d = conv1d;
  p->decay = rows > 1;  // every matrix (embeddings too), no vectors (stored as one row)
  const size_t bytes = size_t(rows * cols) * 4;
  p->value = zeros(bytes, stream_);
  p->grad = zeros(bytes, stream_);
  p->m = zeros(bytes, stream_);
  p->v = zeros(bytes, stream_);
  if (compute_copy && type_ == ElementType::bf16) p->copy = zeros(size_t(rows * cols) * 2, stream_);
  by_name_[name] = p.get();
  params_.push_back(std::move(p));
  return params_.back().get();
}

void Gpt2CudaTrainer::init(const nlohmann::json& config) {
  c_ = Gpt2Config::from_json(config);
  require(c_.tied, "gpt2 (cuda training): only the tied head (tie_word_embeddings) is supported");
  require(
      c_.activation == Gpt2Activation::gelu_tanh,
      "gpt2 (cuda training): activation '" + c_.activation_name + "' has no CUDA path (gelu_new)");
  k::check_cuda(cudaStreamCreate(&stream_), "cudaStreamCreate");
  engines_ = std::make_unique<Engines>(stream_);
  const int64_t V = c_.vocab, P = c_.positions, E = c_.embd, I = c_.inner;
  wte_ = add(prefix_ + "wte.weight", V, E, false, true);  // also the head's weight
  wpe_ = add(prefix_ + "wpe.weight", P, E, false, false);
  for (int64_t l = 0; l < c_.layers; ++l) {
    const std::string pre = prefix_ + "h." + std::to_string(l) + ".";
    Layer L;
    L.ln1_w = add(pre + "ln_1.weight", 1, E, false, false);
    L.ln1_b = add(pre + "ln_1.bias", 1, E, false, false);
    L.qkv_w = add(pre + "attn.c_attn.weight", 3 * E, E, true, true);
    L.qkv_b = add(pre + "attn.c_attn.bias", 1, 3 * E, false, false);
    L.out_w = add(pre + "attn.c_proj.weight", E, E, true, true);
    L.out_b = add(pre + "attn.c_proj.bias", 1, E, false, false);
    L.ln2_w = add(pre + "ln_2.weight", 1, E, false, false);
    L.ln2_b = add(pre + "ln_2.bias", 1, E, false, false);
    L.fc_w = add(pre + "mlp.c_fc.weight", I, E, true, true);
    L.fc_b = add(pre + "mlp.c_fc.bias", 1, I, false, false);
    L.down_w = add(pre + "mlp.c_proj.weight", E, I, true, true);
    L.down_b = add(pre + "mlp.c_proj.bias", 1, E, false, false);
    layers_.push_back(L);
  }
  ln_f_w_ = add(prefix_ + "ln_f.weight", 1, E, false, false);
  ln_f_b_ = add(prefix_ + "ln_f.bias", 1, E, false, false);
}

namespace {

// Host values in the checkpoint's layout -> the parameter's device value (and compute copy).
template <class P>
void set_value_of(P& p, const float* host, ElementType type, cudaStream_t stream) {
  std::vector<float> device_layout(host, host + p.numel());
  if (p.conv1d) {  // checkpoint [cols (in), rows (out)] -> [rows, cols]
    for (int64_t i = 0; i < p.cols; ++i)
      for (int64_t o = 0; o < p.rows; ++o) device_layout[o * p.cols + i] = host[i * p.rows + o];
  }
  k::check_cuda(cudaStreamSynchronize(stream), "gpt2 (cuda training) upload");
  p.value.upload(device_layout.data(), device_layout.size() * 4);
  if (p.copy.data()) k::convert(p.value.data(), kF32, p.copy.data(), type, p.numel(), stream);
}

// The checkpoint's shape of a parameter.
template <class P>
Shape checkpoint_shape(const P& p) {
  if (p.conv1d) return {p.cols, p.rows};
  if (p.rows == 1) return {p.cols};
  return {p.rows, p.cols};
}

}  // namespace

Gpt2CudaTrainer::Gpt2CudaTrainer(const std::string& folder_path, ElementType type) : type_(type) {
  const ModelFolder folder = ModelFolder::open(folder_path);
  prefix_ = gpt2_prefix(folder);
  init(folder.config());
  folder.check_tensors(gpt2_expected_tensors(c_, folder));
  for (auto& p : params_) {
    const Tensor t = folder.load(p->name, checkpoint_shape(*p));
    set_value_of(*p, t.f32(), type_, stream_);
  }
  k::check_cuda(cudaStreamSynchronize(stream_), "gpt2 (cuda training) load");
}

Gpt2CudaTrainer::Gpt2CudaTrainer(const nlohmann::json& config, ElementType type,
                                 const std::string& prefix)
    : type_(type), prefix_(prefix) {
  init(config);
  k::check_cuda(cudaStreamSynchronize(stream_), "gpt2 (cuda training) init");
}

Gpt2CudaTrainer::Gpt2CudaTrainer(const nlohmann::json& config, ElementType type, uint64_t seed)
    : type_(type), prefix_("transformer.") {
  init(config);
  Random rng(seed);
  const float sd = float(c_.initializer_range);
  const float proj_sd = float(c_.initializer_range / std::sqrt(2.0 * double(c_.layers)));
  const auto ends_with = [](const std::string& s, const std::string& tail) {
    return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
  };
  for (auto& p : params_) {
    std::vector<float> w(size_t(p->numel()));
    if (p->rows > 1) {
      rng.fill_normal(w, ends_with(p->name, "c_proj.weight") ? proj_sd : sd);
    } else if (ends_with(p->name, "ln_1.weight") || ends_with(p->name, "ln_2.weight") ||
               ends_with(p->name, "ln_f.weight")) {
      std::fill(w.begin(), w.end(), 1.0f);
    }
    set_value_of(*p, w.data(), type_, stream_);
  }
  k::check_cuda(cudaStreamSynchronize(stream_), "gpt2 (cuda training) init");
}

Gpt2CudaTrainer::~Gpt2CudaTrainer() {
  if (stream_) cudaStreamSynchronize(stream_);
  acts_.reset();
  params_.clear();
  engines_.reset();
  if (stream_) cudaStreamDestroy(stream_);
}

int64_t Gpt2CudaTrainer::parameter_count() const {
  int64_t n = 0;
  for (const auto& p : params_) n += p->numel();
  return n;
}

std::vector<std::string> Gpt2CudaTrainer::parameter_names() const {
  std::vector<std::string> names;
  for (const auto& p : params_) names.push_back(p->name);
  return names;
}

void Gpt2CudaTrainer::ensure_activations(int64_t B, int64_t T) {
  if (acts_ && acts_->B == B && acts_->T == T) return;
  acts_.reset();  // free the old sizes first
  auto a = std::make_unique<Activations>();
  a->B = B;
  a->T = T;
  const int64_t R = B * T, E = c_.embd, I = c_.inner, V = c_.vocab, H = c_.heads, L = c_.layers;
  const size_t es = k::element_bytes(type_);
  const auto f32 = [](int64_t n) { return DeviceBuffer(size_t(n) * 4); };
  const auto ct = [&](int64_t n) { return DeviceBuffer(size_t(n) * es); };
  for (int64_t i = 0; i <= 2 * L; ++i) a->h.push_back(f32(R * E));
  for (int64_t l = 0; l < L; ++l) {
    Activations::PerLayer p;
    p.ln1c = ct(R * E);
    p.qkvc = ct(R * 3 * E);
    p.o32 = f32(R * E);
    p.oc = ct(R * E);
    p.lse = f32(R * H);
    p.ln2c = ct(R * E);
    p.pre32 = f32(R * I);
    p.actc = ct(R * I);
    a->layers.push_back(std::move(p));
  }
  a->lnfc = ct(R * E);
  a->logits = f32(R * V);
  a->qkv32 = f32(R * 3 * E);
  if (type_ == ElementType::bf16) a->dy_c = ct(R * std::max({V, I, 3 * E}));
  a->dbig32 = f32(R * std::max(I, 3 * E));
  a->dln32 = f32(R * E);
  a->dh = f32(R * E);
  a->do_c = ct(R * E);
  a->dq = ct(R * E);
  a->dk = ct(R * E);
  a->dv = ct(R * E);
  const std::vector<float> ones(size_t(R), 1.0f);
  a->ones = f32(R);
  a->ones.upload(ones.data(), ones.size() * 4);
  a->ids = DeviceBuffer(size_t(R) * 4);
  a->targets = DeviceBuffer(size_t(R) * 4);
  a->loss = DeviceBuffer(16);
  // the batch's attention (one launch per layer): forward (direct path, with lse) and backward
  // workspaces
  k::AttentionArgs args;
  args.dtype = type_;
  args.Tq = args.Tk = T;
  args.Hq = args.Hkv = H;
  args.Dk = args.Dv = c_.head_dim();
  args.q_row_stride = args.k_row_stride = args.v_row_stride = 3 * E;
  args.batch = B;
  args.q_batch_stride = args.k_batch_stride = args.v_batch_stride = T * 3 * E;
  args.lse = a->layers[0].lse.as<float>();
  a->workspace_bytes =
      std::max(k::attention_workspace_bytes(args), k::attention_backward_workspace_bytes(args));
  a->workspace = DeviceBuffer(std::max<size_t>(a->workspace_bytes, 256));
  acts_ = std::move(a);
}

void Gpt2CudaTrainer::linear_backward(int64_t rows, int64_t in, int64_t out, const float* dy,
                                      const void* x_c, const Param& W, const Param* b, void* dx,
                                      ElementType dx_type) {
  k::Gemm& gemm = engines_->gemm;
  require(W.rows == out && W.cols == in,
          "gpt2 (cuda training): " + W.name + " has the wrong shape");
  // db[out] += ones[rows] . dy[rows, out] (fp32)
  if (b)
    gemm.matmul(kF32, 1, out, rows, {acts_->ones.data(), rows}, {dy, out}, {b->g(), kF32}, 1.f,
                1.f);
  const void* dy_c = dy;
  if (type_ != kF32) {
    k::convert(dy, kF32, acts_->dy_c.data(), type_, rows * out, stream_);
    dy_c = acts_->dy_c.data();
  }
  // dW[out, in] += dy^T x
  engines_->wgrad.weight_gradient(type_, rows, out, in, dy_c, out, x_c, in, W.g(), 1.f);
  // dx[rows, in] = dy[rows, out] . W[out, in]
  if (dx) gemm.matmul(type_, rows, in, out, {dy_c, out}, {W.compute(), in}, {dx, dx_type});
}

double Gpt2CudaTrainer::step(const int32_t* ids, const int32_t* targets, int64_t B, int64_t T) {
  return run(ids, targets, B, T, {}, true, false).loss;
}

// Layer l's attention over B rows of T tokens in one launch (q, k, v: column slices of the qkv
// rows, sequence b T * 3E elements on; o and lse dense).
ops::cuda::AttentionArgs Gpt2CudaTrainer::attention_args(int64_t l, int64_t B, int64_t T) const {
  const int64_t E = c_.embd;
  const size_t es = k::element_bytes(type_);
  Activations::PerLayer& P = acts_->layers[size_t(l)];
  k::AttentionArgs args;
  args.dtype = type_;
  args.Tq = args.Tk = T;
  args.Hq = args.Hkv = c_.heads;
  args.Dk = args.Dv = c_.head_dim();
  const char* base = static_cast<const char*>(P.qkvc.data());
  args.q = base;
  args.k = base + size_t(E) * es;
  args.v = base + size_t(2 * E) * es;
  args.q_row_stride = args.k_row_stride = args.v_row_stride = 3 * E;
  args.batch = B;
  args.q_batch_stride = args.k_batch_stride = args.v_batch_stride = T * 3 * E;
  args.q_offset = 0;
  args.scale = float(c_.attention_scale(l));
  args.o = P.o32.as<float>();
  args.lse = P.lse.as<float>();
  return args;
}

// Layer l's attention over packed document d alone (rows docs[d] .. docs[d + 1]).
ops::cuda::AttentionArgs Gpt2CudaTrainer::document_args(int64_t l, const std::vector<int64_t>& docs,
                                                        size_t d) const {
  const int64_t E = c_.embd, r0 = docs[d], len = docs[d + 1] - docs[d];
  const size_t es = k::element_bytes(type_);
  k::AttentionArgs args = attention_args(l, 1, len);
  args.q_batch_stride = args.k_batch_stride = args.v_batch_stride = 0;
  args.q = static_cast<const char*>(args.q) + size_t(r0 * 3 * E) * es;
  args.k = static_cast<const char*>(args.k) + size_t(r0 * 3 * E) * es;
  args.v = static_cast<const char*>(args.v) + size_t(r0 * 3 * E) * es;
  args.o += r0 * E;
  args.lse += r0 * c_.heads;
  return args;
}

Gpt2StepResult Gpt2CudaTrainer::run(const int32_t* ids, const int32_t* targets, int64_t B,
                                    int64_t T, std::span<const int64_t> cu_seqlens, bool backward,
                                    bool accumulate) {
  const int64_t E = c_.embd, I = c_.inner, V = c_.vocab, L = c_.layers, R = B * T;
  require(B >= 1 && T >= 1, "gpt2 (cuda training): B and T must be >= 1");
  // the documents: rows of T tokens, or the packed boundaries (positions restart at each)
  std::vector<int64_t> docs;
  if (cu_seqlens.empty()) {
    for (int64_t b = 0; b <= B; ++b) docs.push_back(b * T);
  } else {
    require(cu_seqlens.size() >= 2 && cu_seqlens.front() == 0 && cu_seqlens.back() == R,
            "gpt2 (cuda training): cu_seqlens must start at 0 and end at B * T");
    for (size_t i = 1; i < cu_seqlens.size(); ++i)
      require(cu_seqlens[i] > cu_seqlens[i - 1],
              "gpt2 (cuda training): cu_seqlens must increase strictly");
    docs.assign(cu_seqlens.begin(), cu_seqlens.end());
  }
  for (size_t d = 0; d + 1 < docs.size(); ++d)
    require(docs[d + 1] - docs[d] <= c_.positions,
            "gpt2 (cuda training): a sequence of " + std::to_string(docs[d + 1] - docs[d]) +
                " tokens is past n_positions = " + std::to_string(c_.positions));
  require_token_ids({ids, size_t(R)}, V, "gpt2 (cuda training)");
  require_targets({targets, size_t(R)}, V, "gpt2 (cuda training)");
  ensure_activations(B, T);
  Activations& a = *acts_;
  k::Gemm& gemm = engines_->gemm;
  k::TrainScratch& scratch = engines_->scratch;
  const cudaStream_t s = stream_;
  const float eps = float(c_.eps);
  k::check_cuda(cudaMemcpyAsync(a.ids.data(), ids, size_t(R) * 4, cudaMemcpyHostToDevice, s),
                "cudaMemcpyAsync (ids)");
  k::check_cuda(
      cudaMemcpyAsync(a.targets.data(), targets, size_t(R) * 4, cudaMemcpyHostToDevice, s),
      "cudaMemcpyAsync (targets)");
  if (!accumulate) zero_gradients();

  const bool packed = !cu_seqlens.empty();

  // ---- forward ----
  for (size_t d = 0; d + 1 < docs.size(); ++d)  // positions restart at every document
    k::embedding(at<int32_t>(a.ids, docs[d], 4), docs[d + 1] - docs[d], wte_->value.data(),
                 wpe_->value.data(), 0, kF32, E, at<float>(a.h[0], docs[d] * E, 4), s);
  for (int64_t l = 0; l < L; ++l) {
    const Layer& W = layers_[size_t(l)];
    Activations::PerLayer& P = a.layers[size_t(l)];
    float* x_in = a.h[size_t(2 * l)].as<float>();
    float* x_mid = a.h[size_t(2 * l + 1)].as<float>();
    float* x_out = a.h[size_t(2 * l + 2)].as<float>();
    // attention: x_mid = x_in + c_proj(attention(c_attn(ln_1(x_in))))
    k::layer_norm(x_in, R, E, W.ln1_w->f(), W.ln1_b->f(), eps, {P.ln1c.data(), type_}, s);
    gemm.linear(type_, R, 3 * E, E, {P.ln1c.data(), E}, {W.qkv_w->compute(), E},
                {a.qkv32.data(), kF32});
    k::add_bias(a.qkv32.as<float>(), R, 3 * E, W.qkv_b->f(), s);
    k::convert(a.qkv32.data(), kF32, P.qkvc.data(), type_, R * 3 * E, s);
    if (packed) {
      for (size_t d = 0; d + 1 < docs.size(); ++d)
        k::attention_forward(document_args(l, docs, d), a.workspace.data(), a.workspace_bytes, s);
    } else {
      k::attention_forward(attention_args(l, B, T), a.workspace.data(), a.workspace_bytes, s);
    }
    k::convert(P.o32.data(), kF32, P.oc.data(), type_, R * E, s);
    // x_mid = x_in + o out_w^T in one pass (x_in stays: the norm backward reads it)
    gemm.linear_add(type_, R, E, E, {P.oc.data(), E}, {W.out_w->compute(), E}, {x_in},
                    {x_mid, kF32});
    k::add_bias(x_mid, R, E, W.out_b->f(), s);
    // MLP: x_out = x_mid + c_proj(gelu(c_fc(ln_2(x_mid))))
    k::layer_norm(x_mid, R, E, W.ln2_w->f(), W.ln2_b->f(), eps, {P.ln2c.data(), type_}, s);
    gemm.linear(type_, R, I, E, {P.ln2c.data(), E}, {W.fc_w->compute(), E}, {P.pre32.data(), kF32});
    k::add_bias(P.pre32.as<float>(), R, I, W.fc_b->f(), s);
    k::gelu_tanh(P.pre32.as<float>(), R, I, {P.actc.data(), type_}, s);
    gemm.linear_add(type_, R, E, I, {P.actc.data(), I}, {W.down_w->compute(), I}, {x_mid},
                    {x_out, kF32});
    k::add_bias(x_out, R, E, W.down_b->f(), s);
  }
  const float* x_final = a.h[size_t(2 * L)].as<float>();
  k::layer_norm(x_final, R, E, ln_f_w_->f(), ln_f_b_->f(), eps, {a.lnfc.data(), type_}, s);
  float* logits = a.logits.as<float>();
  gemm.linear(type_, R, V, E, {a.lnfc.data(), E}, {wte_->compute(), E}, {logits, kF32});
  float* loss_sum = a.loss.as<float>();
  int32_t* correct = at<int32_t>(a.loss, 1, 4);
  int32_t* scored = at<int32_t>(a.loss, 2, 4);
  // dlogits (mean over scored rows) overwrite the logits
  k::cross_entropy_forward_backward(logits, kF32, a.targets.as<int32_t>(), R, V, logits, kF32,
                                    loss_sum, correct, scored, scratch, s);
  if (backward) backward_pass(docs, packed ? nullptr : &B, T);
  // read back after the backward is queued (a pageable copy would block the host until then)
  struct {
    float loss_sum;
    int32_t correct, scored;
  } result{};
  k::check_cuda(cudaMemcpyAsync(&result, a.loss.data(), 12, cudaMemcpyDeviceToHost, s),
                "cudaMemcpyAsync (loss)");
  k::check_cuda(cudaStreamSynchronize(s), "gpt2 (cuda training) step");
  Gpt2StepResult out;
  out.scored = result.scored;
  out.correct = result.correct;
  out.loss = result.scored > 0 ? double(result.loss_sum) / double(result.scored) : NAN;
  return out;
}

void Gpt2CudaTrainer::backward_pass(const std::vector<int64_t>& docs, const int64_t* rows_B,
                                    int64_t T) {
  const int64_t E = c_.embd, I = c_.inner, V = c_.vocab, L = c_.layers, R = docs.back();
  Activations& a = *acts_;
  k::TrainScratch& scratch = engines_->scratch;
  const cudaStream_t s = stream_;
  const size_t es = k::element_bytes(type_);
  const float eps = float(c_.eps);
  const float* x_final = a.h[size_t(2 * L)].as<float>();
  float* logits = a.logits.as<float>();
  // ---- backward ----
  float* dh = a.dh.as<float>();
  float* dln = a.dln32.as<float>();
  float* dbig = a.dbig32.as<float>();
  // head (tied): dln = dlogits . wte; dwte += dlogits^T ln_f(x)
  linear_backward(R, E, V, logits, a.lnfc.data(), *wte_, nullptr, dln, kF32);
  k::layer_norm_backward(x_final, dln, R, E, ln_f_w_->f(), eps, dh, ln_f_w_->g(), ln_f_b_->g(),
                         false, scratch, s);
  for (int64_t l = L - 1; l >= 0; --l) {
    const Layer& W = layers_[size_t(l)];
    Activations::PerLayer& P = a.layers[size_t(l)];
    const float* x_in = a.h[size_t(2 * l)].as<float>();
    const float* x_mid = a.h[size_t(2 * l + 1)].as<float>();
    // MLP (dh: the gradient of x_out)
    linear_backward(R, I, E, dh, P.actc.data(), *W.down_w, W.down_b, dbig, kF32);
    k::gelu_tanh_backward(P.pre32.as<float>(), dbig, R * I, dbig, s);
    linear_backward(R, E, I, dbig, P.ln2c.data(), *W.fc_w, W.fc_b, dln, kF32);
    k::layer_norm_backward(x_mid, dln, R, E, W.ln2_w->f(), eps, dh, W.ln2_w->g(), W.ln2_b->g(),
                           true, scratch, s);
    // attention (dh: the gradient of x_mid); d_o in the attention's type
    linear_backward(R, E, E, dh, P.oc.data(), *W.out_w, W.out_b, a.do_c.data(), type_);
    if (rows_B) {  // one launch for the B rows
      const k::AttentionArgs args = attention_args(l, *rows_B, T);
      k::attention_backward(args, args.lse, a.do_c.data(), a.dq.data(), a.dk.data(), a.dv.data(),
                            a.workspace.data(), a.workspace_bytes, s);
    } else {  // one per packed document
      for (size_t d = 0; d + 1 < docs.size(); ++d) {
        const k::AttentionArgs args = document_args(l, docs, d);
        const size_t off = size_t(docs[d] * E) * es;
        k::attention_backward(args, args.lse, at(a.do_c, 0, 1) + off, at(a.dq, 0, 1) + off,
                              at(a.dk, 0, 1) + off, at(a.dv, 0, 1) + off, a.workspace.data(),
                              a.workspace_bytes, s);
      }
    }
    pack_qkv_gradient(a.dq.data(), a.dk.data(), a.dv.data(), type_, R, E, dbig, s);
    linear_backward(R, E, 3 * E, dbig, P.ln1c.data(), *W.qkv_w, W.qkv_b, dln, kF32);
    k::layer_norm_backward(x_in, dln, R, E, W.ln1_w->f(), eps, dh, W.ln1_w->g(), W.ln1_b->g(), true,
                           scratch, s);
  }
  // embeddings (dh: the gradient of the embedding sum); wte already holds the head's gradient
  k::embedding_backward(a.ids.as<int32_t>(), dh, R, E, V, wte_->g(), scratch, s);
  if (rows_B) {
    position_embedding_backward(dh, *rows_B, T, E, wpe_->g(), s);
  } else {
    for (size_t d = 0; d + 1 < docs.size(); ++d)
      position_embedding_backward(dh + docs[d] * E, 1, docs[d + 1] - docs[d], E, wpe_->g(), s);
  }
}

void Gpt2CudaTrainer::zero_gradients() {
  for (auto& p : params_)
    k::check_cuda(cudaMemsetAsync(p->grad.data(), 0, p->grad.bytes(), stream_), "cudaMemsetAsync");
}

void Gpt2CudaTrainer::reset_adam() {
  for (auto& p : params_)
    for (DeviceBuffer* b : {&p->m, &p->v})
      k::check_cuda(cudaMemsetAsync(b->data(), 0, b->bytes(), stream_), "cudaMemsetAsync");
  adam_steps_ = 0;
}

void Gpt2CudaTrainer::scale_gradients(float s) {
  for (auto& p : params_) k::scale(p->g(), p->numel(), s, stream_);
}

Gpt2CudaTrainer::Param& Gpt2CudaTrainer::named(const std::string& hf_name) const {
  const auto it = by_name_.find(hf_name);
  require(it != by_name_.end(), "gpt2 (cuda training): no parameter named '" + hf_name + "'");
  return *it->second;
}

void Gpt2CudaTrainer::set_value(const std::string& hf_name, const float* host) {
  Param& p = named(hf_name);
  set_value_of(p, host, type_, stream_);
  k::check_cuda(cudaStreamSynchronize(stream_), "gpt2 (cuda training) set_value");
}

namespace {

// [rows, cols] <-> [cols, rows] (a Conv1D weight between the device's and the checkpoint's layout)
std::vector<float> transposed(const std::vector<float>& x, int64_t rows, int64_t cols) {
  std::vector<float> out(x.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[size_t(c * rows + r)] = x[size_t(r * cols + c)];
  return out;
}

}  // namespace

std::vector<float> Gpt2CudaTrainer::moment(const std::string& hf_name, bool first) const {
  const Param& p = named(hf_name);
  k::check_cuda(cudaStreamSynchronize(stream_), "gpt2 (cuda training) moment");
  std::vector<float> m(size_t(p.numel()));
  (first ? p.m : p.v).download(m.data(), m.size() * 4);
  return p.conv1d ? transposed(m, p.rows, p.cols) : m;
}

void Gpt2CudaTrainer::set_moment(const std::string& hf_name, bool first, const float* host) {
  Param& p = named(hf_name);
  std::vector<float> m(host, host + p.numel());
  if (p.conv1d) m = transposed(m, p.cols, p.rows);  // checkpoint [in, out] -> [out, in]
  k::check_cuda(cudaStreamSynchronize(stream_), "gpt2 (cuda training) set_moment");
  (first ? p.m : p.v).upload(m.data(), m.size() * 4);
}

std::vector<float> Gpt2CudaTrainer::gradient(const std::string& hf_name) const {
  return host_copy(hf_name, true);
}

std::vector<float> Gpt2CudaTrainer::value(const std::string& hf_name) const {
  return host_copy(hf_name, false);
}

std::vector<float> Gpt2CudaTrainer::host_copy(const std::string& hf_name, bool grad) const {
  const auto it = by_name_.find(hf_name);
  require(it != by_name_.end(), "gpt2 (cuda training): no parameter named '" + hf_name + "'");
  const Param& p = *it->second;
  k::check_cuda(cudaStreamSynchronize(stream_), "gpt2 (cuda training) download");
  std::vector<float> g(size_t(p.numel()));
  (grad ? p.grad : p.value).download(g.data(), g.size() * 4);
  if (!p.conv1d) return g;
  std::vector<float> out(g.size());  // [rows (out), cols (in)] -> [in, out]
  for (int64_t o = 0; o < p.rows; ++o)
    for (int64_t i = 0; i < p.cols; ++i) out[size_t(i * p.rows + o)] = g[size_t(o * p.cols + i)];
  return out;
}

double Gpt2CudaTrainer::adamw(float lr, float weight_decay, float clip_norm, float beta1,
                              float beta2, float eps) {
  const cudaStream_t s = stream_;
  DeviceBuffer norm2 = zeros(4, s);
  for (const auto& p : params_)
    k::sum_of_squares(p->g(), p->numel(), norm2.as<float>(), engines_->scratch, s);
  float norm2_host = 0;
  k::check_cuda(cudaMemcpyAsync(&norm2_host, norm2.data(), 4, cudaMemcpyDeviceToHost, s),
                "cudaMemcpyAsync (gradient norm)");
  k::check_cuda(cudaStreamSynchronize(s), "gpt2 (cuda training) gradient norm");
  const double norm = std::sqrt(double(norm2_host));
  require(std::isfinite(norm), "gpt2 (cuda training) adamw: the gradient is not finite");
  const float clip = clip_norm > 0 && norm > clip_norm ? float(clip_norm / norm) : 1.0f;
  ++adam_steps_;
  for (const auto& p : params_) {
    k::AdamWHyper hyper;
    hyper.lr = lr;
    hyper.beta1 = beta1;
    hyper.beta2 = beta2;
    hyper.eps = eps;
    hyper.weight_decay = p->decay ? weight_decay : 0.0f;
    k::adamw_step(p->f(), p->g(), p->m.as<float>(), p->v.as<float>(), p->numel(), hyper,
                  adam_steps_, clip, p->copy.data(), type_, s);
  }
  return norm;
}

}  // namespace kda::model::cuda
