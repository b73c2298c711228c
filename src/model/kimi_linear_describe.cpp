// What a Kimi Linear config implies without weights: parameters (total and per token), the layer
// map, and per-sequence memory at deployment dtypes (fp32 KDA recurrent state, bf16 conv state,
// bf16 MLA latent cache of kv_lora_rank + qk_rope_head_dim values per token and layer).
#include <cstdio>
#include <string>

#include "model/kimi_linear.h"
#include "model/kimi_linear_config.h"

namespace kda::model {
namespace {

struct ParamCount {
  int64_t total = 0, active = 0;
  void add(int64_t n) { total += n, active += n; }
};

int64_t kda_params(const KimiLinearConfig& c) {
  const int64_t D = c.hidden_size, H = c.kda_heads, K = c.kda_head_dim, HK = c.kda_width();
  return 3 * D * HK                // q_proj, k_proj, v_proj
         + 3 * HK * c.conv_kernel  // q/k/v_conv1d
         + 2 * (D * K + K * HK)    // f_a/f_b and g_a/g_b (low rank = head_dim)
         + H + HK                  // A_log, dt_bias
         + D * H                   // b_proj
         + K                       // o_norm
         + HK * D;                 // o_proj
}

int64_t mla_params(const KimiLinearConfig& c) {
  const int64_t D = c.hidden_size, H = c.mla_heads, L = c.kv_lora_rank;
  const int64_t q = c.q_lora_rank > 0
                        ? D * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * H * c.mla_qk_dim()
                        : D * H * c.mla_qk_dim();
  return q + D * c.mla_row_width() + L + L * H * (c.qk_nope_head_dim + c.v_head_dim) +
         H * c.v_head_dim * D;
}

// 49.12B, or 8.37M below a billion
std::string billions(int64_t n) {
  char buf[32];
  if (n >= 1000000000)
    std::snprintf(buf, sizeof(buf), "%.2fB", double(n) / 1e9);
  else
    std::snprintf(buf, sizeof(buf), "%.2fM", double(n) / 1e6);
  return buf;
}

}  // namespace

ArchitectureInfo describe_kimi_linear(const nlohmann::json& config) {
  const KimiLinearConfig c = KimiLinearConfig::parse(config);
  const int64_t D = c.hidden_size;
  ParamCount p;
  p.add(2 * c.vocab_size * D + D);  // embed_tokens, lm_head, final norm
  const int64_t expert = 3 * D * c.moe_intermediate;
  ArchitectureInfo info;
  info.model_type = "kimi_linear";
  for (int64_t i = 0; i < c.num_layers; ++i) {
    p.add(2 * D);  // input and post-attention norms
    const bool kda = c.mixers[i] == KimiMixer::kda;
    p.add(kda ? kda_params(c) : mla_params(c));
    std::string kind = kda ? "KDA" : "MLA";
    if (c.ffns[i] == KimiFfn::dense) {
      p.add(3 * D * c.dense_intermediate);
      kind += " + dense MLP";
    } else {
      p.add(c.num_experts * (D + 1) + c.num_shared_experts * expert);  // router, bias, shared
      p.total += c.num_experts * expert;
      p.active += c.top_k * expert;
      kind += " + MoE";
    }
    info.layer_kinds.push_back(kind);
  }
  info.total_params = p.total;
  info.active_params = p.active;
  info.num_state_layers = c.count(KimiMixer::kda);
  if (info.num_state_layers > 0) {
    const int64_t recurrent = c.kda_heads * c.kda_head_dim * c.kda_head_dim * 4;
    const int64_t conv = 3 * (c.conv_kernel - 1) * c.kda_width() * 2;
    info.state_bytes_per_layer = recurrent + conv;
  }
  info.num_cache_layers = c.count(KimiMixer::mla);
  if (info.num_cache_layers > 0) info.cache_bytes_per_token_per_layer = c.mla_row_width() * 2;

  std::string s = "kimi_linear: " + std::to_string(c.num_layers) + " layers (" +
                  std::to_string(info.num_state_layers) + " KDA, " +
                  std::to_string(info.num_cache_layers) + " MLA), hidden " + std::to_string(D) +
                  ", vocab " + std::to_string(c.vocab_size);
  if (info.num_state_layers > 0) {
    s += ", KDA " + std::to_string(c.kda_heads) + "x" + std::to_string(c.kda_head_dim);
  }
  if (info.num_cache_layers > 0) {
    s += ", MLA " + std::to_string(c.mla_heads) + " heads latent " +
         std::to_string(c.kv_lora_rank) + "+" + std::to_string(c.qk_rope_head_dim);
  }
  if (c.count(KimiFfn::moe) > 0) {
    s += ", MoE " + std::to_string(c.num_experts) + " experts top-" + std::to_string(c.top_k) +
         " + " + std::to_string(c.num_shared_experts) + " shared";
  }
  s += "; " + billions(p.total) + " params, " + billions(p.active) + " active per token";
  info.summary = s;
  return info;
}

}  // namespace kda::model
