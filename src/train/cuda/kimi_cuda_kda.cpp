// Kimi's KDA mixer on the GPU, train/kimi_kda_train.cpp's math:
//   q, k, v = silu(conv(x W_{q,k,v}^T)) per document (conv state zero at every document start)
//   graw = (x f_a^T) f_b^T;  beta_raw = x b^T;  out_gate = (x g_a^T) g_b^T
//   o = KDA(q, k, v; gate(graw; A_log, dt_bias), sigmoid(beta_raw))  (the chunked kernel applies
//       the q / k L2 norm, the gate and beta's sigmoid itself, and differentiates through them)
//   o_c = o_norm(o) * sigmoid(out_gate)   (the output projection is the caller's)
// and its backward into every weight.
#include "core/error.h"
#include "ops/delta_rule/cuda/delta_rule_cuda.h"
#include "ops/nn/cuda/gated_norm_train_cuda.h"
#include "ops/nn/cuda/nn_cuda.h"
#include "ops/nn/cuda/train_cuda.h"
#include "ops/nn/cuda/train_mixer_cuda.h"
#include "train/cuda/kimi_cuda_internal.h"

namespace kda::train::cuda {

using namespace kimi_detail;

namespace {

// The chunked kernel's call over what the forward keeps (bf16 q, k, v, graw, beta_raw).
k::DeltaRuleDeviceInputs kda_inputs(const model::KimiLinearConfig& c, const KimiCudaModel::Layer& L,
                                    const KimiCudaModel::PerLayer& P, int64_t B, int64_t T,
                                    std::span<const int64_t> cu) {
  const bool packed = !cu.empty();
  const int64_t H = c.kda_heads, K = c.kda_head_dim;
  k::DeltaRuleDeviceInputs in;
  in.shape = {packed ? 1 : B, packed ? B * T : T, H, H, K, K, ops::Gate::channel, 0};
  in.dtype = kBf16;
  in.q = P.q_c.data();
  in.k = P.k_c.data();
  in.v = P.v_c.data();
  in.g = P.g_c.data();
  in.beta = P.b_c.data();
  in.cu_seqlens = cu;
  in.kda_layer.l2norm_qk = true;
  in.kda_layer.gate_in_kernel = true;
  if (c.forget_gate_lower_bound) {
    in.kda_layer.gate = ops::KdaGate::lower_bound;
    in.kda_layer.lower_bound = float(*c.forget_gate_lower_bound);
  } else {
    in.kda_layer.gate = ops::KdaGate::softplus;
  }
  in.kda_layer.A_log = L.A_log->f();
  in.kda_layer.dt_bias = L.dt_bias->f();
  in.kda_layer.beta_sigmoid = true;
  return in;
}

}  // namespace

void KimiCudaModel::kda_forward(Layer& L, PerLayer& P, int64_t B, int64_t T) {
  const model::KimiLinearConfig& c = c_;
  Activations& a = *acts_;
  k::Gemm& gemm = engines_->gemm;
  const cudaStream_t s = stream_;
  const int64_t R = a.R, D = c.hidden_size, H = c.kda_heads, K = c.kda_head_dim, HK = c.kda_width();
  const int32_t* positions = a.positions.as<int32_t>();
  // q, k, v projections: fp32 column blocks of qkv32 [R, 3 HK]; the convolutions into bf16
  const Entry* Wqkv[3] = {L.q, L.k, L.v};
  k::DeviceBuffer* conv_out[3] = {&P.q_c, &P.k_c, &P.v_c};
  for (int j = 0; j < 3; ++j) {
    gemm.linear(kBf16, R, HK, D, {P.a_c.data(), D}, {Wqkv[j]->compute(), D},
                {offset(P.qkv32, j * HK, 4), kF32, 3 * HK});
    k::short_conv_silu_train_forward(offset<float>(P.qkv32, j * HK, 4), positions, R, HK, 3 * HK,
                                     L.conv[j]->f(), c.conv_kernel, {conv_out[j]->data(), kBf16, 0},
                                     s);
  }
  // the low-rank forget gate (graw, activated in the kernel), the output gate, beta_raw
  gemm.linear(kBf16, R, K, D, {P.a_c.data(), D}, {L.f_a->compute(), D}, {P.fa_c.data(), kBf16});
  gemm.linear(kBf16, R, HK, K, {P.fa_c.data(), K}, {L.f_b->compute(), K}, {P.g_c.data(), kBf16});
  gemm.linear(kBf16, R, K, D, {P.a_c.data(), D}, {L.g_a->compute(), D}, {P.ga_c.data(), kBf16});
  gemm.linear(kBf16, R, HK, K, {P.ga_c.data(), K}, {L.g_b->compute(), K}, {P.gate32.data(), kF32});
  gemm.linear(kBf16, R, H, D, {P.a_c.data(), D}, {L.b->compute(), D}, {P.b_c.data(), kBf16});
  const k::DeltaRuleDeviceInputs in = kda_inputs(c, L, P, B, T, cu_seqlens_);
  chunk_forward_step(in, P.kda_o_c.data(), keep_chunk_forward_, P.chunk_ws, a.workspace, s);
  k::gated_rms_norm_sigmoid(P.kda_o_c.data(), kBf16, P.gate32.as<float>(), R * H, K, L.o_norm->f(),
                            float(c.rms_norm_eps), {P.o_c.data(), kBf16}, s);
}

void KimiCudaModel::kda_backward(Layer& L, PerLayer& P, int64_t B, int64_t T) {
  const model::KimiLinearConfig& c = c_;
  Activations& a = *acts_;
  k::Gemm& gemm = engines_->gemm;
  auto& wgrad = engines_->wgrad;
  const cudaStream_t s = stream_;
  const int64_t R = a.R, D = c.hidden_size, H = c.kda_heads, K = c.kda_head_dim, HK = c.kda_width();
  const int32_t* positions = a.positions.as<int32_t>();
  float* dan = a.dan.as<float>();
  // the output norm: d(kernel output) and d(output gate), both bf16 for what reads them next
  k::gated_rms_norm_sigmoid_train_backward(
      P.kda_o_c.data(), kBf16, P.gate32.as<float>(), R * H, K, L.o_norm->f(), float(c.rms_norm_eps),
      a.do_c.data(), kBf16, {a.dko_c.data(), kBf16}, {a.dgate_c.data(), kBf16}, L.o_norm->g(),
      engines_->norm_partials, s);
  // the kernel: gradients of the raw q, k (through the L2 norm), v, graw, beta_raw
  const k::DeltaRuleDeviceInputs in = kda_inputs(c, L, P, B, T, cu_seqlens_);
  k::DeltaRuleDeviceGrads grads;
  grads.dq = a.dq_c.data();
  grads.dk = a.dk_c.data();
  grads.dv = a.dv_c.data();
  grads.dg = a.dg_c.data();
  grads.dbeta = a.db_c.data();
  grads.dA_log = a.dA.as<float>();
  grads.ddt_bias = a.ddt.as<float>();
  chunk_backward_step(in, a.dko_c.data(), grads, keep_chunk_forward_, P.chunk_ws, a.workspace, s);
  k::add_inplace(L.A_log->g(), a.dA.as<float>(), H, s);  // the kernel overwrites; grads add up
  k::add_inplace(L.dt_bias->g(), a.ddt.as<float>(), HK, s);
  // the convolutions back to the q, k, v projections (dan written by the first, then added)
  const Entry* Wqkv[3] = {L.q, L.k, L.v};
  const k::DeviceBuffer* dqkv[3] = {&a.dq_c, &a.dk_c, &a.dv_c};
  float* dpre = a.d32a.as<float>();
  for (int j = 0; j < 3; ++j) {
    k::short_conv_silu_train_backward(offset<float>(P.qkv32, j * HK, 4), positions, R, HK, 3 * HK,
                                      L.conv[j]->f(), c.conv_kernel, dqkv[j]->data(), kBf16, dpre,
                                      L.conv[j]->g(), engines_->scratch, s);
    k::convert(dpre, kF32, a.dy_c.data(), kBf16, R * HK, s);
    linear_backward(gemm, wgrad, R, D, HK, a.dy_c.data(), HK, P.a_c.data(), D, *Wqkv[j],
                    {dan, kF32}, j > 0);
  }
  // the forget gate's low-rank pair: f_b (from dgraw), then f_a
  float* dlow = a.d32a.as<float>();
  linear_backward(gemm, wgrad, R, K, HK, a.dg_c.data(), HK, P.fa_c.data(), K, *L.f_b, {dlow, kF32},
                  false);
  k::convert(dlow, kF32, a.dy_c.data(), kBf16, R * K, s);
  linear_backward(gemm, wgrad, R, D, K, a.dy_c.data(), K, P.a_c.data(), D, *L.f_a, {dan, kF32},
                  true);
  // the output gate's pair: g_b, then g_a
  linear_backward(gemm, wgrad, R, K, HK, a.dgate_c.data(), HK, P.ga_c.data(), K, *L.g_b,
                  {dlow, kF32}, false);
  k::convert(dlow, kF32, a.dy_c.data(), kBf16, R * K, s);
  linear_backward(gemm, wgrad, R, D, K, a.dy_c.data(), K, P.a_c.data(), D, *L.g_a, {dan, kF32},
                  true);
  // beta
  linear_backward(gemm, wgrad, R, D, H, a.db_c.data(), H, P.a_c.data(), D, *L.b, {dan, kF32}, true);
}

}  // namespace kda::train::cuda
