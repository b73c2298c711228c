// The blocks of a Kimi Linear layer (internal to src/model/kimi_*.cpp): the KDA and MLA token
// mixers and the dense-MLP / MoE feed-forward, each with its checkpoint tensors (names and
// shapes for check_tensors), its fp32 weights as the engine holds them (projections that read
// the same input stacked into one matrix, so a decode step is one GEMV per input), and its
// forward over T new tokens of one sequence against that sequence's memory.
#pragma once
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/kimi_linear_config.h"
#include "model/model_folder.h"
#include "ops/delta_rule/delta_rule.h"
#include "ops/mla/mla.h"
#include "ops/moe/moe.h"
#include "runtime/latent_cache.h"

namespace kda::model::kimi {

using TensorMap = std::map<std::string, Shape>;

// Buffers reused across calls (grown, never shrunk): decode steps do not allocate.
struct Scratch {
  std::vector<float> h, x, out, proj, q, k, v, graw, gate, braw, attn, state, rows, low_rank;
  std::vector<float> router_logits, route_weights;
  std::vector<int32_t> route_ids;
  ops::MoeWorkspace moe;
  ops::MlaWorkspace mla;
};

template <class V>
auto* grow(V& v, int64_t n) {
  if (int64_t(v.size()) < n) v.resize(size_t(n));
  return v.data();
}

// Rows stacked into one [sum rows, cols] matrix (all parts share cols).
Tensor stack_rows(std::initializer_list<const Tensor*> parts);

// --- KDA ---
struct KdaWeights {
  Tensor in_proj;   // [3 HK + 2 K + H, D]: q_proj | k_proj | v_proj | f_a_proj | g_a_proj | b_proj
  Tensor conv;      // [3, HK, W]: q, k, v depthwise conv weights
  Tensor f_b, g_b;  // [HK, K]
  Tensor A_log;     // [H]
  Tensor dt_bias;   // [HK]
  Tensor o_norm;    // [K]
  Tensor o_proj;    // [D, HK]
};

struct KdaState {
  std::vector<float> recurrent;  // [H, K, V] fp32
  std::vector<float> conv;       // [3, W - 1, HK]: q, k, v conv windows
};

void expect_kda(const KimiLinearConfig& c, const std::string& prefix, const ModelFolder& folder,
                TensorMap& expected);
KdaWeights load_kda(const KimiLinearConfig& c, const std::string& prefix,
                    const ModelFolder& folder);
KdaState new_kda_state(const KimiLinearConfig& c);
// y [T, D] from the normalised input x [T, D]; advances the state by T tokens.
void kda_forward(const KimiLinearConfig& c, const KdaWeights& w, const float* x, int64_t T,
                 KdaState& state, float* y, Scratch& s);
// One decode step of N sequences: row n of x [N, D] is sequence n's token, states[n] its state;
// the projections run once over all N rows (the weights read once), the conv and the recurrence
// per sequence. N = 1 is kda_forward's decode step.
void kda_decode_batch(const KimiLinearConfig& c, const KdaWeights& w, const float* x, int64_t N,
                      std::span<KdaState* const> states, float* y, Scratch& s);

// --- MLA ---
struct MlaWeights {
  Tensor q_proj;                   // [H (nope + rope), D], or q_b_proj [.., q_lora_rank]
  Tensor q_a_proj, q_a_layernorm;  // only with q_lora_rank
  Tensor kv_a;                     // [latent + rope, D] kv_a_proj_with_mqa
  Tensor kv_a_layernorm;           // [latent]
  Tensor kv_b;                     // [H (nope + v), latent]
  Tensor o_proj;                   // [D, H v]
};

// Prefills of at least this many new tokens expand K/V and run flash attention; shorter feeds
// (decode) attend in absorbed form over the latent cache. Per new token the absorbed form costs
// about 2 H (latent + rope) flops per cached key, the expanded one 2 H (nope + rope + v) plus
// the one-off expansion of every key; the crossover is near 170 tokens at Kimi Linear's sizes.
constexpr int64_t kMlaExpandFromTokens = 64;

void expect_mla(const KimiLinearConfig& c, const std::string& prefix, TensorMap& expected);
MlaWeights load_mla(const KimiLinearConfig& c, const std::string& prefix,
                    const ModelFolder& folder);
ops::MlaShape mla_shape(const KimiLinearConfig& c);
// y [T, D]; appends the T latent rows to `cache` (which must have room).
void mla_forward(const KimiLinearConfig& c, const MlaWeights& w, const float* x, int64_t T,
                 runtime::LatentCache& cache, float* y, Scratch& s);
// One decode step of N sequences (row n of x, caches[n], each with room for one row): the
// projections over all N rows at once, the absorbed attention per sequence. N = 1 is
// mla_forward's decode step.
void mla_decode_batch(const KimiLinearConfig& c, const MlaWeights& w, const float* x, int64_t N,
                      std::span<runtime::LatentCache* const> caches, float* y, Scratch& s);

// --- Feed-forward: dense SwiGLU MLP or MoE ---
struct FfnWeights {
  bool moe = false;
  Tensor gate_up, down;    // dense MLP [2 I, D], [D, I]; for MoE, the shared experts (if any)
  Tensor router;           // [E, D]
  Tensor correction_bias;  // [E]
  std::vector<Tensor> expert_gate_up, expert_down;
  std::vector<ops::SwigluWeights> experts;  // pointers into the tensors above
  ops::MoeRouting routing;
};

void expect_ffn(const KimiLinearConfig& c, int64_t layer, const std::string& prefix,
                const ModelFolder& folder, TensorMap& expected);
FfnWeights load_ffn(const KimiLinearConfig& c, int64_t layer, const std::string& prefix,
                    const ModelFolder& folder);
void ffn_forward(const KimiLinearConfig& c, const FfnWeights& w, const float* x, int64_t T,
                 float* y, Scratch& s);

int64_t tensor_bytes(const Tensor& t);

// Every tensor name and shape of a Kimi Linear checkpoint (embedding, norms, lm_head, and each
// layer's mixer and feed-forward), for ModelFolder::check_tensors.
TensorMap expected_tensors(const KimiLinearConfig& c, const ModelFolder& folder);
std::string layer_prefix(int64_t layer);  // "model.layers.<i>."

// The shape of the KDA op over T tokens of one sequence, and the MoE routing of the config.
ops::DeltaRuleShape kda_delta_shape(const KimiLinearConfig& c, int64_t T);
ops::MoeRouting moe_routing(const KimiLinearConfig& c);

}  // namespace kda::model::kimi
