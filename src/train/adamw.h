// AdamW with fp32 master weights, global-norm gradient clipping and a warmup + cosine schedule.
// Weight decay applies only to parameters marked `decay` (matrices; not norms, biases, gates).
#pragma once
#include <cstdint>
#include <vector>

#include "train/lineage_model.h"

namespace kda::train {

struct AdamWConfig {
  float lr = 1e-3f;
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
  float weight_decay = 0.1f;
  float clip_norm = 1.0f;  // <= 0: no clipping
  int64_t warmup_steps = 100;
  int64_t total_steps = 1000;
  float min_lr_ratio = 0.1f;  // cosine decays to lr * min_lr_ratio
};

class AdamW {
 public:
  AdamW(std::vector<Param*> params, const AdamWConfig& config);
  // Learning rate at step (0-based).
  float lr_at(int64_t step) const;
  // One update from the gradients in Param::grad; returns the gradient norm before clipping.
  double step();
  int64_t steps_taken() const { return step_; }
  // Moments as tensors named "m.<param>" / "v.<param>" (for checkpoints), and back.
  std::vector<std::pair<std::string, Tensor>> state() const;
  void load_state(const std::vector<std::pair<std::string, Tensor>>& tensors, int64_t step);

 private:
  std::vector<Param*> params_;
  AdamWConfig config_;
  std::vector<std::vector<float>> m_, v_;
  int64_t step_ = 0;
};

}  // namespace kda::train
