// Kimi's mixture of experts on the GPU, train/moe_layer.cpp's math:
//   s = sigmoid(x Wr^T) (fp32);  idx = top_k(s + bias);  w = s[idx] (/ (sum + 1e-20)) * scaling
//   y = sum_j w_j W2_j (silu(W1_j x) * W3_j x) + shared(x)
// The router runs in fp32 and routes on the device (ops/moe/cuda/moe_cuda.h's moe_route); the
// top-k ids then come to the host (one synchronisation per layer and pass), which counts the
// expert load and groups the (token, slot) pairs by expert in token order (a counting sort, as
// the CPU). Each used expert runs three cuBLAS products over its gathered rows; each token sums
// its slots in slot order (no atomics). The backward reverses it, through the routing weights,
// their renormalisation and the sigmoid into the router.
#include <algorithm>

#include "core/error.h"
#include "model/kimi_linear_blocks.h"
#include "ops/moe/cuda/moe_cuda.h"
#include "ops/moe/cuda/moe_train_cuda.h"
#include "ops/nn/cuda/nn_cuda.h"
#include "ops/nn/cuda/train_cuda.h"
#include "train/cuda/kimi_cuda_internal.h"

namespace kda::train::cuda {

using namespace kimi_detail;

void KimiCudaModel::moe_forward(Layer& L, PerLayer& P, float* y, bool count_load) {
  const model::KimiLinearConfig& c = c_;
  Activations& a = *acts_;
  k::Gemm& gemm = engines_->gemm;
  const cudaStream_t s = stream_;
  const int64_t R = a.R, D = c.hidden_size, E = c.num_experts, top = c.top_k;
  const int64_t I = c.moe_intermediate, Is = I * c.num_shared_experts, pairs = R * top;
  // routing: fp32 logits, then top-k on the device
  gemm.linear(kF32, R, E, D, {P.m32.data(), D}, {L.router->f(), D}, {P.logits32.data(), kF32});
  k::moe_route(model::kimi::moe_routing(c), P.logits32.as<float>(), R, L.bias->f(),
               P.ids.as<int32_t>(), P.weights.as<float>(), s);
  L.ids.resize(size_t(pairs));
  k::check_cuda(
      cudaMemcpyAsync(L.ids.data(), P.ids.data(), size_t(pairs) * 4, cudaMemcpyDeviceToHost, s),
      "cudaMemcpyAsync (expert ids)");
  k::check_cuda(cudaStreamSynchronize(s), "kimi_linear (cuda): expert ids");
  // counting sort of the (token, slot) pairs by expert
  L.offsets.assign(size_t(E + 1), 0);
  for (int64_t q = 0; q < pairs; ++q) {
    const int32_t e = L.ids[size_t(q)];
    require(e >= 0 && e < E, "kimi_linear (cuda): the router chose no valid expert");
    ++L.offsets[size_t(e + 1)];
  }
  for (int64_t e = 0; e < E; ++e) {
    if (count_load) L.load[size_t(e)] += L.offsets[size_t(e + 1)];
    L.offsets[size_t(e + 1)] += L.offsets[size_t(e)];
  }
  L.index.resize(size_t(3 * pairs));
  int32_t* pair_token = L.index.data();
  int32_t* pair_slot = pair_token + pairs;
  int32_t* slot_pair = pair_slot + pairs;
  {
    std::vector<int64_t> fill(L.offsets.begin(), L.offsets.end() - 1);
    for (int64_t q = 0; q < pairs; ++q) {
      const int64_t at = fill[size_t(L.ids[size_t(q)])]++;
      pair_token[at] = int32_t(q / top);
      pair_slot[at] = int32_t(q);
      slot_pair[q] = int32_t(at);
    }
  }
  k::check_cuda(cudaMemcpyAsync(P.index.data(), L.index.data(), size_t(3 * pairs) * 4,
                                cudaMemcpyHostToDevice, s),
                "cudaMemcpyAsync (expert index)");
  const int32_t* d_pair_token = P.index.as<int32_t>();
  const int32_t* d_slot_pair = d_pair_token + 2 * pairs;

  // routed experts over their gathered rows
  k::gather_rows(P.m_c.data(), kBf16, d_pair_token, pairs, D, {P.xg_c.data(), kBf16}, s);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t o = L.offsets[size_t(e)], n = L.offsets[size_t(e + 1)] - o;
    if (n == 0) continue;
    gemm.linear(kBf16, n, I, D, {offset(P.xg_c, o * D, 2), D}, {L.w1[size_t(e)]->compute(), D},
                {offset(P.eup32, o * 2 * I, 4), kF32, 2 * I});
    gemm.linear(kBf16, n, I, D, {offset(P.xg_c, o * D, 2), D}, {L.w3[size_t(e)]->compute(), D},
                {offset(P.eup32, o * 2 * I + I, 4), kF32, 2 * I});
  }
  k::swiglu(P.eup32.as<float>(), pairs, I, {P.eact_c.data(), kBf16}, s);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t o = L.offsets[size_t(e)], n = L.offsets[size_t(e + 1)] - o;
    if (n == 0) continue;
    gemm.linear(kBf16, n, D, I, {offset(P.eact_c, o * I, 2), I}, {L.w2[size_t(e)]->compute(), I},
                {offset(a.eo32, o * D, 4), kF32});
  }
  // the shared expert adds straight into y, then every token its weighted slots
  if (Is > 0) {
    gemm.linear(kBf16, R, Is, D, {P.m_c.data(), D}, {L.shared_gate->compute(), D},
                {P.sh_up32.data(), kF32, 2 * Is});
    gemm.linear(kBf16, R, Is, D, {P.m_c.data(), D}, {L.shared_up->compute(), D},
                {offset(P.sh_up32, Is, 4), kF32, 2 * Is});
    k::swiglu(P.sh_up32.as<float>(), R, Is, {P.sh_act_c.data(), kBf16}, s);
    gemm.linear(kBf16, R, D, Is, {P.sh_act_c.data(), Is}, {L.shared_down->compute(), Is}, {y, kF32},
                1.f, 1.f);
  }
  k::moe_combine(a.eo32.as<float>(), d_slot_pair, P.weights.as<float>(), R, top, D, y, true, s);
}

void KimiCudaModel::moe_backward(Layer& L, PerLayer& P, const float* dy, float* dx) {
  const model::KimiLinearConfig& c = c_;
  Activations& a = *acts_;
  k::Gemm& gemm = engines_->gemm;
  auto& wgrad = engines_->wgrad;
  const cudaStream_t s = stream_;
  const int64_t R = a.R, D = c.hidden_size, E = c.num_experts, top = c.top_k;
  const int64_t I = c.moe_intermediate, Is = I * c.num_shared_experts, pairs = R * top;
  const int32_t* d_pair_token = P.index.as<int32_t>();
  const int32_t* d_pair_slot = d_pair_token + pairs;
  const int32_t* d_slot_pair = d_pair_token + 2 * pairs;
  const float* weights = P.weights.as<float>();

  // shared expert: writes dx
  if (Is > 0) {
    k::convert(dy, kF32, a.dy_c.data(), kBf16, R * D, s);
    linear_backward(gemm, wgrad, R, Is, D, a.dy_c.data(), D, P.sh_act_c.data(), Is, *L.shared_down,
                    {a.d32a.data(), kF32}, false);
    k::swiglu_backward(P.sh_up32.as<float>(), a.d32a.as<float>(), R, Is, a.dy_c.data(), kBf16, s);
    linear_backward(gemm, wgrad, R, D, Is, a.dy_c.data(), 2 * Is, P.m_c.data(), D, *L.shared_gate,
                    {dx, kF32}, false);
    linear_backward(gemm, wgrad, R, D, Is, offset(a.dy_c, Is, 2), 2 * Is, P.m_c.data(), D,
                    *L.shared_up, {dx, kF32}, true);
  } else {
    k::check_cuda(cudaMemsetAsync(dx, 0, size_t(R * D) * 4, s), "cudaMemsetAsync");
  }

  // routed experts. With g = dy W2 (unweighted) and h = silu(a) b: d weight = g . h,
  // dh = weight g, dW2 += dy^T (weight h)
  k::gather_rows(dy, kF32, d_pair_token, pairs, D, {a.dyg_c.data(), kBf16}, s);
  k::moe_weighted_swiglu(P.eup32.as<float>(), weights, d_pair_slot, pairs, I,
                         {a.wh_c.data(), kBf16}, s);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t o = L.offsets[size_t(e)], n = L.offsets[size_t(e + 1)] - o;
    if (n == 0) continue;
    const Entry& W2 = *L.w2[size_t(e)];
    wgrad.weight_gradient(kBf16, n, D, I, offset(a.dyg_c, o * D, 2), D, offset(a.wh_c, o * I, 2), I,
                          W2.g(), 1.f);
    gemm.matmul(kBf16, n, I, D, {offset(a.dyg_c, o * D, 2), D}, {W2.compute(), I},
                {offset(a.g32, o * I, 4), kF32});
  }
  k::moe_expert_backward(P.eup32.as<float>(), a.g32.as<float>(), weights, d_pair_slot, pairs, I,
                         {a.dup_c.data(), kBf16}, a.dweights.as<float>(), s);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t o = L.offsets[size_t(e)], n = L.offsets[size_t(e + 1)] - o;
    if (n == 0) continue;
    const Entry& W1 = *L.w1[size_t(e)];
    const Entry& W3 = *L.w3[size_t(e)];
    const void* da = offset(a.dup_c, o * 2 * I, 2);
    const void* db = offset(a.dup_c, o * 2 * I + I, 2);
    const void* xg = offset(P.xg_c, o * D, 2);
    float* dxg = offset<float>(a.eo32, o * D, 4);
    wgrad.weight_gradient(kBf16, n, I, D, da, 2 * I, xg, D, W1.g(), 1.f);
    wgrad.weight_gradient(kBf16, n, I, D, db, 2 * I, xg, D, W3.g(), 1.f);
    gemm.matmul(kBf16, n, D, I, {da, 2 * I}, {W1.compute(), D}, {dxg, kF32});
    gemm.matmul(kBf16, n, D, I, {db, 2 * I}, {W3.compute(), D}, {dxg, kF32}, 1.f, 1.f);
  }
  k::moe_combine(a.eo32.as<float>(), d_slot_pair, nullptr, R, top, D, dx, true, s);

  // router (fp32): d logits of the chosen experts, then its two products
  k::moe_router_backward(P.logits32.as<float>(), P.ids.as<int32_t>(), a.dweights.as<float>(), R, E,
                         top, c.renormalize, c.routed_scaling_factor, a.dlogits.as<float>(), s);
  wgrad.weight_gradient(kF32, R, E, D, a.dlogits.data(), E, P.m32.data(), D, L.router->g(), 1.f);
  gemm.matmul(kF32, R, D, E, {a.dlogits.data(), E}, {L.router->f(), D}, {dx, kF32}, 1.f, 1.f);
}

}  // namespace kda::train::cuda
