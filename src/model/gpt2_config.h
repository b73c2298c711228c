// A GPT-2 config.json (transformers' GPT2Config), parsed and validated once: the fields that
// change the computation, with transformers' defaults. Shared by inference (model/gpt2.cpp) and
// training (train/hf_gpt2.cpp).
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace kda::model {

enum class Gpt2Activation { gelu_tanh, gelu_erf, relu, silu };

struct Gpt2Config {
  int64_t vocab = 50257, positions = 1024, embd = 768, heads = 12, layers = 12, inner = 3072;
  double eps = 1e-5;  // double so that a saved config.json writes back the value it read
  double initializer_range = 0.02;
  bool tied = true;  // tie_word_embeddings: the lm_head is the token embedding
  bool scale_attn_weights = true;
  bool scale_by_inverse_layer = false;
  std::string activation_name = "gelu_new";
  Gpt2Activation activation = Gpt2Activation::gelu_tanh;

  int64_t head_dim() const { return embd / heads; }
  // 1/sqrt(head_dim) when scale_attn_weights, further divided by layer + 1 when
  // scale_attn_by_inverse_layer_idx (as transformers' GPT2Attention).
  double attention_scale(int64_t layer) const;
  int64_t params_per_layer() const;
  // Every weight, the lm_head counted only when it is not tied.
  int64_t total_params() const;

  // Throws kda::Error naming the field on anything unsupported (another model_type,
  // cross-attention, an unknown activation) or out of range.
  static Gpt2Config from_json(const nlohmann::json& config);
};

}  // namespace kda::model
