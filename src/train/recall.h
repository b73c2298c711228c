// The recall benchmark's unit of work: train one model on one synthetic task, report the test
// accuracy on the scored positions.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "train/adamw.h"
#include "train/lineage_model.h"
#include "train/tasks.h"

namespace kda::train {

struct RecallRun {
  LineageConfig model;
  TaskSpec task;
  float lr = 1e-3f;
  int64_t steps = 1000;
  int64_t batch = 32;
  int64_t test_examples = 256;
  uint64_t seed = 0;
  std::string device = "cpu";  // or "cuda" (train/model_factory.h's move_to_device)
  bool deterministic = false;  // DeviceTrainingOptions (the CPU always is)
  // every progress_every steps (0: never), one line on stderr: label, step, the interval's mean
  // loss and time a step (a long GPU run is otherwise silent until it ends)
  int64_t progress_every = 0;
  std::string label;
};

struct RecallResult {
  double accuracy = 0;    // on the held-out test set
  double final_loss = 0;  // mean train loss over the last 10% of steps
  double seconds = 0;
  int64_t params = 0;
  // with progress_every: (step, mean training loss over the interval that ends there), to see
  // when a run left a plateau without its log
  std::vector<std::pair<int64_t, double>> loss_curve;
};

RecallResult run_recall(const RecallRun& run);

}  // namespace kda::train
