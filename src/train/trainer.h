// Training runs of lineage-family models on synthetic tasks or on a text corpus
// (train/text_data.h), with checkpoints in a folder:
//   config.json            the model (model_type "kda_lineage") and the run's settings
//   model.safetensors      the weights, by parameter name
//   optimizer.safetensors  AdamW moments ("m.<name>", "v.<name>")
//   trainer_state.json     step and data-stream position (what --resume needs)
//   log.jsonl              one line per step: step, loss, lr, grad_norm, tokens_per_s; and one
//                          per evaluation: step, val_loss, val_accuracy, val_tokens
//   loss.svg               the loss curve (and validation points), written when the run ends
// Every file is written atomically, and a checkpoint as a whole: the weights and moments are
// staged (".model.safetensors.next", each tagged with its step), trainer_state.json commits them,
// then they move into place; a resume finishes or drops what a killed save left, refuses files
// of another step than the state's, and drops log lines past the checkpoint (and a last line
// cut short). A resumed run continues bit for bit.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "train/adamw.h"
#include "train/lineage_model.h"
#include "train/tasks.h"
#include "train/text_data.h"
#include "train/trainable_model.h"

namespace kda::train {

// A text corpus instead of a synthetic task (path empty: the task). Sequence length is
// TaskSpec::seq_len; the model's vocabulary (0: the tokenizer's) must cover the tokenizer's.
struct TextSettings {
  std::string path;       // file or folder of UTF-8 text (stored absolute)
  std::string tokenizer;  // anything tokenizer::load_tokenizer accepts (stored absolute)
  bool split_paragraphs = false;
  int64_t val_every = 10;    // every k-th document is validation (0: none)
  uint64_t fingerprint = 0;  // of the tokenized corpus; a resumed run must see the same one
};

struct TrainSettings {
  LineageConfig model;  // the lineage model, when `architecture` is null
  // A Hugging Face config (model_type kimi_linear or gpt2) to train instead; config.json of
  // the checkpoint is this config plus a "training" object, so transformers and `kda run`
  // load the folder as it is.
  nlohmann::json architecture;
  std::string init_from;  // a model folder whose weights start a new run (empty: fresh init)
  TaskSpec task;
  TextSettings text;
  AdamWConfig optimizer;
  int64_t steps = 1000;
  int64_t batch = 32;
  int64_t grad_accum = 1;       // micro-batches per optimizer step
  int64_t save_every = 0;       // steps between checkpoints (0: at the end only)
  int64_t eval_examples = 256;  // test examples; for text: validation rows (0: all)
  int64_t eval_every = 0;       // steps between evaluations during the run (0: none)
  uint64_t seed = 0;
  // Where the model trains: "cpu", or "cuda" (a lineage model on the GPU, bf16 compute with fp32
  // master weights; move_to_device in train/model_factory.h). Checkpoints are the same files.
  std::string device = "cpu";
  // Bit-reproducible GPU steps (DeviceTrainingOptions; the CPU always is); kept in the run's
  // config.json, so a --resume keeps it
  bool deterministic = false;
  bool is_text() const { return !text.path.empty(); }
};

// Held-out results: for text, cross-entropy and next-token accuracy over the validation rows;
// for tasks, over the test set's scored answers.
struct Evaluation {
  double loss = 0, accuracy = 0;
  int64_t tokens = 0;  // scored tokens
};

struct StepLog {
  int64_t step = 0;
  double loss = 0, lr = 0, grad_norm = 0, tokens_per_s = 0;
  std::optional<Evaluation> evaluation;  // set on steps that evaluated (eval_every)
};

class Trainer {
 public:
  // A new run writing into out_dir (created; must not hold a checkpoint already).
  Trainer(const TrainSettings& settings, const std::string& out_dir);
  // Continues the run saved in out_dir (on `device` when given, else where it ran;
  // `deterministic` turns TrainSettings::deterministic on from here, else the run's is kept).
  static std::unique_ptr<Trainer> resume(const std::string& out_dir, const std::string& device = "",
                                         bool deterministic = false);
  ~Trainer();

  // Trains until settings.steps, `stop_after` more steps (0: no limit) or `interrupt` is set;
  // saves a checkpoint whenever it stops. on_step sees each step's log.
  void run(int64_t stop_after, const std::atomic<bool>* interrupt,
           const std::function<void(const StepLog&)>& on_step);
  // Test accuracy on the held-out set.
  double evaluate() { return evaluate_held_out().accuracy; }
  Evaluation evaluate_held_out();
  // Evaluates, appends the result to log.jsonl and redraws loss.svg (unless this step's
  // evaluation is logged already: eval_every hit the last step).
  Evaluation evaluate_and_log();
  void save() const;
  const TrainSettings& settings() const { return settings_; }
  int64_t step() const { return step_; }
  int64_t num_params() const { return model_->num_params(); }
  // The model's config.json (lineage or Hugging Face), without the training settings.
  nlohmann::json architecture() const;
  const TextCorpus* corpus() const { return corpus_.get(); }  // text runs only

 private:
  Trainer() = default;
  void start(bool resuming = false);
  uint64_t data_position() const;
  // Draws the step's micro-batches and adds their gradients, weighted by scored tokens, into
  // the zeroed gradients; returns the loss over all their scored tokens.
  double accumulate_gradients();
  void log_evaluation(std::ostream& log, const Evaluation& e) const;
  TrainSettings settings_;
  std::string dir_;
  std::unique_ptr<TrainableModel> model_;
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<TaskStream> stream_;
  std::unique_ptr<PrefetchingStream> batches_;  // stream_'s batches, the next one made ahead
  TestSet test_;
  // text runs
  std::unique_ptr<TextCorpus> corpus_;
  std::unique_ptr<PackedRows> train_rows_, val_rows_;
  std::unique_ptr<TextStream> text_stream_;
  int64_t logged_eval_step_ = -1;  // the step whose evaluation log.jsonl holds last
  Evaluation logged_eval_;
  int64_t step_ = 0;
};

// Writes an SVG line plot of (step, loss) from a log.jsonl.
void write_loss_plot(const std::string& log_path, const std::string& svg_path);

}  // namespace kda::train
