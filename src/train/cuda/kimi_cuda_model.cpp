// KimiCudaModel: construction from the host model, buffers, the whole forward + backward (the
// embedding, the pre-norm residual layers, the dense MLP, the final norm, lm_head and the loss),
// the optimizer hooks and the MoE bias update. The mixers and the MoE live in their own files.
#include "train/cuda/kimi_cuda_model.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include "core/error.h"
#include "ops/attention/cuda/attention_cuda.h"
#include "ops/delta_rule/cuda/delta_rule_cuda.h"
#include "ops/nn/cuda/nn_cuda.h"
#include "ops/nn/cuda/train_cuda.h"
#include "ops/nn/cuda/train_mixer_cuda.h"
#include "train/cuda/device_params.h"
#include "train/cuda/kimi_cuda_internal.h"

namespace kda::train::cuda {

using namespace kimi_detail;
using k::check_cuda;
using k::DeviceBuffer;
using model::KimiFfn;
using model::KimiMixer;

KimiCudaModel::KimiCudaModel(std::unique_ptr<KimiLinearTrainable> host)
    : host_(std::move(host)), c_(model::KimiLinearConfig::parse(host_->config())) {
  const model::KimiLinearConfig& c = c_;
  if (c.count(KimiMixer::kda) > 0) {
    require(c.kda_head_dim == 64 || c.kda_head_dim == 128,
            "kimi_linear (cuda): linear_attn_config.head_dim must be 64 or 128 (the chunked "
            "KDA kernels' sizes), not " +
                std::to_string(c.kda_head_dim));
    require(c.conv_kernel >= 1 && c.conv_kernel <= 4,
            "kimi_linear (cuda): short_conv_kernel_size must be in [1, 4]");
  }
  params_ = std::make_unique<DeviceParams>(host_->params(), stream_);
  engines_ = std::make_unique<Engines>(stream_);
  std::map<std::string, Entry*> by_name;
  for (const auto& e : params_->entries()) by_name[e->host->name] = e.get();
  const auto find = [&](const std::string& name) -> Entry* {
    const auto it = by_name.find(name);
    return it == by_name.end() ? nullptr : it->second;
  };
  const auto at = [&](const std::string& name) { return &params_->at(name); };
  for (int64_t i = 0; i < c.num_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    const std::string a = p + "self_attn.";
    Layer L;
    L.norm1 = at(p + "input_layernorm.weight");
    L.norm2 = at(p + "post_attention_layernorm.weight");
    L.o_proj = at(a + "o_proj.weight");
    if (c.mixers[size_t(i)] == KimiMixer::kda) {
      L.kda = true;
      L.o_width = c.kda_width();
      L.q = at(a + "q_proj.weight");
      L.k = at(a + "k_proj.weight");
      L.v = at(a + "v_proj.weight");
      L.conv[0] = at(a + "q_conv1d.weight");
      L.conv[1] = at(a + "k_conv1d.weight");
      L.conv[2] = at(a + "v_conv1d.weight");
      L.f_a = at(a + "f_a_proj.weight");
      L.f_b = at(a + "f_b_proj.weight");
      L.g_a = at(a + "g_a_proj.weight");
      L.g_b = at(a + "g_b_proj.weight");
      L.b = at(a + "b_proj.weight");
      L.A_log = at(a + "A_log");
      L.dt_bias = at(a + "dt_bias");
      L.o_norm = at(a + "o_norm.weight");
    } else {
      L.o_width = c.mla_heads * c.v_head_dim;
      if (c.q_lora_rank > 0) {  // q = q_b(RMSNorm(q_a x))
        L.q_a = at(a + "q_a_proj.weight");
        L.q_a_norm = at(a + "q_a_layernorm.weight");
        L.q = at(a + "q_b_proj.weight");
      } else {
        L.q = at(a + "q_proj.weight");
      }
      L.kv_a = at(a + "kv_a_proj_with_mqa.weight");
      L.kv_a_norm = at(a + "kv_a_layernorm.weight");
      L.kv_b = at(a + "kv_b_proj.weight");
    }
    if (c.ffns[size_t(i)] == KimiFfn::dense) {
      // the folder's names: `mlp.*` (released checkpoint) or `block_sparse_moe.*`
      const std::string d = find(p + "mlp.gate_proj.weight") ? p + "mlp." : p + "block_sparse_moe.";
      L.gate = at(d + "gate_proj.weight");
      L.up = at(d + "up_proj.weight");
      L.down = at(d + "down_proj.weight");
    } else {
      L.moe = true;
      const std::string m = p + "block_sparse_moe.";
      L.router = at(m + "gate.weight");
      L.bias = at(m + "gate.e_score_correction_bias");
      for (int64_t e = 0; e < c.num_experts; ++e) {
        const std::string ep = m + "experts." + std::to_string(e) + ".";
        L.w1.push_back(at(ep + "w1.weight"));
        L.w2.push_back(at(ep + "w2.weight"));
        L.w3.push_back(at(ep + "w3.weight"));
      }
      L.shared_gate = find(m + "shared_experts.gate_proj.weight");
      L.shared_up = find(m + "shared_experts.up_proj.weight");
      L.shared_down = find(m + "shared_experts.down_proj.weight");
      L.load.assign(size_t(c.num_experts), 0);
    }
    layers_.push_back(std::move(L));
  }
}

KimiCudaModel::~KimiCudaModel() {
  synchronize();  // before the activations and engines go (the parameters go last, in the base)
  acts_.reset();
  engines_.reset();
}

void KimiCudaModel::after_optimizer_step() {
  // KimiLinearTrainable's rule (MoeLayer::update_bias), in the same float arithmetic, on the
  // device bias (a few floats: through the host)
  const float rate = host_->bias_update_rate;
  require(std::isfinite(rate) && rate >= 0, "kimi_linear (cuda): bias_update_rate must be >= 0");
  check_cuda(cudaStreamSynchronize(stream_), "kimi_linear (cuda): bias update");
  for (Layer& L : layers_) {
    if (!L.moe) continue;
    const int64_t E = int64_t(L.load.size());
    int64_t total = 0;
    for (int64_t l : L.load) total += l;
    const double mean = double(total) / double(E);
    std::vector<float> bias(static_cast<size_t>(E));
    L.bias->value.download(bias.data(), bias.size() * 4);
    for (int64_t e = 0; e < E; ++e) {
      const double gap = mean - double(L.load[size_t(e)]);
      bias[size_t(e)] += rate * float((gap > 0) - (gap < 0));
    }
    L.bias->value.upload(bias.data(), bias.size() * 4);
    std::fill(L.load.begin(), L.load.end(), 0);
  }
}

std::vector<double> KimiCudaModel::expert_load_imbalance() const {
  std::vector<double> out;
  for (const Layer& L : layers_) {
    if (!L.moe) continue;
    double total = 0, most = 0;
    for (int64_t n : L.load) {
      total += double(n);
      most = std::max(most, double(n));
    }
    out.push_back(total > 0 ? most / (total / double(L.load.size())) : 1.0);
  }
  return out;
}

void KimiCudaModel::ensure_activations(int64_t R) {
  if (acts_ && acts_->capacity >= R) {  // smaller batches (evaluation) reuse the buffers
    acts_->R = R;
    return;
  }
  check_cuda(cudaStreamSynchronize(stream_), "kimi_linear (cuda): buffers");
  acts_.reset();  // free the old sizes first
  const model::KimiLinearConfig& c = c_;
  const int64_t D = c.hidden_size, V = c.vocab_size;
  const int64_t H = c.kda_heads, K = c.kda_head_dim, HK = c.kda_width();
  const int64_t MH = c.mla_heads, nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim,
                mv = c.v_head_dim, lat = c.kv_lora_rank, qk = nope + rope, row = lat + rope;
  const int64_t F = c.dense_intermediate, I = c.moe_intermediate, E = c.num_experts, top = c.top_k,
                Is = I * c.num_shared_experts, pairs = R * top;
  auto a = std::make_unique<Activations>();
  a->R = a->capacity = R;
  const auto f32 = [](int64_t n) { return DeviceBuffer(size_t(std::max<int64_t>(n, 1)) * 4); };
  const auto bf = [](int64_t n) { return DeviceBuffer(size_t(std::max<int64_t>(n, 1)) * 2); };
  a->ids = f32(R);
  a->targets = f32(R);
  a->positions = f32(R);
  a->result = DeviceBuffer(16);
  for (size_t i = 0; i <= 2 * layers_.size(); ++i) a->h.push_back(f32(R * D));
  bool any_kda = false, any_mla = false, any_moe = false;
  int64_t widest_o = 1;
  for (const Layer& L : layers_) {
    PerLayer p;
    p.inv1 = f32(R);
    p.a_c = bf(R * D);
    p.o_c = bf(R * L.o_width);
    p.inv2 = f32(R);
    p.m_c = bf(R * D);
    widest_o = std::max(widest_o, L.o_width);
    if (L.kda) {
      any_kda = true;
      p.qkv32 = f32(R * 3 * HK);
      p.q_c = bf(R * HK);
      p.k_c = bf(R * HK);
      p.v_c = bf(R * HK);
      p.fa_c = bf(R * K);
      p.ga_c = bf(R * K);
      p.g_c = bf(R * HK);
      p.gate32 = f32(R * HK);
      p.b_c = bf(R * H);
      p.kda_o_c = bf(R * HK);
    } else {
      any_mla = true;
      p.q_c = bf(R * MH * qk);
      p.k_c = bf(R * MH * qk);
      p.v_c = bf(R * MH * mv);
      p.rows32 = f32(R * row);
      p.lat32 = f32(R * lat);
      p.inv_lat = f32(R);
      p.latn_c = bf(R * lat);
      p.lse = f32(R * MH);
      if (c.q_lora_rank > 0) {
        p.q_lat32 = f32(R * c.q_lora_rank);
        p.inv_q_lat = f32(R);
        p.q_latn_c = bf(R * c.q_lora_rank);
      }
    }
    if (L.moe) {
      any_moe = true;
      p.m32 = f32(R * D);
      p.logits32 = f32(R * E);
      p.ids = f32(pairs);
      p.weights = f32(pairs);
      p.index = f32(3 * pairs);
      p.xg_c = bf(pairs * D);
      p.eup32 = f32(pairs * 2 * I);
      p.eact_c = bf(pairs * I);
      if (Is > 0) {
        p.sh_up32 = f32(R * 2 * Is);
        p.sh_act_c = bf(R * Is);
      }
    } else {
      p.up32 = f32(R * 2 * F);
      p.act_c = bf(R * F);
    }
    a->layers.push_back(std::move(p));
  }
  a->invf = f32(R);
  a->hf_c = bf(R * D);
  a->logits = f32(R * V);
  a->dh = f32(R * D);
  a->dtmp = f32(R * D);
  a->dan = f32(R * D);
  int64_t dy_width = std::max({V, 2 * F, D, widest_o});
  int64_t d32_width = std::max<int64_t>(F, 1);
  if (any_kda) {
    dy_width = std::max({dy_width, HK, K});
    d32_width = std::max({d32_width, HK, K});
  }
  if (any_mla) dy_width = std::max({dy_width, MH * (nope + mv), row, c.q_lora_rank});
  if (any_moe) {
    dy_width = std::max(dy_width, 2 * Is);
    d32_width = std::max(d32_width, Is);
  }
  a->dy_c = bf(R * dy_width);
  a->d32a = f32(R * d32_width);
  a->do_c = bf(R * widest_o);
  if (any_kda) {
    a->dq_c = bf(R * HK);
    a->dk_c = bf(R * HK);
    a->dv_c = bf(R * HK);
    a->dg_c = bf(R * HK);
    a->db_c = bf(R * H);
    a->dA = f32(H);
    a->ddt = f32(HK);
    a->dko_c = bf(R * HK);
    a->dgate_c = bf(R * HK);
  }
  if (any_mla) {
    a->dqm_c = bf(R * MH * qk);
    a->dkm_c = bf(R * MH * qk);
    a->dvm_c = bf(R * MH * mv);
    a->dkeys32 = f32(R * MH * qk);
    a->dvalues32 = f32(R * MH * mv);
    a->dkvb32 = f32(R * MH * (nope + mv));
    a->drows32 = f32(R * row);
    a->dlat32 = f32(R * lat);
    if (c.q_lora_rank > 0) a->dq_lat32 = f32(R * c.q_lora_rank);
    // rope_sum[h qk + nope + r, r] = 1: d(k_rope) = sum over heads of their rope-key gradients
    std::vector<float> sum(size_t(MH * qk * rope), 0.0f);
    for (int64_t h = 0; h < MH; ++h)
      for (int64_t r = 0; r < rope; ++r) sum[size_t((h * qk + nope + r) * rope + r)] = 1;
    a->rope_sum = f32(MH * qk * rope);
    if (!sum.empty()) a->rope_sum.upload(sum.data(), sum.size() * 4);
  }
  if (any_moe) {
    a->eo32 = f32(pairs * D);
    a->dyg_c = bf(pairs * D);
    a->wh_c = bf(pairs * I);
    a->g32 = f32(pairs * I);
    a->dup_c = bf(pairs * 2 * I);
    a->dweights = f32(pairs);
    a->dlogits = f32(R * E);
  }
  acts_ = std::move(a);
}

size_t KimiCudaModel::workspace_bytes(int64_t B, int64_t T, bool backward) const {
  const model::KimiLinearConfig& c = c_;
  const int64_t R = B * T;
  const bool packed = !cu_seqlens_.empty();
  size_t workspace = 256;
  for (size_t li = 0; li < layers_.size(); ++li) {
    const Layer& L = layers_[li];
    if (L.kda) {
      const ops::DeltaRuleShape shape{
          packed ? 1 : B, packed ? R : T, c.kda_heads,        c.kda_heads,
          c.kda_head_dim, c.kda_head_dim, ops::Gate::channel, 0};
      // (training that keeps the forward: the layer's own PerLayer::chunk_ws, sized in
      // forward_backward)
      workspace = std::max(workspace, k::chunk_forward_workspace_bytes(shape, cu_seqlens_));
      if (backward && !keep_chunk_forward_for_backward())
        workspace = std::max(workspace, k::chunk_backward_workspace_bytes(shape, cu_seqlens_));
      continue;
    }
    const PerLayer& P = acts_->layers[li];
    for_each_attention(B, T, cu_seqlens_, [&](int64_t, int64_t len, int64_t batch) {
      k::AttentionArgs args;
      args.dtype = kBf16;
      args.Tq = args.Tk = len;
      args.Hq = args.Hkv = c.mla_heads;
      args.Dk = c.mla_qk_dim();
      args.Dv = c.v_head_dim;
      args.q = P.q_c.data();
      args.k = P.k_c.data();
      args.v = P.v_c.data();
      args.o_bf16 = P.o_c.data();
      args.lse = P.lse.as<float>();  // set, as the calls have it (the direct path)
      args.batch = batch;
      workspace = std::max({workspace, k::attention_workspace_bytes(args),
                            backward ? k::attention_backward_workspace_bytes(args) : size_t(0)});
    });
  }
  return workspace;
}

void KimiCudaModel::dense_forward(Layer& L, PerLayer& P, float* y) {
  k::Gemm& gemm = engines_->gemm;
  const int64_t R = acts_->R, D = c_.hidden_size, F = c_.dense_intermediate;
  gemm.linear(kBf16, R, F, D, {P.m_c.data(), D}, {L.gate->compute(), D},
              {P.up32.data(), kF32, 2 * F});
  gemm.linear(kBf16, R, F, D, {P.m_c.data(), D}, {L.up->compute(), D},
              {offset(P.up32, F, 4), kF32, 2 * F});
  k::swiglu(P.up32.as<float>(), R, F, {P.act_c.data(), kBf16}, stream_);
  gemm.linear(kBf16, R, D, F, {P.act_c.data(), F}, {L.down->compute(), F}, {y, kF32}, 1.f, 1.f);
}

void KimiCudaModel::dense_backward(Layer& L, PerLayer& P, const float* dy, float* dx) {
  Activations& a = *acts_;
  k::Gemm& gemm = engines_->gemm;
  auto& wgrad = engines_->wgrad;
  const cudaStream_t s = stream_;
  const int64_t R = a.R, D = c_.hidden_size, F = c_.dense_intermediate;
  k::convert(dy, kF32, a.dy_c.data(), kBf16, R * D, s);
  linear_backward(gemm, wgrad, R, F, D, a.dy_c.data(), D, P.act_c.data(), F, *L.down,
                  {a.d32a.data(), kF32}, false);
  k::swiglu_backward(P.up32.as<float>(), a.d32a.as<float>(), R, F, a.dy_c.data(), kBf16, s);
  linear_backward(gemm, wgrad, R, D, F, a.dy_c.data(), 2 * F, P.m_c.data(), D, *L.gate, {dx, kF32},
                  false);
  linear_backward(gemm, wgrad, R, D, F, offset(a.dy_c, F, 2), 2 * F, P.m_c.data(), D, *L.up,
                  {dx, kF32}, true);
}

StepResult KimiCudaModel::forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B,
                                           int64_t T, bool backward,
                                           std::span<const int64_t> cu_seqlens) {
  const model::KimiLinearConfig& c = c_;
  const int64_t D = c.hidden_size, V = c.vocab_size, R = B * T, NL = int64_t(layers_.size());
  begin_step(inputs, targets, B, T, cu_seqlens, V, "kimi_linear (cuda)");
  ensure_activations(R);
  Activations& a = *acts_;
  k::Gemm& gemm = engines_->gemm;
  auto& wgrad = engines_->wgrad;
  k::TrainScratch& scratch = engines_->scratch;
  const cudaStream_t s = stream_;
  const float eps = float(c.rms_norm_eps);
  {  // the workspace for this call's shapes (grown before anything is queued)
    const size_t need = workspace_bytes(B, T, backward);
    if (need > a.workspace.bytes()) {
      check_cuda(cudaStreamSynchronize(s), "kimi_linear (cuda): workspace");
      a.workspace.resize(need);
    }
    const bool keep = backward && keep_chunk_forward_for_backward();
    for (size_t li = 0; keep && li < layers_.size(); ++li) {
      if (!layers_[li].kda) continue;  // KDA: its own workspace, kept from forward to backward
      const bool packed = !cu_seqlens_.empty();
      const ops::DeltaRuleShape shape{
          packed ? 1 : B, packed ? R : T, c.kda_heads,        c.kda_heads,
          c.kda_head_dim, c.kda_head_dim, ops::Gate::channel, 0};
      reserve_chunk_workspace(a.layers[li].chunk_ws,
                              k::chunk_backward_workspace_bytes(shape, cu_seqlens_), s);
    }
    keep_chunk_forward_ = keep;
  }
  check_cuda(cudaMemcpyAsync(a.ids.data(), inputs, size_t(R) * 4, cudaMemcpyHostToDevice, s),
             "cudaMemcpyAsync (ids)");
  check_cuda(cudaMemcpyAsync(a.targets.data(), targets, size_t(R) * 4, cudaMemcpyHostToDevice, s),
             "cudaMemcpyAsync (targets)");
  k::sequence_positions(cu_seqlens_, B, T, a.positions.as<int32_t>(), s);

  // ---- forward ----
  Entry& embed = params_->at("model.embed_tokens.weight");
  Entry& final_norm = params_->at("model.norm.weight");
  Entry& lm_head = params_->at("lm_head.weight");
  k::embedding(a.ids.as<int32_t>(), R, embed.value.data(), nullptr, 0, kF32, D, a.h[0].as<float>(),
               s);
  for (int64_t l = 0; l < NL; ++l) {
    Layer& L = layers_[size_t(l)];
    PerLayer& P = a.layers[size_t(l)];
    float* x_in = a.h[size_t(2 * l)].as<float>();
    float* x_mid = a.h[size_t(2 * l + 1)].as<float>();
    float* x_out = a.h[size_t(2 * l + 2)].as<float>();
    k::rms_norm_forward_train(x_in, R, D, L.norm1->f(), eps, {P.a_c.data(), kBf16},
                              P.inv1.as<float>(), s);
    if (L.kda)
      kda_forward(L, P, B, T);
    else
      mla_forward(L, P, B, T);
    // x_mid = x_in + o o_proj^T in one pass (x_in stays: the norm backward reads it)
    gemm.linear_add(kBf16, R, D, L.o_width, {P.o_c.data(), L.o_width},
                    {L.o_proj->compute(), L.o_width}, {x_in}, {x_mid, kF32});
    copy_device(x_out, x_mid, size_t(R * D) * 4, s);
    if (L.moe) {  // the router reads the normed rows in fp32
      k::rms_norm_forward_train(x_mid, R, D, L.norm2->f(), eps, {P.m32.data(), kF32},
                                P.inv2.as<float>(), s);
      k::convert(P.m32.data(), kF32, P.m_c.data(), kBf16, R * D, s);
      moe_forward(L, P, x_out, true);
    } else {
      k::rms_norm_forward_train(x_mid, R, D, L.norm2->f(), eps, {P.m_c.data(), kBf16},
                                P.inv2.as<float>(), s);
      dense_forward(L, P, x_out);
    }
  }
  const float* x_final = a.h[size_t(2 * NL)].as<float>();
  k::rms_norm_forward_train(x_final, R, D, final_norm.f(), eps, {a.hf_c.data(), kBf16},
                            a.invf.as<float>(), s);
  float* logits = a.logits.as<float>();
  gemm.linear(kBf16, R, V, D, {a.hf_c.data(), D}, {lm_head.compute(), D}, {logits, kF32});
  float* loss_sum = a.result.as<float>();
  int32_t* correct = offset<int32_t>(a.result, 1, 4);
  int32_t* scored = offset<int32_t>(a.result, 2, 4);
  k::cross_entropy_forward_backward(logits, kF32, a.targets.as<int32_t>(), R, V, logits, kF32,
                                    loss_sum, correct, scored, scratch, s);
  if (!backward) {  // evaluation passes do not count toward expert balancing (as on the CPU)
    for (Layer& L : layers_) std::fill(L.load.begin(), L.load.end(), 0);
  } else {
    float* dh = a.dh.as<float>();
    float* dtmp = a.dtmp.as<float>();
    float* dan = a.dan.as<float>();
    k::convert(logits, kF32, a.dy_c.data(), kBf16, R * V, s);
    linear_backward(gemm, wgrad, R, D, V, a.dy_c.data(), V, a.hf_c.data(), D, lm_head, {dtmp, kF32},
                    false);
    k::rms_norm_backward(x_final, dtmp, R, D, final_norm.f(), a.invf.as<float>(), dh,
                         final_norm.g(), scratch, s);
    for (int64_t l = NL - 1; l >= 0; --l) {
      Layer& L = layers_[size_t(l)];
      PerLayer& P = a.layers[size_t(l)];
      const float* x_in = a.h[size_t(2 * l)].as<float>();
      const float* x_mid = a.h[size_t(2 * l + 1)].as<float>();
      // feed-forward (dh: the gradient of x_out) -> dtmp: the gradient of its normed input
      if (L.moe)
        moe_backward(L, P, dh, dtmp);
      else
        dense_backward(L, P, dh, dtmp);
      k::rms_norm_backward(x_mid, dtmp, R, D, L.norm2->f(), P.inv2.as<float>(), dh, L.norm2->g(),
                           scratch, s, /*accumulate_dx=*/true);
      // mixer (dh: the gradient of x_mid): the output projection, then the mixer into dan
      k::convert(dh, kF32, a.dy_c.data(), kBf16, R * D, s);
      linear_backward(gemm, wgrad, R, L.o_width, D, a.dy_c.data(), D, P.o_c.data(), L.o_width,
                      *L.o_proj, {a.do_c.data(), kBf16}, false);
      if (L.kda)
        kda_backward(L, P, B, T);
      else
        mla_backward(L, P, B, T);
      k::rms_norm_backward(x_in, dan, R, D, L.norm1->f(), P.inv1.as<float>(), dh, L.norm1->g(),
                           scratch, s, /*accumulate_dx=*/true);
    }
    k::embedding_backward(a.ids.as<int32_t>(), dh, R, D, V, embed.g(), scratch, s);
  }
  return read_step_result(a.result, "kimi_linear (cuda): step");
}

}  // namespace kda::train::cuda
