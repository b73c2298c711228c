#include "train/recall.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/timer.h"
#include "train/model_factory.h"

namespace kda::train {

RecallResult run_recall(const RecallRun& run) {
  Stopwatch clock;
  std::unique_ptr<TrainableModel> model_ptr =
      move_to_device(run.device, lineage_config_json(run.model),
                     std::make_unique<LineageModel>(run.model, run.seed * 7919 + 1),
                     {.deterministic = run.deterministic});
  TrainableModel& model = *model_ptr;
  const TestSet test = make_test_set(run.task, run.seed, run.test_examples);
  TaskStream stream(run.task, run.seed, 0);
  stream.forbid(test.hashes);
  AdamWConfig opt_config;
  opt_config.lr = run.lr;
  opt_config.total_steps = run.steps;
  opt_config.warmup_steps = std::max<int64_t>(1, run.steps / 10);
  const std::unique_ptr<Optimizer> opt = model.make_optimizer(opt_config);
  RecallResult result;
  result.params = model.num_params();
  double tail_loss = 0;
  int64_t tail = 0;
  PrefetchingStream batches(stream, run.batch);  // the next batch made while a step trains
  Stopwatch interval;
  double interval_loss = 0;
  for (int64_t step = 0; step < run.steps; ++step) {
    const Batch b = batches.next();
    model.zero_grad();
    const auto r = model.forward_backward(b.inputs.data(), b.targets.data(), b.B, b.T, true);
    if (!std::isfinite(r.loss)) {  // diverged: evaluate what we have
      if (run.progress_every > 0)
        std::fprintf(stderr, "  [%s] step %lld: loss %g, stopped\n", run.label.c_str(),
                     (long long)step + 1, r.loss);
      break;
    }
    opt->step();
    interval_loss += r.loss;
    if (run.progress_every > 0 && (step + 1) % run.progress_every == 0) {
      const double mean_loss = interval_loss / double(run.progress_every);
      result.loss_curve.emplace_back(step + 1, mean_loss);
      std::fprintf(stderr, "  [%s] step %lld/%lld loss %.3f %.1f ms/step\n", run.label.c_str(),
                   (long long)step + 1, (long long)run.steps, mean_loss,
                   1e3 * interval.seconds() / double(run.progress_every));
      interval_loss = 0;
      interval.reset();
    }
    if (step >= run.steps - std::max<int64_t>(1, run.steps / 10)) {
      tail_loss += r.loss;
      ++tail;
    }
  }
  result.final_loss = tail ? tail_loss / double(tail) : NAN;
  // evaluate in slices to bound memory
  int64_t scored = 0, correct = 0;
  const int64_t T = test.batch.T, slice = 32;
  for (int64_t i = 0; i < test.batch.B; i += slice) {
    const int64_t n = std::min(slice, test.batch.B - i);
    const auto r =
        model.forward_backward(&test.batch.inputs[i * T], &test.batch.targets[i * T], n, T, false);
    scored += r.scored;
    correct += r.correct;
  }
  result.accuracy = scored ? double(correct) / double(scored) : 0;
  result.seconds = clock.seconds();
  return result;
}

}  // namespace kda::train
