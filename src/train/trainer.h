// Training runs of lineage-family models on synthetic tasks, with checkpoints in a folder:
//   config.json            the model (model_type "kda_lineage") and the run's settings
//   model.safetensors      the weights, by parameter name
//   optimizer.safetensors  AdamW moments ("m.<name>", "v.<name>")
//   trainer_state.json     step and data-stream position (what --resume needs)
//   log.jsonl              one line per step: step, loss, lr, grad_norm, tokens_per_s
//   loss.svg               the loss curve, written when the run ends
// Every file is written atomically; a resumed run continues bit for bit.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "train/adamw.h"
#include "train/lineage_model.h"
#include "train/tasks.h"

namespace kda::train {

struct TrainSettings {
  LineageConfig model;
  TaskSpec task;
  AdamWConfig optimizer;
  int64_t steps = 1000;
  int64_t batch = 32;
  int64_t grad_accum = 1;  // micro-batches per optimizer step
  int64_t save_every = 0;  // steps between checkpoints (0: at the end only)
  int64_t eval_examples = 256;
  uint64_t seed = 0;
};

struct StepLog {
  int64_t step = 0;
  double loss = 0, lr = 0, grad_norm = 0, tokens_per_s = 0;
};

class Trainer {
 public:
  // A new run writing into out_dir (created; must not hold a checkpoint already).
  Trainer(const TrainSettings& settings, const std::string& out_dir);
  // Continues the run saved in out_dir.
  static std::unique_ptr<Trainer> resume(const std::string& out_dir);
  ~Trainer();

  // Trains until settings.steps, `stop_after` more steps (0: no limit) or `interrupt` is set;
  // saves a checkpoint whenever it stops. on_step sees each step's log.
  void run(int64_t stop_after, const std::atomic<bool>* interrupt,
           const std::function<void(const StepLog&)>& on_step);
  // Test accuracy on the held-out set.
  double evaluate();
  void save() const;
  const TrainSettings& settings() const { return settings_; }
  int64_t step() const { return step_; }
  int64_t num_params() const { return model_->num_params(); }

 private:
  Trainer() = default;
  void start();
  TrainSettings settings_;
  std::string dir_;
  std::unique_ptr<LineageModel> model_;
  std::unique_ptr<AdamW> optimizer_;
  std::unique_ptr<TaskStream> stream_;
  TestSet test_;
  int64_t step_ = 0;
};

// Writes an SVG line plot of (step, loss) from a log.jsonl.
void write_loss_plot(const std::string& log_path, const std::string& svg_path);

}  // namespace kda::train
