// AdamW with fp32 master weights, global-norm gradient clipping and a warmup + cosine schedule.
// Weight decay applies only to parameters marked `decay` (matrices; not norms, biases, gates).
#pragma once
#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "train/trainable_model.h"

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

// Learning rate at step (0-based): linear warmup, then cosine down to lr * min_lr_ratio.
float scheduled_lr(const AdamWConfig& config, int64_t step);

// What the trainer needs from an optimizer: the host AdamW below, or a device one that keeps
// the moments beside a GPU model's weights (TrainableModel::make_optimizer).
class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // Learning rate at step (0-based).
  virtual float lr_at(int64_t step) const = 0;
  // One update from the model's gradients; returns the gradient norm before clipping.
  virtual double step() = 0;
  virtual int64_t steps_taken() const = 0;
  // Moments as tensors named "m.<param>" / "v.<param>" (for checkpoints), and back.
  virtual std::vector<std::pair<std::string, Tensor>> state() const = 0;
  virtual void load_state(const std::vector<std::pair<std::string, Tensor>>& tensors,
                          int64_t step) = 0;
};

class AdamW final : public Optimizer {
 public:
  AdamW(std::vector<Param*> params, const AdamWConfig& config);
  float lr_at(int64_t step) const override { return scheduled_lr(config_, step); }
  // One update from the gradients in Param::grad.
  double step() override;
  int64_t steps_taken() const override { return step_; }
  std::vector<std::pair<std::string, Tensor>> state() const override;
  void load_state(const std::vector<std::pair<std::string, Tensor>>& tensors,
                  int64_t step) override;

 private:
  std::vector<Param*> params_;
  AdamWConfig config_;
  std::vector<std::vector<float>> m_, v_;
  int64_t step_ = 0;
};

}  // namespace kda::train
