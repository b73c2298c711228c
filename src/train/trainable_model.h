// What the trainer needs from a model: named fp32 parameters with gradients, and one
// forward (+ backward) over a batch of token rows. LineageModel (the lineage family) and the
// Hugging Face architectures (gpt2, kimi_linear; train/hf_*.h) implement it.
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace kda::train {

struct Param {
  std::string name;  // the checkpoint's tensor name
  Tensor value, grad;
  bool decay = true;  // weight decay applies (matrices only; not norms, biases, gates)
};

struct StepResult {
  double loss = 0;
  int64_t scored = 0, correct = 0;
};

struct AdamWConfig;
class Optimizer;

class TrainableModel {
 public:
  virtual ~TrainableModel() = default;
  virtual std::vector<Param*> params() = 0;
  int64_t num_params();
  // inputs, targets [B, T] (target -1: not scored); loss is the mean cross-entropy over scored
  // targets. With backward, gradients of that loss are ACCUMULATED into Param::grad (zero them
  // with zero_grad). cu_seqlens (optional) marks document starts in the B * T flattened tokens:
  // it starts at 0, ends at B * T, increases strictly and holds every row start r * T; each
  // document then runs as if alone (recurrent state from zero, attention within it, positions
  // from 0).
  virtual StepResult forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B,
                                      int64_t T, bool backward,
                                      std::span<const int64_t> cu_seqlens = {}) = 0;
  virtual void zero_grad();
  // Every gradient *= s (the mean over accumulated micro-batches).
  virtual void scale_grads(float s);
  // Called after each optimizer step (MoE models nudge their expert-selection bias here).
  virtual void after_optimizer_step() {}
  // The optimizer that updates this model's weights where they live (host AdamW over params()
  // here; a GPU model keeps its moments on the device).
  virtual std::unique_ptr<Optimizer> make_optimizer(const AdamWConfig& config);
  // A model whose weights live on a device keeps params() as host mirrors: pull_values copies the
  // device's weights into every Param::value (before a checkpoint is written), push_values copies
  // Param::value to the device (after one is read). Host models have nothing to do.
  virtual void pull_values() {}
  virtual void push_values() {}
};

// The document boundaries of a [B, T] batch: cu_seqlens itself after checking the rules above
// (throws kda::Error "<who>: cu_seqlens must ..."), or the row starts 0, T, ..., B * T when it is
// empty (every row one document).
std::vector<int64_t> document_segments(std::span<const int64_t> cu_seqlens, int64_t B, int64_t T,
                                       const std::string& who);

}  // namespace kda::train
