// The feed-forward of a Kimi Linear layer: a dense SwiGLU MLP in the first layers
// (first_k_dense_replace), elsewhere a MoE (transformers' KimiLinearMoE): sigmoid router with a
// selection-only score correction bias, top-k routed SwiGLU experts weighted by their
// renormalised, scaled scores, plus the unscaled shared expert(s).
//
// Tensor names: the dense MLP of layer 0 is saved as `block_sparse_moe.{gate,up,down}_proj`
// by transformers 5.17 (the fixture) and as `mlp.{gate,up,down}_proj` in the notes for the
// released checkpoint; whichever the folder holds is used.
#include <algorithm>
#include <string>

#include "core/error.h"
#include "model/kimi_linear_blocks.h"
#include "ops/nn/nn.h"

namespace kda::model::kimi {
namespace {

std::string dense_prefix(const std::string& p, const ModelFolder& folder) {
  return folder.has(p + "mlp.gate_proj.weight") ? p + "mlp." : p + "block_sparse_moe.";
}

std::string expert_prefix(const std::string& p, int64_t e) {
  return p + "block_sparse_moe.experts." + std::to_string(e) + ".";
}

}  // namespace

void expect_ffn(const KimiLinearConfig& c, int64_t layer, const std::string& p,
                const ModelFolder& folder, TensorMap& e) {
  const int64_t D = c.hidden_size;
  if (c.ffns[layer] == KimiFfn::dense) {
    const std::string d = dense_prefix(p, folder);
    const int64_t I = c.dense_intermediate;
    e[d + "gate_proj.weight"] = {I, D};
    e[d + "up_proj.weight"] = {I, D};
    e[d + "down_proj.weight"] = {D, I};
    return;
  }
  const int64_t I = c.moe_intermediate, E = c.num_experts;
  e[p + "block_sparse_moe.gate.weight"] = {E, D};
  e[p + "block_sparse_moe.gate.e_score_correction_bias"] = {E};
  for (int64_t x = 0; x < E; ++x) {
    e[expert_prefix(p, x) + "w1.weight"] = {I, D};
    e[expert_prefix(p, x) + "w3.weight"] = {I, D};
    e[expert_prefix(p, x) + "w2.weight"] = {D, I};
  }
  if (c.num_shared_experts > 0) {
    const int64_t Is = I * c.num_shared_experts;
    const std::string sh = p + "block_sparse_moe.shared_experts.";
    e[sh + "gate_proj.weight"] = {Is, D};
    e[sh + "up_proj.weight"] = {Is, D};
    e[sh + "down_proj.weight"] = {D, Is};
  }
}

FfnWeights load_ffn(const KimiLinearConfig& c, int64_t layer, const std::string& p,
                    const ModelFolder& folder) {
  TensorMap e;
  expect_ffn(c, layer, p, folder, e);
  auto load = [&](const std::string& name) { return folder.load(name, e.at(name)); };
  auto load_swiglu = [&](const std::string& gate, const std::string& up, const std::string& down,
                         Tensor& gate_up, Tensor& down_out) {
    const Tensor g = load(gate), u = load(up);
    gate_up = stack_rows({&g, &u});
    down_out = load(down);
  };
  FfnWeights w;
  if (c.ffns[layer] == KimiFfn::dense) {
    const std::string d = dense_prefix(p, folder);
    load_swiglu(d + "gate_proj.weight", d + "up_proj.weight", d + "down_proj.weight", w.gate_up,
                w.down);
    return w;
  }
  w.moe = true;
  w.router = load(p + "block_sparse_moe.gate.weight");
  w.correction_bias = load(p + "block_sparse_moe.gate.e_score_correction_bias");
  w.expert_gate_up.resize(c.num_experts);
  w.expert_down.resize(c.num_experts);
  for (int64_t x = 0; x < c.num_experts; ++x) {
    const std::string ep = expert_prefix(p, x);
    load_swiglu(ep + "w1.weight", ep + "w3.weight", ep + "w2.weight", w.expert_gate_up[x],
                w.expert_down[x]);
    w.experts.push_back({w.expert_gate_up[x].f32(), w.expert_down[x].f32()});
  }
  if (c.num_shared_experts > 0) {
    const std::string sh = p + "block_sparse_moe.shared_experts.";
    load_swiglu(sh + "gate_proj.weight", sh + "up_proj.weight", sh + "down_proj.weight", w.gate_up,
                w.down);
  }
  w.routing = moe_routing(c);
  return w;
}

ops::MoeRouting moe_routing(const KimiLinearConfig& c) {
  ops::MoeRouting r;
  r.num_experts = c.num_experts;
  r.top_k = c.top_k;
  r.num_groups = c.num_expert_groups;
  r.topk_groups = c.topk_groups;
  r.renormalize = c.renormalize;
  r.scaling = c.routed_scaling_factor;
  r.validate();
  return r;
}

void ffn_forward(const KimiLinearConfig& c, const FfnWeights& w, const float* x, int64_t T,
                 float* y, Scratch& s) {
  const int64_t D = c.hidden_size;
  if (!w.moe) {
    ops::swiglu_mlp(x, T, D, c.dense_intermediate, {w.gate_up.f32(), w.down.f32()}, y, s.moe);
    return;
  }
  const int64_t E = c.num_experts, k = c.top_k;
  float* logits = grow(s.router_logits, T * E);
  ops::linear(x, T, D, w.router.f32(), E, nullptr, logits);
  int32_t* ids = grow(s.route_ids, T * k);
  float* weights = grow(s.route_weights, T * k);
  ops::moe_route_sigmoid(w.routing, logits, T, w.correction_bias.f32(), ids, weights);
  if (c.num_shared_experts > 0) {
    ops::swiglu_mlp(x, T, D, c.moe_intermediate * c.num_shared_experts,
                    {w.gate_up.f32(), w.down.f32()}, y, s.moe);
  } else {
    std::fill_n(y, T * D, 0.0f);
  }
  ops::moe_experts_accumulate(x, T, D, c.moe_intermediate, w.experts, ids, weights, k, y, s.moe);
}

}  // namespace kda::model::kimi
