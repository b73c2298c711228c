// config.json -> KimiLinearConfig, following transformers' KimiLinearConfig.__post_init__:
// explicit layer_types / mlp_layer_types, else linear_attn_config's 1-based kda_layers /
// full_attn_layers and first_k_dense_replace. Where two spellings of one fact are present they
// must agree; features this engine does not implement are refused by name.
#include "model/kimi_linear_config.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/error.h"
#include "model/model_folder.h"

namespace kda::model {
namespace {

using json = nlohmann::json;

// The first of several spellings present (transformers' attribute_map aliases), else "".
std::string first_present(const json& c, std::initializer_list<const char*> keys) {
  for (const char* k : keys)
    if (c.contains(k) && !c[k].is_null()) return k;
  return "";
}

int64_t int_alias(const json& c, std::initializer_list<const char*> keys, int64_t fallback) {
  const std::string key = first_present(c, keys);
  return key.empty() ? fallback : config_int(c, key);
}

int64_t required_alias(const json& c, std::initializer_list<const char*> keys) {
  const std::string key = first_present(c, keys);
  require(!key.empty(), "config.json: field '" + std::string(*keys.begin()) + "' is missing");
  return config_int(c, key);
}

void require_positive(int64_t value, const std::string& field) {
  require(value >= 1, "config.json: " + field + " must be positive, got " + std::to_string(value));
}

// A list of 1-based layer numbers from linear_attn_config.
std::vector<int64_t> layer_list(const json& lac, const std::string& key, int64_t num_layers) {
  const std::string where = "config.json: linear_attn_config." + key;
  require(lac[key].is_array(), where + " is not a list");
  std::vector<int64_t> out;
  for (const json& v : lac[key]) {
    require(v.is_number_integer(), where + " holds a non-integer");
    const int64_t layer = v.get<int64_t>();
    require(layer >= 1 && layer <= num_layers,
            where + " names layer " + std::to_string(layer) + ", but num_hidden_layers is " +
                std::to_string(num_layers) + " (layers are numbered from 1)");
    out.push_back(layer);
  }
  return out;
}

std::vector<KimiMixer> parse_mixers(const json& c, int64_t num_layers) {
  std::vector<KimiMixer> from_lists;
  const json* lac = c.contains("linear_attn_config") && c["linear_attn_config"].is_object()
                        ? &c["linear_attn_config"]
                        : nullptr;
  if (lac && lac->contains("kda_layers") && lac->contains("full_attn_layers")) {
    std::vector<int> seen(num_layers, 0);
    from_lists.assign(num_layers, KimiMixer::kda);
    for (int64_t layer : layer_list(*lac, "full_attn_layers", num_layers)) {
      from_lists[layer - 1] = KimiMixer::mla;
      ++seen[layer - 1];
    }
    for (int64_t layer : layer_list(*lac, "kda_layers", num_layers)) ++seen[layer - 1];
    for (int64_t i = 0; i < num_layers; ++i) {
      require(seen[i] == 1, "config.json: linear_attn_config names layer " + std::to_string(i + 1) +
                                (seen[i] == 0 ? " in neither" : " twice in") +
                                " kda_layers / full_attn_layers (1-based)");
    }
  }
  std::vector<KimiMixer> from_types;
  if (c.contains("layer_types") && !c["layer_types"].is_null()) {
    const json& lt = c["layer_types"];
    require(lt.is_array() && int64_t(lt.size()) == num_layers,
            "config.json: layer_types must list num_hidden_layers = " + std::to_string(num_layers) +
                " entries");
    for (size_t i = 0; i < lt.size(); ++i) {
      const std::string t = lt[i].is_string() ? lt[i].get<std::string>() : "";
      require(t == "linear_attention" || t == "full_attention",
              "config.json: layer_types[" + std::to_string(i) +
                  "] must be \"linear_attention\" or \"full_attention\"");
      from_types.push_back(t == "full_attention" ? KimiMixer::mla : KimiMixer::kda);
    }
  }
  if (!from_types.empty() && !from_lists.empty()) {
    require(from_types == from_lists,
            "config.json: layer_types disagrees with linear_attn_config.kda_layers / "
            "full_attn_layers");
  }
  if (!from_types.empty()) return from_types;
  if (!from_lists.empty()) return from_lists;
  // transformers' default pattern: every fourth layer is full attention.
  std::vector<KimiMixer> out;
  for (int64_t i = 0; i < num_layers; ++i)
    out.push_back((i + 1) % 4 == 0 ? KimiMixer::mla : KimiMixer::kda);
  return out;
}

std::vector<KimiFfn> parse_ffns(const json& c, int64_t num_layers) {
  std::vector<KimiFfn> from_first_k;
  if (c.contains("first_k_dense_replace") && !c["first_k_dense_replace"].is_null()) {
    const int64_t k = config_int(c, "first_k_dense_replace");
    require(k >= 0, "config.json: first_k_dense_replace must be non-negative");
    for (int64_t i = 0; i < num_layers; ++i)
      from_first_k.push_back(i < k ? KimiFfn::dense : KimiFfn::moe);
  }
  std::vector<KimiFfn> from_types;
  if (c.contains("mlp_layer_types") && !c["mlp_layer_types"].is_null()) {
    const json& mt = c["mlp_layer_types"];
    require(mt.is_array() && int64_t(mt.size()) == num_layers,
            "config.json: mlp_layer_types must list num_hidden_layers = " +
                std::to_string(num_layers) + " entries");
    for (size_t i = 0; i < mt.size(); ++i) {
      const std::string t = mt[i].is_string() ? mt[i].get<std::string>() : "";
      require(t == "dense" || t == "sparse", "config.json: mlp_layer_types[" + std::to_string(i) +
                                                 "] must be \"dense\" or \"sparse\"");
      from_types.push_back(t == "sparse" ? KimiFfn::moe : KimiFfn::dense);
    }
  }
  if (!from_types.empty() && !from_first_k.empty()) {
    require(from_types == from_first_k,
            "config.json: mlp_layer_types disagrees with first_k_dense_replace");
  }
  if (!from_types.empty()) return from_types;
  if (!from_first_k.empty()) return from_first_k;
  std::vector<KimiFfn> out;  // transformers' default: first_k_dense_replace = 1
  for (int64_t i = 0; i < num_layers; ++i) out.push_back(i < 1 ? KimiFfn::dense : KimiFfn::moe);
  return out;
}

}  // namespace

int64_t KimiLinearConfig::count(KimiMixer m) const {
  return std::count(mixers.begin(), mixers.end(), m);
}

int64_t KimiLinearConfig::count(KimiFfn f) const {
  return std::count(ffns.begin(), ffns.end(), f);
}

KimiLinearConfig KimiLinearConfig::parse(const json& c) {
  require(c.is_object(), "config.json: not a JSON object");
  const std::string type = config_string_or(c, "model_type", "kimi_linear");
  require(type == "kimi_linear",
          "config.json: model_type is '" + type + "', expected 'kimi_linear'");
  KimiLinearConfig k;
  k.vocab_size = config_int(c, "vocab_size");
  k.hidden_size = config_int(c, "hidden_size");
  k.num_layers = config_int(c, "num_hidden_layers");
  require_positive(k.vocab_size, "vocab_size");
  require_positive(k.hidden_size, "hidden_size");
  require_positive(k.num_layers, "num_hidden_layers");
  k.rms_norm_eps = config_double_or(c, "rms_norm_eps", 1e-5);
  require(k.rms_norm_eps > 0 && std::isfinite(k.rms_norm_eps),
          "config.json: rms_norm_eps must be positive");
  k.max_context = int_alias(c, {"model_max_length", "max_position_embeddings"}, 1048576);
  require_positive(k.max_context, "model_max_length");

  // Features of the family this engine does not implement: refuse rather than compute wrong.
  const std::string act = config_string_or(c, "hidden_act", "silu");
  require(act == "silu", "config.json: hidden_act '" + act + "' is not supported (only silu)");
  require(!config_bool_or(c, "tie_word_embeddings", false),
          "config.json: tie_word_embeddings is true; Kimi Linear keeps a separate lm_head");
  require(config_bool_or(c, "mla_use_nope", true),
          "config.json: mla_use_nope is false; only NoPE MLA (no rotary embedding) is supported");
  require(!config_bool_or(c, "mla_use_output_gate", false),
          "config.json: mla_use_output_gate (Kimi K3) is not supported");
  require(config_int_or(c, "attn_res_block_size", 0) == 0,
          "config.json: attn_res_block_size (block attention residuals) is not supported");
  require(config_int_or(c, "moe_layer_freq", 1) == 1,
          "config.json: moe_layer_freq other than 1 is not supported");
  const std::string router = config_string_or(c, "moe_router_activation_func", "sigmoid");
  require(router == "sigmoid",
          "config.json: moe_router_activation_func '" + router + "' is not supported (sigmoid)");

  k.mixers = parse_mixers(c, k.num_layers);
  k.ffns = parse_ffns(c, k.num_layers);

  // KDA: linear_attn_config first, then the flat spellings transformers also writes.
  const json lac = c.contains("linear_attn_config") && c["linear_attn_config"].is_object()
                       ? c["linear_attn_config"]
                       : json::object();
  auto kda_field = [&](const char* nested, const char* flat, int64_t fallback) {
    if (lac.contains(nested) && !lac[nested].is_null()) {
      require(lac[nested].is_number_integer(),
              std::string("config.json: linear_attn_config.") + nested + " is not an integer");
      return lac[nested].get<int64_t>();
    }
    return config_int_or(c, flat, fallback);
  };
  if (k.count(KimiMixer::kda) > 0) {
    k.kda_heads = kda_field("num_heads", "linear_num_heads", 32);
    k.kda_head_dim = kda_field("head_dim", "linear_head_dim", 128);
    k.conv_kernel = kda_field("short_conv_kernel_size", "linear_conv_kernel_dim", 4);
    require_positive(k.kda_heads, "linear_attn_config.num_heads");
    require_positive(k.kda_head_dim, "linear_attn_config.head_dim");
    require_positive(k.conv_kernel, "linear_attn_config.short_conv_kernel_size");
    if (c.contains("forget_gate_lower_bound") && !c["forget_gate_lower_bound"].is_null()) {
      const double lb = config_double_or(c, "forget_gate_lower_bound", 0);
      require(lb >= -5.0 && lb < 0.0, "config.json: forget_gate_lower_bound must lie in [-5, 0)");
      k.forget_gate_lower_bound = lb;
    }
  }
  if (k.count(KimiMixer::mla) > 0) {
    k.mla_heads = config_int(c, "num_attention_heads");
    k.q_lora_rank = config_int_or(c, "q_lora_rank", 0);
    k.kv_lora_rank = config_int(c, "kv_lora_rank");
    k.qk_nope_head_dim = config_int(c, "qk_nope_head_dim");
    k.qk_rope_head_dim = config_int(c, "qk_rope_head_dim");
    k.v_head_dim = config_int(c, "v_head_dim");
    require_positive(k.mla_heads, "num_attention_heads");
    require(k.q_lora_rank >= 0, "config.json: q_lora_rank must be positive or null");
    require_positive(k.kv_lora_rank, "kv_lora_rank");
    require_positive(k.qk_nope_head_dim, "qk_nope_head_dim");
    require(k.qk_rope_head_dim >= 0, "config.json: qk_rope_head_dim must be non-negative");
    require_positive(k.v_head_dim, "v_head_dim");
  }
  if (k.count(KimiFfn::dense) > 0) {
    k.dense_intermediate = int_alias(c, {"dense_ffn_hidden", "intermediate_size"}, 0);
    require_positive(k.dense_intermediate, "intermediate_size");
  }
  if (k.count(KimiFfn::moe) > 0) {
    k.moe_intermediate = config_int(c, "moe_intermediate_size");
    k.num_experts = required_alias(c, {"num_experts", "n_routed_experts", "num_local_experts"});
    k.top_k = required_alias(c, {"num_experts_per_token", "num_experts_per_tok"});
    k.num_shared_experts = int_alias(c, {"num_shared_experts", "n_shared_experts"}, 1);
    k.num_expert_groups = int_alias(c, {"num_expert_group", "n_group"}, 1);
    k.topk_groups = int_alias(c, {"topk_group"}, 1);
    const std::string renorm = first_present(c, {"moe_renormalize", "norm_topk_prob"});
    k.renormalize = renorm.empty() ? true : config_bool_or(c, renorm, true);
    k.routed_scaling_factor = config_double_or(c, "routed_scaling_factor", 2.446);
    require_positive(k.moe_intermediate, "moe_intermediate_size");
    require_positive(k.num_experts, "num_experts");
    require(k.num_shared_experts >= 0, "config.json: num_shared_experts must be non-negative");
    require(k.top_k >= 1 && k.top_k <= k.num_experts,
            "config.json: num_experts_per_token must lie in [1, num_experts]");
    require(k.num_expert_groups >= 1 && k.num_experts % k.num_expert_groups == 0,
            "config.json: num_expert_group must divide num_experts");
    require(k.topk_groups >= 1 && k.topk_groups <= k.num_expert_groups,
            "config.json: topk_group must lie in [1, num_expert_group]");
    require(k.top_k <= k.topk_groups * (k.num_experts / k.num_expert_groups),
            "config.json: num_experts_per_token exceeds the experts of the kept groups");
    require(std::isfinite(k.routed_scaling_factor),
            "config.json: routed_scaling_factor must be finite");
  }
  return k;
}

}  // namespace kda::model
