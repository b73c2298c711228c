#include "model/gpt2_config.h"

#include <cmath>

#include "core/error.h"
#include "model/model_folder.h"

namespace kda::model {

double Gpt2Config::attention_scale(int64_t layer) const {
  double scale = scale_attn_weights ? 1.0 / std::sqrt(double(head_dim())) : 1.0;
  if (scale_by_inverse_layer) scale /= double(layer + 1);
  return scale;
}

int64_t Gpt2Config::params_per_layer() const {
  const int64_t E = embd, I = inner;
  return 2 * E + (E * 3 * E + 3 * E) + (E * E + E) + 2 * E + (E * I + I) + (I * E + E);
}

int64_t Gpt2Config::total_params() const {
  return vocab * embd + positions * embd + layers * params_per_layer() + 2 * embd +
         (tied ? 0 : vocab * embd);
}

Gpt2Config Gpt2Config::from_json(const nlohmann::json& config) {
  Gpt2Config c;
  const std::string type = config_string_or(config, "model_type", "gpt2");
  require(type == "gpt2", "config.json: model_type '" + type + "' is not gpt2");
  c.vocab = config_int_or(config, "vocab_size", 50257);
  c.positions = config_int_or(config, "n_positions", 1024);
  c.embd = config_int_or(config, "n_embd", 768);
  c.heads = config_int_or(config, "n_head", 12);
  c.layers = config_int_or(config, "n_layer", 12);
  c.inner = config_int_or(config, "n_inner", 4 * c.embd);
  c.eps = config_double_or(config, "layer_norm_epsilon", 1e-5);
  c.initializer_range = config_double_or(config, "initializer_range", 0.02);
  c.tied = config_bool_or(config, "tie_word_embeddings", true);
  c.scale_attn_weights = config_bool_or(config, "scale_attn_weights", true);
  c.scale_by_inverse_layer = config_bool_or(config, "scale_attn_by_inverse_layer_idx", false);
  c.activation_name = config_string_or(config, "activation_function", "gelu_new");
  const auto positive = [](int64_t v, const char* key) {
    require(v > 0, "config.json: field '" + std::string(key) + "' must be positive, got " +
                       std::to_string(v));
  };
  positive(c.vocab, "vocab_size");
  positive(c.positions, "n_positions");
  positive(c.embd, "n_embd");
  positive(c.heads, "n_head");
  positive(c.layers, "n_layer");
  positive(c.inner, "n_inner");
  require(c.embd % c.heads == 0, "config.json: n_embd (" + std::to_string(c.embd) +
                                     ") is not a multiple of n_head (" + std::to_string(c.heads) +
                                     ")");
  // Both paths compute in float: the epsilon must stay positive and finite there too.
  const float eps_f32 = float(c.eps);
  require(std::isfinite(eps_f32) && eps_f32 > 0,
          "config.json: field 'layer_norm_epsilon' must be positive");
  require(std::isfinite(c.initializer_range) && c.initializer_range >= 0,
          "config.json: field 'initializer_range' must be >= 0");
  require(!config_bool_or(config, "add_cross_attention", false),
          "config.json: add_cross_attention = true (an encoder-decoder GPT-2) is not supported");
  if (c.activation_name == "gelu_new" || c.activation_name == "gelu_pytorch_tanh" ||
      c.activation_name == "gelu_fast") {
    c.activation = Gpt2Activation::gelu_tanh;
  } else if (c.activation_name == "gelu") {
    c.activation = Gpt2Activation::gelu_erf;
  } else if (c.activation_name == "relu") {
    c.activation = Gpt2Activation::relu;
  } else if (c.activation_name == "silu" || c.activation_name == "swish") {
    c.activation = Gpt2Activation::silu;
  } else {
    throw Error("config.json: activation_function '" + c.activation_name +
                "' is not supported (gelu_new, gelu_pytorch_tanh, gelu_fast, gelu, relu, silu)");
  }
  return c;
}

}  // namespace kda::model
