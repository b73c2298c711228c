#include "train/trainer.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/safetensors.h"
#include "core/timer.h"
#include "train/model_factory.h"

namespace kda::train {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

json settings_to_json(const TrainSettings& s) {
  json j = s.architecture.is_null() ? lineage_config_json(s.model) : s.architecture;
  j["training"] = {{"task", s.is_text() ? std::string("text") : task_name(s.task.task)},
                   {"task_vocab", s.task.vocab},
                   {"seq_len", s.task.seq_len},
                   {"num_kv", s.task.num_kv},
                   {"steps", s.steps},
                   {"batch", s.batch},
                   {"grad_accum", s.grad_accum},
                   {"save_every", s.save_every},
                   {"eval_examples", s.eval_examples},
                   {"eval_every", s.eval_every},
                   {"seed", s.seed},
                   {"device", s.device},
                   {"deterministic", s.deterministic},
                   {"lr", s.optimizer.lr},
                   {"warmup_steps", s.optimizer.warmup_steps},
                   {"weight_decay", s.optimizer.weight_decay},
                   {"clip_norm", s.optimizer.clip_norm},
                   {"beta1", s.optimizer.beta1},
                   {"beta2", s.optimizer.beta2},
                   {"min_lr_ratio", s.optimizer.min_lr_ratio}};
  if (!s.init_from.empty()) j["training"]["init_from"] = s.init_from;
  if (s.is_text()) {
    j["training"]["text"] = {{"path", s.text.path},
                             {"tokenizer", s.text.tokenizer},
                             {"split_paragraphs", s.text.split_paragraphs},
                             {"val_every", s.text.val_every},
                             {"fingerprint", s.text.fingerprint}};
  }
  return j;
}

TrainSettings settings_from_json(const json& j, const std::string& where) {
  try {
    TrainSettings s;
    if (j.at("model_type") == "kda_lineage") {
      s.model = lineage_config_from_json(j);
    } else {
      s.architecture = j;
      s.architecture.erase("training");
    }
    const json& t = j.at("training");
    s.init_from = t.value("init_from", std::string());
    if (t.at("task") == "text") {
      const json& x = t.at("text");
      s.task = {Task::mqar, t.at("task_vocab"), t.at("seq_len"), t.at("num_kv")};
      s.text = {x.at("path"), x.at("tokenizer"), x.at("split_paragraphs"), x.at("val_every"),
                x.at("fingerprint")};
    } else {
      s.task = {parse_task(t.at("task")), t.at("task_vocab"), t.at("seq_len"), t.at("num_kv")};
    }
    s.steps = t.at("steps");
    s.batch = t.at("batch");
    s.grad_accum = t.at("grad_accum");
    s.save_every = t.at("save_every");
    s.eval_examples = t.at("eval_examples");
    s.eval_every = t.value("eval_every", int64_t(0));  // absent in older checkpoints
    s.seed = t.at("seed");
    s.device = t.value("device", std::string("cpu"));
    s.deterministic = t.value("deterministic", false);  // absent in older checkpoints
    s.optimizer.lr = t.at("lr");
    s.optimizer.warmup_steps = t.at("warmup_steps");
    s.optimizer.weight_decay = t.at("weight_decay");
    s.optimizer.clip_norm = t.at("clip_norm");
    s.optimizer.beta1 = t.at("beta1");
    s.optimizer.beta2 = t.at("beta2");
    s.optimizer.min_lr_ratio = t.at("min_lr_ratio");
    s.optimizer.total_steps = s.steps;
    return s;
  } catch (const json::exception& e) {
    throw Error(where + ": " + e.what());
  }
}

// The tokenizer beside the weights, so `kda run -m DIR` finds it (a folder's tokenizer files,
// or a tiktoken.model; a bare NAME.tiktoken has no place in a model folder and stays out).
void copy_tokenizer_files(const std::string& tokenizer, const std::string& dir) {
  const fs::path from(tokenizer);
  if (fs::is_directory(from)) {
    for (const char* file : {"tiktoken.model", "vocab.json", "merges.txt", "encoder.json",
                             "vocab.bpe", "tokenizer_config.json"})
      if (fs::exists(from / file))
        fs::copy_file(from / file, fs::path(dir) / file, fs::copy_options::overwrite_existing);
  } else if (from.filename() == "tiktoken.model") {
    fs::copy_file(from, fs::path(dir) / "tiktoken.model", fs::copy_options::overwrite_existing);
  }
}

json read_json(const std::string& path) {
  std::ifstream in(path);
  require(bool(in), path + ": cannot open");
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    throw Error(path + ": not valid JSON: " + e.what());
  }
}

// A save is committed by trainer_state.json: the weights and the moments are written first under
// staging names (".model.safetensors.next"), each naming its step in its metadata, then the state
// file, then the staged files are renamed into place. A run killed mid-save so leaves the previous
// checkpoint whole (its staged files, of a step the state file does not name, are dropped), or a
// committed checkpoint with files still staged (moved into place): never weights of one step
// with the state of another, which would resume without error and off the uninterrupted run.
const char* const kStagedFiles[] = {"model.safetensors", "optimizer.safetensors"};

fs::path staged(const fs::path& dir, const std::string& file) {
  return dir / ("." + file + ".next");
}

// The step a checkpoint file was saved at (-1: untagged, saved before files were tagged).
int64_t saved_step(const fs::path& path) {
  const SafetensorsFile file = SafetensorsFile::open(path.string());
  const auto it = file.metadata().find("step");
  if (it == file.metadata().end()) return -1;
  try {
    return std::stoll(it->second);
  } catch (const std::exception&) {
    throw Error(path.string() + ": metadata 'step' is not a number: " + it->second);
  }
}

// write_file_atomic's temporary of a checkpoint file: "." + name + ".tmp" + digits
bool is_temporary(const std::string& name) {
  const size_t at = name.rfind(".tmp");
  if (name.empty() || name[0] != '.' || at == std::string::npos || at + 4 == name.size() ||
      name.find_first_not_of("0123456789", at + 4) != std::string::npos)
    return false;
  const std::string file = name.substr(1, at - 1);
  for (const char* f :
       {"config.json", "model.safetensors", "optimizer.safetensors", "trainer_state.json",
        "log.jsonl", "loss.svg", ".model.safetensors.next", ".optimizer.safetensors.next"})
    if (file == f) return true;
  return false;
}

// Completes or drops what a killed save left in dir: staged files of the committed step (-1:
// none) move into place, others go, and so do temporaries of killed atomic writes.
void finish_killed_save(const fs::path& dir, int64_t committed) {
  for (const char* file : kStagedFiles) {
    const fs::path next = staged(dir, file);
    if (!fs::exists(next)) continue;
    if (committed >= 0 && saved_step(next) == committed)
      fs::rename(next, dir / file);
    else
      fs::remove(next);
  }
  std::vector<fs::path> temporaries;
  for (const auto& entry : fs::directory_iterator(dir))
    if (is_temporary(entry.path().filename().string())) temporaries.push_back(entry.path());
  for (const fs::path& p : temporaries) fs::remove(p);
}

}  // namespace

Trainer::Trainer(const TrainSettings& settings, const std::string& out_dir)
    : settings_(settings), dir_(out_dir) {
  settings_.optimizer.total_steps = settings_.steps;
  require(settings_.steps >= 1 && settings_.batch >= 1 && settings_.grad_accum >= 1,
          "train: steps, batch and grad_accum must be >= 1");
  require(settings_.eval_every >= 0 && settings_.eval_examples >= 0,
          "train: eval_every and eval_examples must be >= 0");
  if (settings_.is_text()) {  // a resumed run may start from another folder
    settings_.text.path = fs::absolute(settings_.text.path).lexically_normal().string();
    settings_.text.tokenizer = fs::absolute(settings_.text.tokenizer).lexically_normal().string();
  }
  require(!fs::exists(fs::path(out_dir) / "trainer_state.json"),
          out_dir + " already holds a run: use --resume, or another --out");
  fs::create_directories(out_dir);
  finish_killed_save(out_dir, -1);  // a first save that was killed: nothing committed
  start();
  std::ofstream(fs::path(dir_) / "log.jsonl", std::ios::trunc);
  if (settings_.is_text()) copy_tokenizer_files(settings_.text.tokenizer, out_dir);
}

Trainer::~Trainer() = default;

void Trainer::start(bool resuming) {
  if (settings_.is_text()) {
    const TextSettings& text = settings_.text;
    corpus_ = std::make_unique<TextCorpus>(
        load_text_corpus(text.path, text.tokenizer,
                         {.split_paragraphs = text.split_paragraphs, .val_every = text.val_every}));
    require(text.fingerprint == 0 || text.fingerprint == corpus_->fingerprint,
            "train: " + text.path + " no longer tokenizes to the corpus this run started on");
    settings_.text.fingerprint = corpus_->fingerprint;
    require(text.val_every == 0 || corpus_->validation.num_tokens() > 0,
            "train: " + text.path + " has too few documents for a validation split (every " +
                std::to_string(text.val_every) + "th document; --val-every 0 turns it off)");
    settings_.task.vocab = corpus_->vocab;
    if (settings_.model.vocab == 0) settings_.model.vocab = corpus_->vocab;
    if (!settings_.architecture.is_null()) settings_.model.vocab = 0;  // unused
    const int32_t pad = std::max(0, corpus_->end_of_text);
    train_rows_ = std::make_unique<PackedRows>(corpus_->train, settings_.task.seq_len, pad);
    if (corpus_->validation.num_tokens() > 0)
      val_rows_ = std::make_unique<PackedRows>(corpus_->validation, settings_.task.seq_len, pad);
    text_stream_ = std::make_unique<TextStream>(*train_rows_, settings_.seed);
  }
  const json arch = architecture();
  require(config_vocab(arch) >= settings_.task.vocab,
          settings_.is_text() ? "train: the model's vocabulary is smaller than the tokenizer's"
                              : "train: the model's vocabulary is smaller than the task's");
  const uint64_t init_seed = settings_.seed * 7919 + 1;
  if (settings_.init_from.empty() || resuming) {  // a resumed run loads its checkpoint
    model_ = new_trainable(arch, init_seed);
  } else {
    model_ = load_trainable(settings_.init_from);
    require(model_->params().size() == new_trainable(arch, init_seed)->params().size(),
            "train: " + settings_.init_from + " does not hold the configured architecture");
  }
  model_ = move_to_device(settings_.device, arch, std::move(model_),
                          {.deterministic = settings_.deterministic});
  optimizer_ = model_->make_optimizer(settings_.optimizer);
  if (!settings_.is_text()) {
    test_ = make_test_set(settings_.task, settings_.seed, settings_.eval_examples);
    stream_ = std::make_unique<TaskStream>(settings_.task, settings_.seed, 0);
    stream_->forbid(test_.hashes);
    batches_ = std::make_unique<PrefetchingStream>(*stream_, settings_.batch);
  }
}

json Trainer::architecture() const {
  return settings_.architecture.is_null() ? lineage_config_json(settings_.model)
                                          : settings_.architecture;
}

uint64_t Trainer::data_position() const {
  return text_stream_ ? text_stream_->position() : batches_->position();
}

std::unique_ptr<Trainer> Trainer::resume(const std::string& out_dir, const std::string& device,
                                         bool deterministic) {
  const fs::path dir(out_dir);
  std::unique_ptr<Trainer> t(new Trainer());
  t->dir_ = out_dir;
  t->settings_ =
      settings_from_json(read_json((dir / "config.json").string()), (dir / "config.json").string());
  if (!device.empty()) t->settings_.device = device;
  if (deterministic) t->settings_.deterministic = true;
  t->start(true);
  const json state = read_json((dir / "trainer_state.json").string());
  t->step_ = state.at("step").get<int64_t>();
  finish_killed_save(dir, t->step_);
  for (const char* file : kStagedFiles) {
    const int64_t step = saved_step(dir / file);
    require(step < 0 || step == t->step_,
            out_dir + "/" + file + " was saved at step " + std::to_string(step) +
                " but trainer_state.json names step " + std::to_string(t->step_) +
                ": the checkpoint is torn");
  }
  const uint64_t position = state.at("data_position").get<uint64_t>();
  if (t->text_stream_)
    t->text_stream_->seek(position);
  else
    t->stream_->seek(position);
  const SafetensorsFile weights = SafetensorsFile::open((dir / "model.safetensors").string());
  for (Param* p : t->model_->params()) {
    const Tensor w = weights.load(p->name);
    require(w.shape() == p->value.shape(),
            out_dir + "/model.safetensors: '" + p->name + "' has the wrong shape");
    std::copy(w.f32(), w.f32() + w.numel(), p->value.f32());
  }
  t->model_->push_values();
  const SafetensorsFile opt = SafetensorsFile::open((dir / "optimizer.safetensors").string());
  std::vector<std::pair<std::string, Tensor>> moments;
  for (const std::string& name : opt.names()) moments.emplace_back(name, opt.load(name));
  t->optimizer_->load_state(moments, t->step_);
  // drop log lines past the checkpoint (written after it by an interrupted run), and a last line
  // cut short by a kill mid-write; an unreadable line before the last is corruption
  const std::string log_path = (dir / "log.jsonl").string();
  std::vector<std::pair<int64_t, std::string>> lines;  // line number, text
  {
    std::ifstream in(log_path);
    std::string line;
    for (int64_t number = 1; std::getline(in, line); ++number)
      if (!line.empty()) lines.emplace_back(number, line);
  }
  std::string kept;
  for (size_t i = 0; i < lines.size(); ++i) {
    const auto& [number, line] = lines[i];
    const json entry = json::parse(line, nullptr, false);
    if (entry.is_discarded() && i + 1 == lines.size()) break;  // cut short
    require(entry.is_object() && entry.contains("step") && entry["step"].is_number_integer(),
            log_path + ": line " + std::to_string(number) +
                " is not a log entry (not JSON with a step); the log is corrupt");
    const int64_t step = entry["step"].get<int64_t>();
    if (step > t->step_) continue;
    kept += line + "\n";
    if (step == t->step_ && entry.contains("val_loss")) {  // evaluated at the checkpoint: once
      t->logged_eval_step_ = step;
      t->logged_eval_ = {entry.at("val_loss").get<double>(), entry.at("val_accuracy").get<double>(),
                         entry.at("val_tokens").get<int64_t>()};
    }
  }
  write_file_atomic(log_path, kept);
  return t;
}

void Trainer::save() const {
  const fs::path dir(dir_);
  write_file_atomic((dir / "config.json").string(), settings_to_json(settings_).dump(2) + "\n");
  model_->pull_values();
  std::vector<NamedTensor> weights;
  for (Param* p : model_->params()) weights.push_back({p->name, &p->value});
  const std::string step = std::to_string(step_);
  write_safetensors(staged(dir, "model.safetensors").string(), weights,
                    {{"format", "pt"}, {"step", step}});
  const auto moments = optimizer_->state();
  std::vector<NamedTensor> named;
  for (const auto& [name, t] : moments) named.push_back({name, &t});
  write_safetensors(staged(dir, "optimizer.safetensors").string(), named, {{"step", step}});
  // the commit (kStagedFiles above): the checkpoint is of this step once the state file names it
  const json state = {{"step", step_}, {"data_position", data_position()}};
  write_file_atomic((dir / "trainer_state.json").string(), state.dump(2) + "\n");
  for (const char* file : kStagedFiles) fs::rename(staged(dir, file), dir / file);
}

double Trainer::accumulate_gradients() {
  // The micro-batches of one step, drawn first: their scored tokens decide their weights.
  std::vector<TextBatch> micro(size_t(settings_.grad_accum));
  std::vector<int64_t> scored(micro.size(), 0);
  int64_t total = 0;
  for (size_t i = 0; i < micro.size(); ++i) {
    if (text_stream_) {
      micro[i] = text_stream_->next(settings_.batch);
    } else {
      Batch b = batches_->next();
      micro[i] = {b.B, b.T, std::move(b.inputs), std::move(b.targets), {}};
    }
    for (const int32_t t : micro[i].targets) scored[i] += t >= 0;
    total += scored[i];
  }
  // One step over them equals one batch of all of them: each micro-batch's mean-loss gradient
  // weighted by its share of the scored tokens (Stack and text score a varying number a row;
  // equal weights would tilt the step toward the sparse micro-batches). The backward adds into
  // the gradients, so the sum so far is rescaled before each addition (to the next weight's
  // units) and once at the end.
  double loss = 0, previous = 0;
  for (size_t i = 0; i < micro.size(); ++i) {
    if (total > 0 && scored[i] == 0) continue;  // nothing scored: adds nothing
    const double w = total > 0 ? double(scored[i]) / double(total) : 1.0 / double(micro.size());
    if (previous > 0 && previous != w) model_->scale_grads(float(previous / w));
    const TextBatch& b = micro[i];
    loss +=
        w *
        model_->forward_backward(b.inputs.data(), b.targets.data(), b.B, b.T, true, b.cu_seqlens)
            .loss;
    previous = w;
  }
  if (previous > 0 && previous != 1.0) model_->scale_grads(float(previous));
  return loss;
}

void Trainer::run(int64_t stop_after, const std::atomic<bool>* interrupt,
                  const std::function<void(const StepLog&)>& on_step) {
  std::ofstream log(fs::path(dir_) / "log.jsonl", std::ios::app);
  const int64_t end =
      stop_after > 0 ? std::min(settings_.steps, step_ + stop_after) : settings_.steps;
  while (step_ < end && !(interrupt && interrupt->load())) {
    Stopwatch clock;
    model_->zero_grad();
    const double loss = accumulate_gradients();
    StepLog entry;
    entry.step = step_ + 1;
    entry.lr = optimizer_->lr_at(step_);
    entry.grad_norm = optimizer_->step();
    model_->after_optimizer_step();
    entry.loss = loss;
    entry.tokens_per_s =
        double(settings_.batch * settings_.grad_accum * settings_.task.seq_len) / clock.seconds();
    ++step_;
    log << json{{"step", entry.step},
                {"loss", entry.loss},
                {"lr", entry.lr},
                {"grad_norm", entry.grad_norm},
                {"tokens_per_s", entry.tokens_per_s}}
               .dump()
        << "\n";
    if (settings_.eval_every > 0 && step_ % settings_.eval_every == 0 &&
        (!settings_.is_text() || val_rows_)) {
      entry.evaluation = evaluate_held_out();
      log_evaluation(log, *entry.evaluation);
      logged_eval_step_ = step_;
      logged_eval_ = *entry.evaluation;
    }
    log.flush();
    if (on_step) on_step(entry);
    if (settings_.save_every > 0 && step_ % settings_.save_every == 0) save();
  }
  log.close();
  save();
  write_loss_plot((fs::path(dir_) / "log.jsonl").string(), (fs::path(dir_) / "loss.svg").string());
}

Evaluation Trainer::evaluate_held_out() {
  double loss_sum = 0;
  int64_t scored = 0, correct = 0;
  auto add = [&](const StepResult& r) {
    loss_sum += r.loss * double(r.scored);
    scored += r.scored;
    correct += r.correct;
  };
  if (settings_.is_text()) {
    if (!val_rows_) return {};  // --val-every 0: nothing held out
    const int64_t rows = settings_.eval_examples > 0
                             ? std::min(settings_.eval_examples, val_rows_->num_rows())
                             : val_rows_->num_rows();
    const int64_t slice = 8;
    for (int64_t i = 0; i < rows; i += slice) {
      std::vector<int64_t> picked;
      for (int64_t r = i; r < std::min(rows, i + slice); ++r) picked.push_back(r);
      const TextBatch b = val_rows_->batch(picked);
      add(model_->forward_backward(b.inputs.data(), b.targets.data(), b.B, b.T, false,
                                   b.cu_seqlens));
    }
  } else {
    const int64_t T = test_.batch.T, slice = 32;
    for (int64_t i = 0; i < test_.batch.B; i += slice) {
      const int64_t n = std::min(slice, test_.batch.B - i);
      add(model_->forward_backward(&test_.batch.inputs[i * T], &test_.batch.targets[i * T], n, T,
                                   false));
    }
  }
  Evaluation e;
  e.tokens = scored;
  e.loss = scored ? loss_sum / double(scored) : 0;
  e.accuracy = scored ? double(correct) / double(scored) : 0;
  return e;
}

void Trainer::log_evaluation(std::ostream& log, const Evaluation& e) const {
  log << json{{"step", step_},
              {"val_loss", e.loss},
              {"val_accuracy", e.accuracy},
              {"val_tokens", e.tokens}}
             .dump()
      << "\n";
}

Evaluation Trainer::evaluate_and_log() {
  if (logged_eval_step_ == step_) return logged_eval_;
  const Evaluation e = evaluate_held_out();
  if (e.tokens == 0) return e;  // nothing held out: nothing to log
  logged_eval_step_ = step_;
  logged_eval_ = e;
  {
    std::ofstream log(fs::path(dir_) / "log.jsonl", std::ios::app);
    log_evaluation(log, e);
  }
  write_loss_plot((fs::path(dir_) / "log.jsonl").string(), (fs::path(dir_) / "loss.svg").string());
  return e;
}

void write_loss_plot(const std::string& log_path, const std::string& svg_path) {
  std::vector<std::pair<double, double>> points, val_points;
  std::ifstream in(log_path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const json j = json::parse(line);
    if (j.contains("loss"))
      points.emplace_back(j.at("step").get<double>(), j.at("loss").get<double>());
    else if (j.contains("val_loss"))
      val_points.emplace_back(j.at("step").get<double>(), j.at("val_loss").get<double>());
  }
  const int W = 640, H = 360, pad = 50;
  std::ostringstream s;
  s << "<svg xmlns='http://www.w3.org/2000/svg' width='" << W << "' height='" << H
    << "' font-family='sans-serif' font-size='11'>\n<rect width='100%' height='100%' "
       "fill='white'/>\n";
  s << "<rect x='" << pad << "' y='" << pad / 2 << "' width='" << W - 1.5 * pad << "' height='"
    << H - 1.5 * pad << "' fill='none' stroke='black'/>\n";
  if (!points.empty()) {
    double lo = points[0].second, hi = lo, x_max = 1;
    for (const auto* set : {&points, &val_points})
      for (const auto& p : *set) {
        lo = std::min(lo, p.second);
        hi = std::max(hi, p.second);
        x_max = std::max(x_max, p.first);
      }
    if (hi - lo < 1e-9) hi = lo + 1;
    auto X = [&](double step) { return pad + (W - 1.5 * pad) * step / x_max; };
    auto Y = [&](double loss) { return pad / 2 + (H - 1.5 * pad) * (hi - loss) / (hi - lo); };
    s << "<polyline fill='none' stroke='#1f77b4' stroke-width='1.5' points='";
    for (const auto& p : points) s << X(p.first) << "," << Y(p.second) << " ";
    s << "'/>\n";
    for (const auto& p : val_points)  // held-out evaluations
      s << "<circle cx='" << X(p.first) << "' cy='" << Y(p.second) << "' r='3' fill='#ff7f0e'/>\n";
    s << "<text x='" << pad - 4 << "' y='" << Y(hi) + 4 << "' text-anchor='end'>" << hi
      << "</text>\n<text x='" << pad - 4 << "' y='" << Y(lo) + 4 << "' text-anchor='end'>" << lo
      << "</text>\n<text x='" << X(x_max) << "' y='" << H - pad / 2 + 14
      << "' text-anchor='end'>step " << x_max << "</text>\n";
  }
  s << "<text x='" << W / 2 << "' y='" << H - 8 << "' text-anchor='middle'>training loss"
    << (val_points.empty() ? "" : " (dots: validation loss)") << "</text>\n";
  s << "</svg>\n";
  write_file_atomic(svg_path, s.str());
}

}  // namespace kda::train
