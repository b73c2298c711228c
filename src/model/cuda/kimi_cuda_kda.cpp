// The KDA mixer of a Kimi Linear layer on the GPU; the same steps as model/kimi_kda_block.cpp:
//   proj = [q | k | v | f_a | g_a | b] x            one GEMM over the stacked projections
//   q, k, v = SiLU(short conv(proj))                 conv windows carried per sequence
//   q, k <- q, k * rsqrt(sum(x^2) + 1e-6)           transformers' l2norm
//   graw = f_b f_a x, gate = g_b g_a x              the two low-rank products
//   o = KDA(q, k, v, graw, b; A_log, dt_bias)       chunked kernel, or the fused decode step
//   y = o_proj(RMSNorm(o) * o_norm * sigmoid(gate))
//
// Which KDA kernel: bf16 prefills (either gate: the chunks where the softplus gate decays past the
// tensor-core split are redone in fp32 inside it, ops/delta_rule/cuda/delta_rule_cuda.h) run the
// chunked kernel with the gate and beta activated inside it; head sizes other than 64 / 128, fp32
// models and every decode step take the fp32 path (gate and beta activated by nn kernels,
// the fp32 recurrent kernel or the fused decode step).
#include <cmath>

#include "core/error.h"
#include "model/cuda/device_tensor.h"
#include "model/cuda/kimi_cuda_blocks.h"
#include "ops/delta_rule/cuda/delta_rule_cuda.h"
#include "ops/nn/cuda/nn_cuda.h"

namespace kda::model::cuda {
namespace {

namespace k = ops::cuda;

constexpr float kQkL2NormEps = 1e-6f;

// A chunked prefill over T tokens from the state's current value; the final state replaces it.
void chunk_prefill(k::DeltaRuleDeviceInputs in, void* o, KdaDeviceState& state, Context& ctx) {
  auto& s = ctx.s;
  in.h0 = state.recurrent.as<float>();
  const size_t ws = k::chunk_forward_workspace_bytes(in.shape, {});
  float* final_state = take(s.state, int64_t(state.recurrent.bytes() / 4));
  k::chunk_forward(in, o, final_state, take<char>(s.workspace, int64_t(ws), 1), ws, ctx.stream());
  k::check_cuda(cudaMemcpyAsync(state.recurrent.data(), final_state, state.recurrent.bytes(),
                                cudaMemcpyDeviceToDevice, ctx.stream()),
                "cudaMemcpyAsync (KDA state)");
}

float gate_lower_bound(const KimiLinearConfig& c) {
  return c.forget_gate_lower_bound ? float(*c.forget_gate_lower_bound) : 0.f;
}

}  // namespace

KdaDeviceWeights upload_kda(const kimi::KdaWeights& w, ElementType type) {
  KdaDeviceWeights d;
  d.in_proj = upload(w.in_proj, type);
  d.conv = upload(w.conv, ElementType::f32);
  d.f_b = upload(w.f_b, type);
  d.g_b = upload(w.g_b, type);
  d.A_log = upload(w.A_log, ElementType::f32);
  d.dt_bias = upload(w.dt_bias, ElementType::f32);
  d.o_norm = upload(w.o_norm, ElementType::f32);
  d.o_proj = upload(w.o_proj, type);
  return d;
}

KdaDeviceWeights random_kda(const KimiLinearConfig& c, ElementType type, uint64_t seed) {
  const int64_t D = c.hidden_size, H = c.kda_heads, K = c.kda_head_dim, HK = c.kda_width();
  const int64_t width = 3 * HK + 2 * K + H;
  const float in_scale = 1.f / std::sqrt(float(D));
  KdaDeviceWeights d;
  d.in_proj = random_weights(width * D, type, in_scale, seed + 1);
  d.conv = random_weights(3 * HK * c.conv_kernel, ElementType::f32, 0.5f, seed + 2);
  d.f_b = random_weights(HK * K, type, 1.f / std::sqrt(float(K)), seed + 3);
  d.g_b = random_weights(HK * K, type, 1.f / std::sqrt(float(K)), seed + 4);
  // fla's init: A = uniform(1, 16) (A_log = log A), dt in [1e-3, 1e-1] as softplus(dt_bias).
  std::vector<float> A_log(static_cast<size_t>(H)), dt_bias(static_cast<size_t>(HK));
  const std::vector<float> ones(static_cast<size_t>(K), 1.f);
  for (int64_t h = 0; h < H; ++h) A_log[h] = std::log(1.f + 15.f * float(h) / float(H));
  for (int64_t i = 0; i < HK; ++i) {
    const float dt = 1e-3f * std::pow(100.f, float(i % 97) / 96.f);
    dt_bias[i] = dt + std::log(-std::expm1(-dt));  // inverse softplus
  }
  d.A_log = upload_f32(A_log);
  d.dt_bias = upload_f32(dt_bias);
  d.o_norm = upload_f32(ones);
  d.o_proj = random_weights(D * HK, type, 1.f / std::sqrt(float(HK)), seed + 5);
  return d;
}

KdaDeviceState new_kda_device_state(const KimiLinearConfig& c) {
  KdaDeviceState s;
  const int64_t K = c.kda_head_dim;
  s.recurrent.resize(size_t(c.kda_heads * K * K) * 4);
  s.conv.resize(size_t(3 * (c.conv_kernel - 1) * c.kda_width()) * 4);
  ops::cuda::check_cuda(cudaMemset(s.recurrent.data(), 0, s.recurrent.bytes()), "cudaMemset");
  ops::cuda::check_cuda(cudaMemset(s.conv.data(), 0, s.conv.bytes()), "cudaMemset");
  return s;
}

void kda_forward(const KimiLinearConfig& c, const KdaDeviceWeights& w, const void* xc, int64_t T,
                 KdaDeviceState& state, float* y, Context& ctx) {
  const int64_t D = c.hidden_size, H = c.kda_heads, K = c.kda_head_dim, HK = c.kda_width();
  const int64_t W = c.conv_kernel, width = 3 * HK + 2 * K + H;
  const ElementType type = ctx.type;
  const cudaStream_t stream = ctx.stream();
  auto& s = ctx.s;

  float* proj = take(s.proj, T * width);
  ctx.gemm.linear(type, T, width, D, {xc, D}, {w.in_proj.data(), D}, {proj, ElementType::f32});

  float* qkv[3] = {take(s.q, T * HK), take(s.k, T * HK), take(s.v, T * HK)};
  for (int part = 0; part < 3; ++part) {
    k::short_conv_silu(proj + part * HK, T, HK, width, w.conv.as<float>() + part * HK * W, W,
                       state.conv.as<float>() + part * (W - 1) * HK, {qkv[part]}, stream);
  }
  // The two low-rank products read f_a x and g_a x (adjacent columns of proj) in the GEMM type.
  void* lowrank = take<char>(s.lowrank, T * 2 * K, ctx.esize());
  k::copy_rows(proj + 3 * HK, T, 2 * K, width, {lowrank, type}, stream);
  float* graw = take(s.graw, T * HK);
  float* gate = take(s.gate, T * HK);
  const char* lowrank_bytes = static_cast<const char*>(lowrank);
  ctx.gemm.linear(type, T, HK, K, {lowrank, 2 * K}, {w.f_b.data(), K}, {graw, ElementType::f32});
  ctx.gemm.linear(type, T, HK, K, {lowrank_bytes + K * ctx.esize(), 2 * K}, {w.g_b.data(), K},
                  {gate, ElementType::f32});
  const float* braw = proj + 3 * HK + 2 * K;  // [T, H], row stride width

  const ops::DeltaRuleShape shape = kimi::kda_delta_shape(c, T);
  const bool chunked_bf16 = type == ElementType::bf16 && T > 1 && (K == 64 || K == 128);
  const ElementType o_type = chunked_bf16 ? ElementType::bf16 : ElementType::f32;
  void* o = take<char>(s.attn, T * HK, k::element_bytes(o_type));
  if (chunked_bf16) {
    void* qc = take<char>(s.qc, T * HK, 2);
    void* kc = take<char>(s.kc, T * HK, 2);
    void* vc = take<char>(s.vc, T * HK, 2);
    void* gc = take<char>(s.g, T * HK, 2);
    void* bc = take<char>(s.beta, T * H, 2);
    k::l2_normalize_rows(qkv[0], T * H, K, kQkL2NormEps, {qc, ElementType::bf16}, stream);
    k::l2_normalize_rows(qkv[1], T * H, K, kQkL2NormEps, {kc, ElementType::bf16}, stream);
    k::convert(qkv[2], ElementType::f32, vc, ElementType::bf16, T * HK, stream);
    k::convert(graw, ElementType::f32, gc, ElementType::bf16, T * HK, stream);
    k::copy_rows(braw, T, H, width, {bc, ElementType::bf16}, stream);
    k::DeltaRuleDeviceInputs in;
    in.shape = shape;
    in.dtype = ElementType::bf16;
    in.q = qc;
    in.k = kc;
    in.v = vc;
    in.g = gc;
    in.beta = bc;
    in.kda_layer.gate_in_kernel = true;
    in.kda_layer.gate =
        c.forget_gate_lower_bound ? ops::KdaGate::lower_bound : ops::KdaGate::softplus;
    if (c.forget_gate_lower_bound) in.kda_layer.lower_bound = gate_lower_bound(c);
    in.kda_layer.A_log = w.A_log.as<float>();
    in.kda_layer.dt_bias = w.dt_bias.as<float>();
    in.kda_layer.beta_sigmoid = true;
    chunk_prefill(in, o, state, ctx);
  } else {
    // fp32 path: activations by the nn kernels, then the exact fp32 kernels.
    float* q = take(s.qc, T * HK);
    float* kk = take(s.kc, T * HK);
    float* g = take(s.g, T * HK);
    float* beta = take(s.beta, T * H);
    k::l2_normalize_rows(qkv[0], T * H, K, kQkL2NormEps, {q}, stream);
    k::l2_normalize_rows(qkv[1], T * H, K, kQkL2NormEps, {kk}, stream);
    k::kda_gate(graw, T, H, K, HK, w.A_log.as<float>(), w.dt_bias.as<float>(), gate_lower_bound(c),
                g, stream);
    k::sigmoid(braw, T, H, width, beta, stream);
    if (T == 1) {
      int32_t* slot = take<int32_t>(s.slot, 1);
      k::check_cuda(cudaMemsetAsync(slot, 0, 4, stream), "cudaMemsetAsync (slot)");
      k::DecodeArgs a;
      a.shape = shape;
      a.dtype = ElementType::f32;
      a.q = q;
      a.k = kk;
      a.v = qkv[2];
      a.g = g;
      a.beta = beta;
      a.state_pool = state.recurrent.as<float>();
      a.slots = slot;
      a.num_slots = 1;
      a.o = o;
      k::decode_step(a, stream);
    } else {
      k::DeltaRuleDeviceInputs in;
      in.shape = shape;
      in.dtype = ElementType::f32;
      in.q = q;
      in.k = kk;
      in.v = qkv[2];
      in.g = g;
      in.beta = beta;
      chunk_prefill(in, o, state, ctx);
    }
  }
  void* normed = take<char>(s.normed, T * HK, ctx.esize());
  k::gated_rms_norm_sigmoid(o, o_type, gate, T * H, K, w.o_norm.as<float>(), float(c.rms_norm_eps),
                            {normed, type}, stream);
  ctx.gemm.linear(type, T, D, HK, {normed, HK}, {w.o_proj.data(), HK}, {y, ElementType::f32});
}

}  // namespace kda::model::cuda
