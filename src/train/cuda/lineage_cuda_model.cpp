#include "train/cuda/lineage_cuda_model.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/error.h"
#include "model/cuda/gpt2_train_kernels.h"
#include "ops/attention/cuda/attention_cuda.h"
#include "ops/delta_rule/cuda/delta_rule_cuda.h"
#include "ops/gemm/cuda/gemm_cuda.h"
#include "ops/linear_attn/cuda/linear_attn_cuda.h"
#include "ops/nn/cuda/nn_cuda.h"
#include "ops/nn/cuda/train_cuda.h"
#include "ops/nn/cuda/train_mixer_cuda.h"
#include "train/cuda/device_params.h"
#include "train/cuda/lineage_cuda_internal.h"
#include "train/mixer_layer.h"

namespace kda::train::cuda {

using namespace lineage_detail;
using k::check_cuda;
using k::DeviceBuffer;
using k::ElementType;

LineageCudaModel::LineageCudaModel(std::unique_ptr<LineageModel> host) : host_(std::move(host)) {
  const LineageConfig& c = host_->config();
  require(c.head_dim == 64 || c.head_dim == 128,
          "lineage model (cuda): head_dim must be 64 or 128 (the chunked kernels' sizes)");
  params_ = std::make_unique<DeviceParams>(host_->params(), stream_);
  engines_ = std::make_unique<Engines>(stream_);
  for (size_t l = 0; l < c.pattern.size(); ++l) {
    const std::string pre = "layers." + std::to_string(l) + ".";
    auto p = [&](const std::string& name) { return &params_->at(pre + name); };
    Layer L;
    L.kind = mixer_from_letter(c.pattern[l]);
    L.rope = c.softmax_rope();
    L.norm1 = p("norm1");
    L.norm2 = p("norm2");
    L.W1 = p("mlp.gate");
    L.W3 = p("mlp.up");
    L.W2 = p("mlp.down");
    L.Wq = p("mixer.q");
    L.Wo = p("mixer.o");
    if (L.kind == MixerKind::mla) {
      L.kv_a = p("mixer.kv_a");
      L.kv_a_norm = p("mixer.kv_a_norm");
      L.kv_b = p("mixer.kv_b");
      layers_.push_back(L);
      continue;
    }
    L.Wk = p("mixer.k");
    L.Wv = p("mixer.v");
    if (L.delta_family()) {
      L.Wb = p("mixer.b");
      L.conv[0] = p("mixer.q_conv");
      L.conv[1] = p("mixer.k_conv");
      L.conv[2] = p("mixer.v_conv");
    }
    if (L.kind == MixerKind::gated_delta || L.kind == MixerKind::kda) {
      L.Wg = p("mixer.g");
      L.A_log = p("mixer.A_log");
      L.dt_bias = p("mixer.dt_bias");
    }
    layers_.push_back(L);
  }
}

LineageCudaModel::~LineageCudaModel() {
  synchronize();  // before the activations and engines go (the parameters go last, in the base)
  acts_.reset();
  engines_.reset();
}

void LineageCudaModel::report_profile(const std::string& title) const {
  engines_->timer.report(title);
}

void LineageCudaModel::reset_profile() {
  engines_->timer.reset();
}

void LineageCudaModel::ensure_activations(int64_t R) {
  if (acts_ && acts_->capacity >= R) {  // smaller batches (evaluation) reuse the buffers
    acts_->R = R;
    return;
  }
  acts_.reset();  // free the old sizes first
  const LineageConfig& c = host_->config();
  const int64_t d = c.width, H = c.heads, inner = H * c.head_dim, F = c.mlp_hidden, V = c.vocab;
  auto a = std::make_unique<Activations>();
  a->R = a->capacity = R;
  const auto f32 = [](int64_t n) { return DeviceBuffer(size_t(n) * 4); };
  const auto bf = [](int64_t n) { return DeviceBuffer(size_t(n) * 2); };
  a->ids = DeviceBuffer(size_t(R) * 4);
  a->targets = DeviceBuffer(size_t(R) * 4);
  a->positions = DeviceBuffer(size_t(R) * 4);
  a->result = DeviceBuffer(16);
  for (size_t i = 0; i <= 2 * layers_.size(); ++i) a->h.push_back(f32(R * d));
  for (const Layer& L : layers_) {
    PerLayer p;
    p.inv1 = f32(R);
    p.a_c = bf(R * d);
    if (L.kind == MixerKind::mla) {
      const mla_train::Shape m = mla_shape(H, c.head_dim);
      p.q_c = bf(R * H * m.qk);
      p.k_c = bf(R * H * m.qk);
      p.v_c = bf(R * inner);
      p.rows32 = f32(R * m.row);
      p.lat32 = f32(R * m.latent);
      p.inv_lat = f32(R);
      p.latn_c = bf(R * m.latent);
      p.lse = f32(R * H);
    } else if (L.kind == MixerKind::softmax) {
      // one GEMM into bf16 rows [q | k | v] (read in place by the attention kernels), from
      // [Wq; Wk; Wv] (the compute copies side by side, copied by each forward)
      p.qkv_c = bf(R * 3 * inner);
      p.wqkv_c = bf(3 * inner * d);
    } else {
      // fp32 projections (the short convolutions' and fp32 kernels' input), bf16 q / k / v
      p.qkv32 = f32(R * 3 * inner);
      p.q_c = bf(R * inner);
      p.k_c = bf(R * inner);
      p.v_c = bf(R * inner);
      // delta family: [Wq; Wk; Wv] (KDA: and Wg) side by side, copied by each forward: one GEMM
      // into qkv32, and one product back over all the projections' gradients
      if (L.delta_family()) p.wqkv_c = bf((L.kind == MixerKind::kda ? 4 : 3) * inner * d);
    }
    if (L.kind == MixerKind::softmax) p.lse = f32(R * H);
    if (L.kind == MixerKind::linear) {  // dense fp32 q, k, v and o for the fp32 kernels
      p.qa32 = f32(R * inner);
      p.ka32 = f32(R * inner);
      p.v32 = f32(R * inner);
      p.o32 = f32(R * inner);
      p.den32 = f32(R * H);
    }
    if (L.delta_family()) p.b_c = bf(R * H);
    if (L.kind == MixerKind::kda) p.g_c = bf(R * inner);
    if (L.kind == MixerKind::delta || L.kind == MixerKind::gated_delta) {
      p.braw32 = f32(R * H);
      p.qa32 = f32(R * inner);
      p.ka32 = f32(R * inner);
    }
    if (L.kind == MixerKind::gated_delta) {
      p.graw32 = f32(R * H);
      p.g_c = bf(R * H);
    }
    p.o_c = bf(R * inner);
    p.inv2 = f32(R);
    p.m_c = bf(R * d);
    // the MLP: bf16 pre-activations [W1 m | W3 m] (fp32 inside the SwiGLU kernels, as fla and
    // llm.c keep them), and W1 and W3's compute copies side by side (one GEMM each way)
    p.up_c = bf(R * 2 * F);
    p.act_c = bf(R * F);
    p.w13_c = bf(2 * F * d);
    a->layers.push_back(std::move(p));
  }
  a->invf = f32(R);
  a->hf_c = bf(R * d);
  a->head_rows = DeviceBuffer(size_t(R) * 4);
  a->x_head = f32(R * d);
  // fp32 logits (bf16 ones cost MQAR's loss curve 8 % against the CPU's at 150 steps: confident
  // logits of ~16 round by 0.06); their gradients go to dy_c in bf16, what the GEMMs read
  a->logits = f32(R * V);
  a->dh = f32(R * d);
  a->dtmp = f32(R * d);
  a->dan = f32(R * d);
  const mla_train::Shape m = mla_shape(H, c.head_dim);  // (MLA layers only)
  a->dy_c = bf(R * std::max({V, 2 * F, d, 2 * inner, m.row}));
  a->d32a = f32(R * inner);
  a->dact_c = bf(R * F);
  a->do_c = bf(R * inner);
  a->dq_c = bf(R * inner);
  a->dk_c = bf(R * inner);
  a->dv_c = bf(R * inner);
  // rows of the gradients one GEMM takes back through [Wq; Wk; Wv (; Wg)] and their stacked
  // weight gradient: softmax layers' [dq | dk | dv], the delta family's pre-convolution [dq | dk |
  // dv] (KDA: and dg)
  int64_t dqkv_width = 0;
  for (const Layer& L : layers_) {
    if (L.kind == MixerKind::softmax || L.delta_family())
      dqkv_width = std::max(dqkv_width, (L.kind == MixerKind::kda ? 4 : 3) * inner);
  }
  if (dqkv_width > 0) {
    a->dqkv_c = bf(R * dqkv_width);
    a->dw_qkv = f32(dqkv_width * d);
  }
  a->dg_c = bf(R * inner);
  a->db_c = bf(R * H);
  a->dA = f32(H);
  a->ddt = f32(inner);
  for (const Layer& L : layers_)
    if (L.kind == MixerKind::linear) a->dlinear32 = f32(3 * R * inner);
  if (std::any_of(layers_.begin(), layers_.end(),
                  [](const Layer& L) { return L.kind == MixerKind::mla; })) {
    a->dqm_c = bf(R * H * m.qk);
    a->dkm_c = bf(R * H * m.qk);
    a->dkeys32 = f32(R * H * m.qk);
    a->dvalues32 = f32(R * inner);
    a->dkvb32 = f32(R * H * (m.nope + m.v));
    a->drows32 = f32(R * m.row);
    a->dlat32 = f32(R * m.latent);
    // rope_sum[h qk + nope + r, r] = 1: d(k_rope) = sum over heads of their rope-key gradients
    std::vector<float> sum(size_t(H * m.qk * m.rope), 0.0f);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r = 0; r < m.rope; ++r) sum[size_t((h * m.qk + m.nope + r) * m.rope + r)] = 1;
    a->rope_sum = f32(H * m.qk * m.rope);
    a->rope_sum.upload(sum.data(), sum.size() * 4);
  }
  acts_ = std::move(a);
}

// One attention call's arguments over layer P's q, k, v (bf16 [R, H, dh]) from row r0: `batch`
// sequences of `len` tokens; o (fp32) and lse where the forward keeps them.
ops::cuda::AttentionArgs LineageCudaModel::attention_args(const PerLayer& P, int64_t H, int64_t dh,
                                                          int64_t r0, int64_t len, int64_t batch) {
  const int64_t inner = H * dh;
  k::AttentionArgs args;
  args.dtype = kBf16;
  args.Tq = args.Tk = len;
  args.Hq = args.Hkv = H;
  args.Dk = args.Dv = dh;
  args.q = offset(P.qkv_c, r0 * 3 * inner, 2);  // rows [q | k | v]
  args.k = offset(P.qkv_c, r0 * 3 * inner + inner, 2);
  args.v = offset(P.qkv_c, r0 * 3 * inner + 2 * inner, 2);
  args.q_row_stride = args.k_row_stride = args.v_row_stride = 3 * inner;
  args.o_bf16 = offset(P.o_c, r0 * inner, 2);  // bf16: the output projection's input
  args.lse = offset<float>(P.lse, r0 * H, 4);
  args.batch = batch;
  return args;
}

// The linear attention call of a linear layer over the forward's dense fp32 q, k, v (the CPU
// layer's settings: scale K^-0.5, the normalised form).
ops::cuda::LinearAttnDeviceArgs LineageCudaModel::linear_attn_args(const PerLayer& P,
                                                                   const LineageConfig& c,
                                                                   int64_t B, int64_t T, int64_t R,
                                                                   std::span<const int64_t> cu) {
  const bool packed = !cu.empty();
  k::LinearAttnDeviceArgs args;
  args.shape = {packed ? 1 : B, packed ? R : T, c.heads, c.head_dim, c.head_dim, 0, true};
  args.q = P.qa32.as<float>();
  args.k = P.ka32.as<float>();
  args.v = P.v32.as<float>();
  args.cu_seqlens = cu;
  return args;
}

// The chunked delta-rule call of a DeltaNet / Gated DeltaNet / KDA layer over what the forward
// keeps (bf16 q, k, v, gate, beta); KDA applies its L2 norm, gate and beta sigmoid in the kernel.
ops::cuda::DeltaRuleDeviceInputs LineageCudaModel::delta_rule_inputs(
    const Layer& L, const PerLayer& P, const LineageConfig& c, int64_t B, int64_t T, int64_t R,
    std::span<const int64_t> cu) {
  const int64_t H = c.heads, dh = c.head_dim;
  const bool packed = !cu.empty();
  k::DeltaRuleDeviceInputs in;
  in.shape = {packed ? 1 : B, packed ? R : T, H, H, dh, dh, ops::Gate::none, 0};
  in.dtype = kBf16;
  in.q = P.q_c.data();
  in.k = P.k_c.data();
  in.v = P.v_c.data();
  in.beta = P.b_c.data();
  in.cu_seqlens = cu;
  if (L.kind == MixerKind::gated_delta) {
    in.shape.gate = ops::Gate::scalar;
    in.g = P.g_c.data();
  }
  if (L.kind == MixerKind::kda) {
    in.shape.gate = ops::Gate::channel;
    in.g = P.g_c.data();
    in.kda_layer.l2norm_qk = true;
    in.kda_layer.gate_in_kernel = true;
    in.kda_layer.gate = c.kda_options().gate;
    in.kda_layer.lower_bound = float(LineageConfig::kKdaLowerBound);
    in.kda_layer.A_log = L.A_log->f();
    in.kda_layer.dt_bias = L.dt_bias->f();
    in.kda_layer.beta_sigmoid = true;
  }
  return in;
}

void LineageCudaModel::mixer_forward(Layer& L, int64_t l, int64_t B, int64_t T) {
  if (L.kind == MixerKind::mla) return mla_forward(L, l, B, T);
  const LineageConfig& c = host_->config();
  Activations& a = *acts_;
  PerLayer& P = a.layers[size_t(l)];
  k::Gemm& gemm = engines_->gemm;
  const cudaStream_t s = stream_;
  const int64_t R = a.R, d = c.width, H = c.heads, dh = c.head_dim, inner = H * dh;
  const int32_t* positions = a.positions.as<int32_t>();
  const Entry* Wqkv[3] = {L.Wq, L.Wk, L.Wv};
  DeviceBuffer* qkv_c[3] = {&P.q_c, &P.k_c, &P.v_c};
  if (L.kind == MixerKind::softmax) {  // bf16 [q | k | v] rows from one GEMM, RoPE in place
    for (int j = 0; j < 3; ++j)
      copy_device(offset(P.wqkv_c, j * inner * d, 2), Wqkv[j]->compute(), size_t(inner * d) * 2, s);
    gemm.linear(kBf16, R, 3 * inner, d, {P.a_c.data(), d}, {P.wqkv_c.data(), d},
                {P.qkv_c.data(), kBf16});
    engines_->timer.mark(s, "f.qkv_gemm");
    if (L.rope)  // q and k side by side: 2 H heads a row
      k::rotary_embedding(P.qkv_c.data(), kBf16, positions, R, 2 * H, dh, 3 * inner, +1, s);
    engines_->timer.mark(s, "f.rope_cast");
    for_each_attention(B, T, cu_seqlens_, [&](int64_t r0, int64_t len, int64_t batch) {
      const k::AttentionArgs args = attention_args(P, H, dh, r0, len, batch);
      k::attention_forward(args, a.workspace.data(), a.workspace.bytes(), s);
    });
    engines_->timer.mark(s, "f.attention");
    return;
  }
  // q, k, v projections: fp32 column blocks of qkv32 [R, 3 inner]
  if (L.delta_family()) {  // one GEMM from [Wq; Wk; Wv] (KDA: Wg too, for the backward)
    const Entry* Ws[4] = {L.Wq, L.Wk, L.Wv, L.Wg};
    const int blocks = L.kind == MixerKind::kda ? 4 : 3;
    for (int j = 0; j < blocks; ++j)
      copy_device(offset(P.wqkv_c, j * inner * d, 2), Ws[j]->compute(), size_t(inner * d) * 2, s);
    gemm.linear(kBf16, R, 3 * inner, d, {P.a_c.data(), d}, {P.wqkv_c.data(), d},
                {P.qkv32.data(), kF32});
  } else {
    for (int j = 0; j < 3; ++j)
      gemm.linear(kBf16, R, inner, d, {P.a_c.data(), d}, {Wqkv[j]->compute(), d},
                  {offset(P.qkv32, j * inner, 4), kF32, 3 * inner});
  }
  engines_->timer.mark(s, "f.qkv_gemm");
  const auto qkv = [&](int j) { return offset<float>(P.qkv32, j * inner, 4); };

  if (L.kind == MixerKind::linear) {
    const DeviceBuffer* dense[3] = {&P.qa32, &P.ka32, &P.v32};
    for (int j = 0; j < 3; ++j)
      k::copy_rows(qkv(j), R, inner, 3 * inner, {dense[j]->data(), kF32}, s);
    k::linear_attn_forward(linear_attn_args(P, c, B, T, R, cu_seqlens_), P.o32.as<float>(),
                           a.workspace.data(), a.workspace.bytes(), s, P.den32.as<float>());
    k::convert(P.o32.data(), kF32, P.o_c.data(), kBf16, R * inner, s);
    return;
  }
  // the delta-rule family: short convolution + SiLU on q, k, v (zero state at every sequence)
  const bool kda = L.kind == MixerKind::kda;
  for (int j = 0; j < 3; ++j) {
    const bool normalised_later = !kda && j < 2;  // DeltaNet / GDN normalise q, k outside
    k::OutRows out{qkv_c[j]->data(), kBf16, 0};
    if (normalised_later) out = {(j == 0 ? P.qa32 : P.ka32).data(), kF32, 0};
    k::short_conv_silu_train_forward(qkv(j), positions, R, inner, 3 * inner, L.conv[j]->f(),
                                     kShortConvWidth, out, s);
  }
  engines_->timer.mark(s, "f.conv");
  const k::DeltaRuleDeviceInputs in = delta_rule_inputs(L, P, c, B, T, R, cu_seqlens_);
  if (kda) {
    gemm.linear(kBf16, R, inner, d, {P.a_c.data(), d}, {L.Wg->compute(), d}, {P.g_c.data(), kBf16});
    gemm.linear(kBf16, R, H, d, {P.a_c.data(), d}, {L.Wb->compute(), d}, {P.b_c.data(), kBf16});
  } else {
    k::l2norm_rows_forward(P.qa32.as<float>(), R * H, dh, {P.q_c.data(), kBf16}, s);
    k::l2norm_rows_forward(P.ka32.as<float>(), R * H, dh, {P.k_c.data(), kBf16}, s);
    gemm.linear(kBf16, R, H, d, {P.a_c.data(), d}, {L.Wb->compute(), d}, {P.braw32.data(), kF32});
    k::sigmoid_forward(P.braw32.as<float>(), R * H, P.b_c.data(), kBf16, s);
    if (L.kind == MixerKind::gated_delta) {
      gemm.linear(kBf16, R, H, d, {P.a_c.data(), d}, {L.Wg->compute(), d}, {P.graw32.data(), kF32});
      k::scalar_gate_forward(P.graw32.as<float>(), L.A_log->f(), L.dt_bias->f(), R, H, P.g_c.data(),
                             kBf16, s);
    }
  }
  engines_->timer.mark(s, "f.mixer_prep");
  chunk_forward_step(in, P.o_c.data(), keep_chunk_forward_, P.chunk_ws, a.workspace, s);
  engines_->timer.mark(s, "f.chunk");
}

void LineageCudaModel::mixer_backward(Layer& L, int64_t l, int64_t B, int64_t T) {
  if (L.kind == MixerKind::mla) return mla_backward(L, l, B, T);
  const LineageConfig& c = host_->config();
  Activations& a = *acts_;
  PerLayer& P = a.layers[size_t(l)];
  k::Gemm& gemm = engines_->gemm;
  auto& wgrad = engines_->wgrad;
  k::TrainScratch& scratch = engines_->scratch;
  const cudaStream_t s = stream_;
  const int64_t R = a.R, d = c.width, H = c.heads, dh = c.head_dim, inner = H * dh;
  const int32_t* positions = a.positions.as<int32_t>();
  const Entry* Wqkv[3] = {L.Wq, L.Wk, L.Wv};
  float* dan = a.dan.as<float>();
  // d(pre-projection input) of q / k / v from an fp32 gradient: cast, then the GEMMs
  const auto project_back_f32 = [&](int j, const float* dpre, int64_t width, const Entry& W) {
    k::convert(dpre, kF32, a.dy_c.data(), kBf16, R * width, s);
    linear_backward(gemm, wgrad, R, d, width, a.dy_c.data(), width, P.a_c.data(), d, W, {dan, kF32},
                    j > 0);
  };

  if (L.kind == MixerKind::linear) {  // fp32 kernel: d_o up from bf16, dq / dk / dv fp32
    k::convert(a.do_c.data(), kBf16, a.d32a.data(), kF32, R * inner, s);
    float* dqkv = a.dlinear32.as<float>();
    k::linear_attn_backward(linear_attn_args(P, c, B, T, R, cu_seqlens_), a.d32a.as<float>(), dqkv,
                            dqkv + R * inner, dqkv + 2 * R * inner, a.workspace.data(),
                            a.workspace.bytes(), s, {P.o32.as<float>(), P.den32.as<float>()});
    for (int j = 0; j < 3; ++j) project_back_f32(j, dqkv + j * R * inner, inner, *Wqkv[j]);
    return;
  }
  if (L.kind == MixerKind::softmax) {
    engines_->timer.mark(s, "b.other");
    for_each_attention(B, T, cu_seqlens_, [&](int64_t r0, int64_t len, int64_t batch) {
      const k::AttentionArgs args = attention_args(P, H, dh, r0, len, batch);
      const int64_t row = r0 * 3 * inner, w = 3 * inner;  // rows [dq | dk | dv]
      k::attention_backward(args, args.lse, offset(a.do_c, r0 * inner, 2), offset(a.dqkv_c, row, 2),
                            offset(a.dqkv_c, row + inner, 2), offset(a.dqkv_c, row + 2 * inner, 2),
                            a.workspace.data(), a.workspace.bytes(), s,
                            {.dq_row_stride = w, .dk_row_stride = w, .dv_row_stride = w});
    });
    engines_->timer.mark(s, "b.attention");
    if (L.rope)  // the gradient rotates back (dq and dk side by side: 2 H heads a row)
      k::rotary_embedding(a.dqkv_c.data(), kBf16, positions, R, 2 * H, dh, 3 * inner, -1, s);
    // one weight-gradient product for [Wq; Wk; Wv] (M = 3 inner fills the GPU better than
    // three of M = inner), added into the three gradients; one product back (K = 3 inner)
    float* dw = a.dw_qkv.as<float>();
    wgrad.weight_gradient(kBf16, R, 3 * inner, d, a.dqkv_c.data(), 3 * inner, P.a_c.data(), d, dw,
                          0.f);
    for (int j = 0; j < 3; ++j) k::add_inplace(Wqkv[j]->g(), dw + j * inner * d, inner * d, s);
    gemm.matmul(kBf16, R, d, 3 * inner, {a.dqkv_c.data(), 3 * inner}, {P.wqkv_c.data(), d},
                {dan, kF32});
    engines_->timer.mark(s, "b.qkv_gemm");
    return;
  }

  const bool kda = L.kind == MixerKind::kda;
  const bool gated = L.kind == MixerKind::gated_delta;
  const k::DeltaRuleDeviceInputs in = delta_rule_inputs(L, P, c, B, T, R, cu_seqlens_);
  k::DeltaRuleDeviceGrads grads;
  grads.dq = a.dq_c.data();
  grads.dk = a.dk_c.data();
  grads.dv = a.dv_c.data();
  grads.dbeta = a.db_c.data();
  if (kda || gated) grads.dg = a.dg_c.data();
  if (kda) {
    grads.dA_log = a.dA.as<float>();
    grads.ddt_bias = a.ddt.as<float>();
  }
  engines_->timer.mark(s, "b.other");
  chunk_backward_step(in, a.do_c.data(), grads, keep_chunk_forward_, P.chunk_ws, a.workspace, s);
  engines_->timer.mark(s, "b.chunk");
  if (kda) {  // the kernel overwrites; parameter gradients accumulate
    k::add_inplace(L.A_log->g(), a.dA.as<float>(), H, s);
    k::add_inplace(L.dt_bias->g(), a.ddt.as<float>(), inner, s);
  }
  // q, k, v: (L2 norm,) then the short convolutions back to the projections, their gradients
  // written in bf16 into column blocks of dqkv_c rows [dq | dk | dv (| dg)] (KDA: dg copied in)
  const DeviceBuffer* dqkv[3] = {&a.dq_c, &a.dk_c, &a.dv_c};
  const DeviceBuffer* activated[2] = {&P.qa32, &P.ka32};
  const int blocks = kda ? 4 : 3;
  const int64_t w = blocks * inner;
  for (int j = 0; j < 3; ++j) {
    const void* dconv = dqkv[j]->data();
    ElementType dconv_type = kBf16;
    if (!kda && j < 2) {  // through the L2 norm first
      k::l2norm_rows_backward(activated[j]->as<float>(), dqkv[j]->data(), kBf16, R * H, dh,
                              a.d32a.as<float>(), s);
      dconv = a.d32a.data();
      dconv_type = kF32;
    }
    k::short_conv_silu_train_backward(offset<float>(P.qkv32, j * inner, 4), positions, R, inner,
                                      3 * inner, L.conv[j]->f(), kShortConvWidth, dconv, dconv_type,
                                      k::OutRows{offset(a.dqkv_c, j * inner, 2), kBf16, w},
                                      L.conv[j]->g(), scratch, s);
  }
  if (kda)  // (the chunk kernel writes dg dense)
    check_cuda(cudaMemcpy2DAsync(offset(a.dqkv_c, 3 * inner, 2), size_t(w) * 2, a.dg_c.data(),
                                 size_t(inner) * 2, size_t(inner) * 2, size_t(R),
                                 cudaMemcpyDeviceToDevice, s),
               "lineage model (cuda): dg rows");
  engines_->timer.mark(s, "b.conv");
  // one weight-gradient product for the stacked weight (M = w), added into each gradient; then
  // one product back through [Wq; Wk; Wv (; Wg)] (K = w) writing dan
  const Entry* Ws[4] = {L.Wq, L.Wk, L.Wv, L.Wg};
  float* dw = a.dw_qkv.as<float>();
  wgrad.weight_gradient(kBf16, R, w, d, a.dqkv_c.data(), w, P.a_c.data(), d, dw, 0.f);
  for (int j = 0; j < blocks; ++j) k::add_inplace(Ws[j]->g(), dw + j * inner * d, inner * d, s);
  engines_->timer.mark(s, "b.wgrad");
  gemm.matmul(kBf16, R, d, w, {a.dqkv_c.data(), w}, {P.wqkv_c.data(), d}, {dan, kF32});
  engines_->timer.mark(s, "b.dx_gemm");
  if (kda) {  // dbraw comes out of the kernel in bf16
    linear_backward(gemm, wgrad, R, d, H, a.db_c.data(), H, P.a_c.data(), d, *L.Wb, {dan, kF32},
                    true);
    return;
  }
  k::sigmoid_backward(P.braw32.as<float>(), a.db_c.data(), kBf16, R * H, a.d32a.as<float>(), s);
  project_back_f32(1, a.d32a.as<float>(), H, *L.Wb);
  if (gated) {
    k::scalar_gate_backward(P.graw32.as<float>(), L.A_log->f(), L.dt_bias->f(), a.dg_c.data(),
                            kBf16, R, H, a.d32a.as<float>(), L.A_log->g(), L.dt_bias->g(), scratch,
                            s);
    project_back_f32(1, a.d32a.as<float>(), H, *L.Wg);
  }
}

bool LineageCudaModel::select_head_rows(const int32_t* targets, int64_t R) {
  head_rows_.clear();
  head_targets_.clear();
  for (int64_t r = 0; r < R; ++r) {
    if (targets[r] < 0) continue;
    head_rows_.push_back(int32_t(r));
    head_targets_.push_back(targets[r]);
  }
  const int64_t n = int64_t(head_rows_.size());
  return n >= 1 && 8 * n <= 7 * R;
}

StepResult LineageCudaModel::forward_backward(const int32_t* inputs, const int32_t* targets,
                                              int64_t B, int64_t T, bool backward,
                                              std::span<const int64_t> cu_seqlens) {
  const LineageConfig& c = host_->config();
  const int64_t d = c.width, H = c.heads, dh = c.head_dim, inner = H * dh, F = c.mlp_hidden,
                V = c.vocab, R = B * T, L = int64_t(layers_.size());
  begin_step(inputs, targets, B, T, cu_seqlens, V, "lineage model (cuda)");
  ensure_activations(R);
  Activations& a = *acts_;
  k::Gemm& gemm = engines_->gemm;
  auto& wgrad = engines_->wgrad;
  k::TrainScratch& scratch = engines_->scratch;
  const cudaStream_t s = stream_;
  const float eps = c.norm_eps;

  // workspace for this call's shapes (sized before anything is queued: growing frees memory)
  size_t workspace = 256;
  const bool keep = keep_chunk_forward_for_backward();
  {
    const bool packed = !cu_seqlens_.empty();
    for (size_t li = 0; li < layers_.size(); ++li) {
      const Layer& Lr = layers_[li];
      if (Lr.kind == MixerKind::mla) {
        for_each_attention(B, T, cu_seqlens_, [&](int64_t, int64_t len, int64_t batch) {
          const k::AttentionArgs args = mla_workspace_args(a.layers[li], len, batch);
          workspace =
              std::max({workspace, k::attention_workspace_bytes(args),
                        backward ? k::attention_backward_workspace_bytes(args) : size_t(0)});
        });
      } else if (Lr.kind == MixerKind::linear) {
        const ops::LinearAttnShape shape{packed ? 1 : B, packed ? R : T, H, dh, dh, 0, true};
        // (one size for both calls: the backward's from the kept forward, which holds the
        // forward's)
        workspace = std::max(workspace, k::linear_attn_workspace_bytes(shape, cu_seqlens_,
                                                                       /*kept_forward=*/true));
      } else if (Lr.kind == MixerKind::softmax) {
        for_each_attention(B, T, cu_seqlens_, [&](int64_t, int64_t len, int64_t batch) {
          // this layer's own arguments: with its lse set, as the calls below have it (an unset
          // lse would size the split decode path, which refuses batches, for T <= 15)
          const k::AttentionArgs args = attention_args(a.layers[li], H, dh, 0, len, batch);
          workspace =
              std::max({workspace, k::attention_workspace_bytes(args),
                        backward ? k::attention_backward_workspace_bytes(args) : size_t(0)});
        });
      } else {
        ops::DeltaRuleShape shape{
            packed ? 1 : B, packed ? R : T, H, H, dh, dh, ops::Gate::channel, 0};
        if (Lr.kind != MixerKind::kda)
          shape.gate = Lr.kind == MixerKind::gated_delta ? ops::Gate::scalar : ops::Gate::none;
        workspace = std::max(workspace, k::chunk_forward_workspace_bytes(shape, cu_seqlens_));
        if (backward && !keep)  // one shared workspace; the backward recomputes
          workspace = std::max(workspace, k::chunk_backward_workspace_bytes(shape, cu_seqlens_));
        if (backward && keep)  // the layer's own, kept from its forward to its backward
          reserve_chunk_workspace(a.layers[li].chunk_ws,
                                  k::chunk_backward_workspace_bytes(shape, cu_seqlens_), s);
      }
    }
    if (workspace > a.workspace.bytes()) {
      check_cuda(cudaStreamSynchronize(s), "lineage model (cuda): workspace");
      a.workspace.resize(workspace);
    }
  }
  keep_chunk_forward_ = backward && keep;

  check_cuda(cudaMemcpyAsync(a.ids.data(), inputs, size_t(R) * 4, cudaMemcpyHostToDevice, s),
             "cudaMemcpyAsync (ids)");
  // The final norm, the head's GEMMs and the cross-entropy run over the scored rows only when
  // at most 7 in 8 are scored (MQAR scores 1 in 8, Palindrome 1 in 2): unscored rows get no
  // gradient either way, and the head is a quarter of a recall model's step at vocab 8192.
  const bool gathered = select_head_rows(targets, R);
  const int64_t Rh = gathered ? int64_t(head_rows_.size()) : R;
  if (gathered)
    check_cuda(cudaMemcpyAsync(a.head_rows.data(), head_rows_.data(), size_t(Rh) * 4,
                               cudaMemcpyHostToDevice, s),
               "cudaMemcpyAsync (head rows)");
  // the head's targets: the gathered rows' (all scored) or every row's
  check_cuda(cudaMemcpyAsync(a.targets.data(), gathered ? head_targets_.data() : targets,
                             size_t(Rh) * 4, cudaMemcpyHostToDevice, s),
             "cudaMemcpyAsync (targets)");
  k::sequence_positions(cu_seqlens_, B, T, a.positions.as<int32_t>(), s);
  model::cuda::StageTimer& timer = engines_->timer;
  timer.start(s);

  // ---- forward ----
  Entry& embed = params_->at("embed");
  Entry& final_norm = params_->at("final_norm");
  Entry& lm_head = params_->at("lm_head");
  k::embedding(a.ids.as<int32_t>(), R, embed.value.data(), nullptr, 0, kF32, d, a.h[0].as<float>(),
               s);
  timer.mark(s, "f.embedding");
  for (int64_t l = 0; l < L; ++l) {
    Layer& W = layers_[size_t(l)];
    PerLayer& P = a.layers[size_t(l)];
    float* x_in = a.h[size_t(2 * l)].as<float>();
    float* x_mid = a.h[size_t(2 * l + 1)].as<float>();
    float* x_out = a.h[size_t(2 * l + 2)].as<float>();
    k::rms_norm_forward_train(x_in, R, d, W.norm1->f(), eps, {P.a_c.data(), kBf16},
                              P.inv1.as<float>(), s);
    timer.mark(s, "f.norm_residual");
    mixer_forward(W, l, B, T);
    timer.mark(s, "f.other");
    // x_mid = x_in + o Wo^T in one pass (x_in stays: the norm backward reads it)
    gemm.linear_add(kBf16, R, d, inner, {P.o_c.data(), inner}, {W.Wo->compute(), inner}, {x_in},
                    {x_mid, kF32});
    timer.mark(s, "f.o_gemm");
    k::rms_norm_forward_train(x_mid, R, d, W.norm2->f(), eps, {P.m_c.data(), kBf16},
                              P.inv2.as<float>(), s);
    timer.mark(s, "f.norm_residual");
    // W1 and W3 as one [2F, d] weight (refreshed from the compute copies, which the optimizer
    // rewrites; the backward reads the same): one GEMM into the bf16 [R, 2F] pre-activations
    copy_device(P.w13_c.data(), W.W1->compute(), size_t(F * d) * 2, s);
    copy_device(offset(P.w13_c, F * d, 2), W.W3->compute(), size_t(F * d) * 2, s);
    gemm.linear(kBf16, R, 2 * F, d, {P.m_c.data(), d}, {P.w13_c.data(), d}, {P.up_c.data(), kBf16});
    timer.mark(s, "f.mlp_gemm");
    k::swiglu(P.up_c.data(), kBf16, R, F, {P.act_c.data(), kBf16}, s);
    timer.mark(s, "f.mlp_act");
    gemm.linear_add(kBf16, R, d, F, {P.act_c.data(), F}, {W.W2->compute(), F}, {x_mid},
                    {x_out, kF32});
    timer.mark(s, "f.mlp_gemm");
  }
  const float* x_final = a.h[size_t(2 * L)].as<float>();
  // (gathered: the head's rows of the residual stream, x_head [Rh, d])
  if (gathered)
    k::embedding(a.head_rows.as<int32_t>(), Rh, x_final, nullptr, 0, kF32, d, a.x_head.as<float>(),
                 s);
  const float* x_head = gathered ? a.x_head.as<float>() : x_final;
  k::rms_norm_forward_train(x_head, Rh, d, final_norm.f(), eps, {a.hf_c.data(), kBf16},
                            a.invf.as<float>(), s);
  timer.mark(s, "f.norm_residual");
  float* logits = a.logits.as<float>();
  gemm.linear(kBf16, Rh, V, d, {a.hf_c.data(), d}, {lm_head.compute(), d}, {logits, kF32});
  timer.mark(s, "f.head_gemm");
  float* loss_sum = a.result.as<float>();
  int32_t* correct = offset<int32_t>(a.result, 1, 4);
  int32_t* scored = offset<int32_t>(a.result, 2, 4);
  k::cross_entropy_forward_backward(logits, kF32, a.targets.as<int32_t>(), Rh, V, a.dy_c.data(),
                                    kBf16, loss_sum, correct, scored, scratch, s);
  timer.mark(s, "ce");
  if (backward) {
    float* dh = a.dh.as<float>();
    float* dtmp = a.dtmp.as<float>();
    float* dan = a.dan.as<float>();
    // head: dhf = dlogits . lm_head, dlm_head += dlogits^T hf; then the final norm
    linear_backward(gemm, wgrad, Rh, d, V, a.dy_c.data(), V, a.hf_c.data(), d, lm_head,
                    {dtmp, kF32}, false);
    timer.mark(s, "b.head_gemm");
    // (each norm backward also writes its dh in bf16 to dy_c, the next GEMM's input)
    if (!gathered) {
      k::rms_norm_backward(x_final, dtmp, R, d, final_norm.f(), a.invf.as<float>(), dh,
                           final_norm.g(), scratch, s, /*accumulate_dx=*/false, a.dy_c.data());
    } else {  // the scored rows' dh into dan, then scattered into a zero dh (rows distinct)
      k::rms_norm_backward(x_head, dtmp, Rh, d, final_norm.f(), a.invf.as<float>(), dan,
                           final_norm.g(), scratch, s, /*accumulate_dx=*/false);
      check_cuda(cudaMemsetAsync(dh, 0, size_t(R * d) * 4, s), "cudaMemsetAsync (dh)");
      k::embedding_backward(a.head_rows.as<int32_t>(), dan, Rh, d, R, dh, scratch, s);
      k::convert(dh, kF32, a.dy_c.data(), kBf16, R * d, s);
    }
    for (int64_t l = L - 1; l >= 0; --l) {
      Layer& W = layers_[size_t(l)];
      PerLayer& P = a.layers[size_t(l)];
      const float* x_in = a.h[size_t(2 * l)].as<float>();
      const float* x_mid = a.h[size_t(2 * l + 1)].as<float>();
      // MLP (dh: the gradient of x_out; dy_c: dh in bf16, from the norm backward before)
      timer.mark(s, "b.norm_residual");
      linear_backward(gemm, wgrad, R, F, d, a.dy_c.data(), d, P.act_c.data(), F, *W.W2,
                      {a.dact_c.data(), kBf16}, false);
      timer.mark(s, "b.mlp_gemm");
      k::swiglu_backward(P.up_c.data(), kBf16, a.dact_c.data(), kBf16, R, F, a.dy_c.data(), kBf16,
                         s);
      timer.mark(s, "b.mlp_act");
      // W1, W3: their weight gradients, then one dx product over both (K = 2F)
      wgrad.weight_gradient(kBf16, R, F, d, a.dy_c.data(), 2 * F, P.m_c.data(), d, W.W1->g(), 1.f);
      wgrad.weight_gradient(kBf16, R, F, d, offset(a.dy_c, F, 2), 2 * F, P.m_c.data(), d, W.W3->g(),
                            1.f);
      gemm.matmul(kBf16, R, d, 2 * F, {a.dy_c.data(), 2 * F}, {P.w13_c.data(), d}, {dtmp, kF32});
      timer.mark(s, "b.mlp_gemm");
      k::rms_norm_backward(x_mid, dtmp, R, d, W.norm2->f(), P.inv2.as<float>(), dh, W.norm2->g(),
                           scratch, s, /*accumulate_dx=*/true, a.dy_c.data());
      // mixer (dh: the gradient of x_mid; dy_c: dh in bf16); d_o in bf16 for the mixers' backward
      timer.mark(s, "b.norm_residual");
      linear_backward(gemm, wgrad, R, inner, d, a.dy_c.data(), d, P.o_c.data(), inner, *W.Wo,
                      {a.do_c.data(), kBf16}, false);
      timer.mark(s, "b.o_gemm");
      mixer_backward(W, l, B, T);
      timer.mark(s, "b.other");
      // (below layer 0 the embedding backward reads the fp32 dh only)
      k::rms_norm_backward(x_in, dan, R, d, W.norm1->f(), P.inv1.as<float>(), dh, W.norm1->g(),
                           scratch, s, /*accumulate_dx=*/true, l > 0 ? a.dy_c.data() : nullptr);
    }
    timer.mark(s, "b.norm_residual");
    k::embedding_backward(a.ids.as<int32_t>(), dh, R, d, V, embed.g(), scratch, s);
    timer.mark(s, "b.embedding");
  }
  return read_step_result(a.result, "lineage model (cuda): step");
}

}  // namespace kda::train::cuda
