// A Kimi Linear config.json, parsed and validated once: sizes, the layer map and the MoE
// routing, as transformers' KimiLinearConfig resolves them.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace kda::model {

enum class KimiMixer { kda, mla };
enum class KimiFfn { dense, moe };

struct KimiLinearConfig {
  int64_t vocab_size = 0, hidden_size = 0, num_layers = 0;
  double rms_norm_eps = 1e-5;
  int64_t max_context = 0;  // model_max_length
  std::vector<KimiMixer> mixers;
  std::vector<KimiFfn> ffns;

  // KDA (linear_attn_config): H heads of head_dim for q, k and v; the gate's low rank is head_dim.
  int64_t kda_heads = 0, kda_head_dim = 0, conv_kernel = 0;
  std::optional<double> forget_gate_lower_bound;

  // MLA
  int64_t mla_heads = 0, q_lora_rank = 0;  // q_lora_rank 0: a single q_proj
  int64_t kv_lora_rank = 0, qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;

  // Feed-forward
  int64_t dense_intermediate = 0, moe_intermediate = 0;
  int64_t num_experts = 0, top_k = 0, num_shared_experts = 0;
  int64_t num_expert_groups = 1, topk_groups = 1;
  bool renormalize = true;
  double routed_scaling_factor = 1.0;

  // Throws kda::Error naming the field ("config.json: linear_attn_config.kda_layers ...").
  static KimiLinearConfig parse(const nlohmann::json& config);

  int64_t kda_width() const { return kda_heads * kda_head_dim; }  // H * K (= H * V)
  int64_t mla_qk_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  int64_t mla_row_width() const { return kv_lora_rank + qk_rope_head_dim; }
  int64_t count(KimiMixer m) const;
  int64_t count(KimiFfn f) const;
};

// Norm epsilon of kv_a_layernorm and q_a_layernorm: transformers builds them with
// KimiLinearRMSNorm's default (1e-6), not config.rms_norm_eps.
constexpr float kKimiLatentNormEps = 1e-6f;

}  // namespace kda::model
