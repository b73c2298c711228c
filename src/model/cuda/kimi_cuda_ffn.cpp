// The feed-forward of a Kimi Linear layer on the GPU (model/kimi_moe_block.cpp's steps): a dense
// SwiGLU MLP, or the MoE: shared expert(s) as a dense MLP, plus the routed experts
// (ops/moe/cuda) accumulated on top.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/error.h"
#include "model/cuda/device_tensor.h"
#include "model/cuda/kimi_cuda_blocks.h"
#include "ops/nn/cuda/nn_cuda.h"

namespace kda::model::cuda {
namespace {

// y [T, D] = down(silu(gate x) * up x)
void swiglu_mlp(const DeviceBuffer& gate_up, const DeviceBuffer& down, int64_t D, int64_t I,
                const void* xc, int64_t T, float* y, Context& ctx) {
  float* gu = take(ctx.s.hidden, T * 2 * I);
  ctx.gemm.linear(ctx.type, T, 2 * I, D, {xc, D}, {gate_up.data(), D}, {gu, ElementType::f32});
  void* act = take<char>(ctx.s.lowrank, T * I, ctx.esize());
  ops::cuda::swiglu(gu, T, I, {act, ctx.type}, ctx.stream());
  ctx.gemm.linear(ctx.type, T, D, I, {act, I}, {down.data(), I}, {y, ElementType::f32});
}

// Experts' matrices stacked [E, rows, cols] in one device buffer.
DeviceBuffer upload_stacked(const std::vector<Tensor>& parts, ElementType type) {
  std::vector<float> all;
  for (const Tensor& t : parts) all.insert(all.end(), t.f32(), t.f32() + t.numel());
  return upload(std::span<const float>(all), type);
}

// KDA_CUDA_PROFILE: how a prefill's tokens spread over the experts, and the input's range.
void report_routing(const KimiLinearConfig& c, const float* x32, int64_t T, Context& ctx) {
  const int64_t k = c.top_k, E = c.num_experts;
  std::vector<int32_t> ids(static_cast<size_t>(T * k));
  ops::cuda::check_cuda(
      cudaMemcpy(ids.data(), ctx.s.moe.ids.data(), ids.size() * 4, cudaMemcpyDeviceToHost),
      "routing report");
  const std::vector<float> x = download_f32(x32, T * c.hidden_size);
  std::vector<int64_t> load(static_cast<size_t>(E), 0);
  for (const int32_t id : ids) load[size_t(id)]++;
  int64_t used = 0, top = 0;
  for (const int64_t l : load) used += l > 0, top = std::max(top, l);
  float lo = 0, hi = 0;
  bool finite = true;
  for (const float v : x)
    lo = std::min(lo, v), hi = std::max(hi, v), finite = finite && std::isfinite(v);
  std::fprintf(stderr,
               "PROFILE moe T=%lld: %lld of %lld experts used, busiest %lld pairs (mean %.0f); x "
               "in [%g, %g]%s\n",
               (long long)T, (long long)used, (long long)E, (long long)top,
               double(T * k) / double(E), lo, hi, finite ? "" : " NON-FINITE");
}

}  // namespace

FfnDeviceWeights upload_ffn(const KimiLinearConfig& c, int64_t layer, const kimi::FfnWeights& w,
                            ElementType type) {
  FfnDeviceWeights d;
  d.moe = w.moe;
  if (!w.gate_up.empty()) {
    d.gate_up = upload(w.gate_up, type);
    d.down = upload(w.down, type);
    d.shared_intermediate = w.gate_up.dim(0) / 2;
  }
  if (!w.moe) return d;
  d.router = upload(w.router, ElementType::f32);
  d.correction_bias = upload(w.correction_bias, ElementType::f32);
  d.expert_gate_up = upload_stacked(w.expert_gate_up, type);
  d.expert_down = upload_stacked(w.expert_down, type);
  d.routing = kimi::moe_routing(c);
  return d;
}

FfnDeviceWeights random_ffn(const KimiLinearConfig& c, int64_t layer, ElementType type,
                            uint64_t seed) {
  const int64_t D = c.hidden_size;
  FfnDeviceWeights d;
  d.moe = c.ffns[layer] == KimiFfn::moe;
  const int64_t I = d.moe ? c.moe_intermediate * c.num_shared_experts : c.dense_intermediate;
  if (I > 0) {
    d.shared_intermediate = I;
    d.gate_up = random_weights(2 * I * D, type, 1.f / std::sqrt(float(D)), seed + 1);
    d.down = random_weights(D * I, type, 1.f / std::sqrt(float(I)), seed + 2);
  }
  if (!d.moe) return d;
  const int64_t E = c.num_experts, Ie = c.moe_intermediate;
  d.router = random_weights(E * D, ElementType::f32, 1.f / std::sqrt(float(D)), seed + 3);
  d.correction_bias = upload_f32(std::vector<float>(size_t(E), 0.f));
  d.expert_gate_up = random_weights(E * 2 * Ie * D, type, 1.f / std::sqrt(float(D)), seed + 4);
  d.expert_down = random_weights(E * D * Ie, type, 1.f / std::sqrt(float(Ie)), seed + 5);
  d.routing = kimi::moe_routing(c);
  return d;
}

void ffn_forward(const KimiLinearConfig& c, const FfnDeviceWeights& w, const float* x32,
                 const void* xc, int64_t T, float* y, Context& ctx) {
  const int64_t D = c.hidden_size;
  if (w.shared_intermediate > 0) {
    swiglu_mlp(w.gate_up, w.down, D, w.shared_intermediate, xc, T, y, ctx);
  } else {
    ops::cuda::check_cuda(cudaMemsetAsync(y, 0, size_t(T * D) * 4, ctx.stream()),
                          "cudaMemsetAsync (ffn)");
  }
  if (!w.moe) {
    ctx.timer.mark(ctx.stream(), T == 1 ? "ffn decode dense" : "ffn dense");
    return;
  }
  ctx.timer.mark(ctx.stream(), T == 1 ? "ffn decode shared" : "ffn shared");
  ops::cuda::MoeDeviceWeights m;
  m.D = D;
  m.I = c.moe_intermediate;
  m.router = w.router.as<float>();
  m.correction_bias = w.correction_bias.as<float>();
  m.expert_type = ctx.type;
  m.gate_up = w.expert_gate_up.data();
  m.down = w.expert_down.data();
  ops::cuda::moe_routed_forward(w.routing, m, x32, xc, T, y, ctx.s.moe, ctx.gemm);
  if (ctx.timer.enabled() && T > 16) report_routing(c, x32, T, ctx);
}

DeviceBuffer random_weights(int64_t n, ElementType type, float scale, uint64_t seed) {
  DeviceBuffer b(size_t(n) * ops::cuda::element_bytes(type));
  ops::cuda::fill_uniform(b.data(), type, n, scale, seed, nullptr);
  return b;
}

DeviceBuffer upload_f32(const std::vector<float>& values) {
  return upload(std::span<const float>(values), ElementType::f32);
}

}  // namespace kda::model::cuda
