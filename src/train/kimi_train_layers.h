// The token mixers of a Kimi Linear layer for training (fp32, forward keeping activations,
// backward into every weight), computing exactly what transformers' KimiDeltaAttention and
// KimiLinearAttention (NoPE MLA) compute; src/model/kimi_*_block.cpp are the inference twins.
// Tokens are N rows packed as documents (segments: offsets starting at 0, ending at N); every
// document starts from a zero KDA / conv state and attends only within itself.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "model/kimi_linear_config.h"
#include "train/trainable_model.h"

namespace kda::train {

struct KdaLayerParams {
  Param *q_proj, *k_proj, *v_proj;  // [HK, D]
  Param *q_conv, *k_conv, *v_conv;  // [HK, 1, W]
  Param *f_a, *f_b, *g_a, *g_b;     // [K, D], [HK, K]
  Param* b_proj;                    // [H, D]
  Param *A_log, *dt_bias;           // [1, 1, H, 1], [HK]
  Param *o_norm, *o_proj;           // [K], [D, HK]
};

class KimiKdaTrainLayer {
 public:
  KimiKdaTrainLayer(const model::KimiLinearConfig& c, KdaLayerParams p) : c_(c), p_(p) {}
  // x [N, D] (normalised) -> y [N, D].
  void forward(const float* x, int64_t N, std::span<const int64_t> segments, float* y);
  // dx [N, D] overwritten; Param::grad accumulated.
  void backward(const float* dy, float* dx);

 private:
  const model::KimiLinearConfig& c_;
  KdaLayerParams p_;
  int64_t N_ = 0;
  std::vector<int64_t> segments_;
  std::vector<float> x_, pre_[3], conv_[3], qn_, kn_, fa_, graw_, ga_, gate_, braw_, o_, on_;
};

struct MlaLayerParams {
  Param* q_proj;         // [H (nope + rope), D], or q_b_proj [H (nope + rope), R] with q_a
  Param* q_a = nullptr;  // q_a_proj [R, D] (q_lora_rank R > 0; null: no q compression)
  Param* q_a_layernorm = nullptr;  // [R]
  Param* kv_a;                     // [latent + rope, D]  (kv_a_proj_with_mqa)
  Param* kv_a_layernorm;           // [latent]
  Param* kv_b;                     // [H (nope + v), latent]
  Param* o_proj;                   // [D, H v]
};

class KimiMlaTrainLayer {
 public:
  KimiMlaTrainLayer(const model::KimiLinearConfig& c, MlaLayerParams p) : c_(c), p_(p) {}
  void forward(const float* x, int64_t N, std::span<const int64_t> segments, float* y);
  void backward(const float* dy, float* dx);

 private:
  const model::KimiLinearConfig& c_;
  MlaLayerParams p_;
  int64_t N_ = 0;
  std::vector<int64_t> segments_;
  std::vector<float> x_, q_, rows_, latent_, inv_rms_, kvb_, keys_, values_, o_, lse_;
  std::vector<float> q_rows_, q_latent_, q_inv_rms_;  // with q_a only
};

}  // namespace kda::train
