// kda train: trains a lineage-family model (any mixer per layer), or a Kimi Linear / GPT-2
// architecture, on a synthetic task or a text corpus, with checkpoints, bit-exact --resume, a
// progress line, a JSONL log and a loss plot.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "apps/bench_util.h"
#include "apps/commands.h"
#include "core/error.h"
#include "core/timer.h"
#include "train/model_factory.h"
#include "train/trainer.h"

namespace kda::apps {
namespace {

std::atomic<bool> g_interrupted{false};
void on_sigint(int) {
  g_interrupted.store(true);
}

nlohmann::json read_json_file(const std::string& path) {
  std::ifstream in(path);
  require(bool(in), "train: cannot open " + path);
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw Error(path + ": not valid JSON: " + e.what());
  }
}

void print_usage() {
  std::puts(
      "usage: kda train --out DIR [--pattern KKKA] [--width 256] [--heads 2] [--head-dim 128]\n"
      "                 [--mlp 512] [--task mqar|palindrome|stack] [--vocab 8192]\n"
      "                 [--seq-len 256] [--steps 1000] [--batch 32] [--grad-accum 1]\n"
      "                 [--lr 1e-3] [--warmup min(100, steps/10)] [--weight-decay 0.1] [--clip "
      "1.0]\n"
      "                 [--save-every N] [--seed S] [--stop-after N]\n"
      "                 [--text PATH --tokenizer TOK [--val-every 10] [--split-paragraphs]]\n"
      "                 [--eval-every N] [--eval-examples N] [--device cpu|cuda]\n"
      "                 [--kda-gate softplus|bounded] [--gate-dt-max 0.1] [--gate-dt-per-channel]\n"
      "                 [--hybrid-rope] [--deterministic]\n"
      "       kda train --model CONFIG.json|MODEL_DIR --out DIR [the options above]\n"
      "       kda train --resume DIR [--stop-after N] [--device cpu|cuda] [--deterministic]\n"
      "\n"
      "Pattern letters, one per layer: A softmax attention, L linear attention, D DeltaNet,\n"
      "G Gated DeltaNet, K KDA, M NoPE MLA (KKKA, KKKM: 3:1 hybrids). AdamW with fp32 master\n"
      "weights, global gradient clipping, warmup + cosine, no weight decay on norms and gate\n"
      "parameters.\n"
      "DIR holds config.json, model.safetensors, optimizer.safetensors, trainer_state.json,\n"
      "log.jsonl and loss.svg; Ctrl-C saves a checkpoint before exiting; --resume continues\n"
      "bit for bit. --stop-after N stops (and saves) after N more steps.\n"
      "--device cuda trains a lineage model (any layer letter), GPT-2 or Kimi Linear on the\n"
      "GPU: bf16 compute, fp32 master weights and AdamW moments on the device; the checkpoint\n"
      "files are the same, so a run may resume on the other device. --kda-gate bounded: KDA's\n"
      "gate -5 sigmoid(...) (fla's safe gate) instead of -exp(A_log) softplus(...); on the\n"
      "GPU it also skips the test for chunks that decay past the kernel's bf16 split.\n"
      "--gate-dt-per-channel: KDA's starting decay drawn per channel, as fla's layer\n"
      "does, instead of once per head.\n"
      "--hybrid-rope: RoPE on a hybrid's softmax layers too (default NoPE there, as Kimi\n"
      "Linear's MLA; an all-softmax model always has RoPE).\n"
      "--deterministic: bit-reproducible GPU steps (the softmax attention backward off its\n"
      "fastest kernel, whose dQ sums are atomics); the CPU always is. Kept for --resume (and\n"
      "turned on there by giving it).\n"
      "\n"
      "--model trains a Hugging Face architecture instead of a lineage model: a kimi_linear or\n"
      "gpt2 config.json (fresh weights), or a model folder (its weights are the start). DIR is\n"
      "then a model folder itself (config.json, the public tensor names in model.safetensors):\n"
      "`kda run -m DIR` loads it. MoE layers balance their experts without an auxiliary loss\n"
      "(the selection bias follows the load).\n"
      "\n"
      "--text PATH trains a language model on a UTF-8 file or folder (each file a document, or\n"
      "each blank-line-separated paragraph with --split-paragraphs), tokenized by TOK (a model\n"
      "folder, NAME.tiktoken, tiktoken.model or GPT-2 vocab files) and packed into rows of\n"
      "--seq-len tokens whose documents never see each other; every --val-every'th document is\n"
      "held out. The vocabulary defaults to the tokenizer's. The validation loss is logged at\n"
      "the end and every --eval-every steps, over --eval-examples rows (0: all; default 256).");
}

}  // namespace

int cmd_train(const Args& args) {
  train::TrainSettings s;
  s.model = {8192, 256, 2, 128, 512, "KKKA"};
  s.task = {train::Task::mqar, 8192, 256, 0};
  std::string out_dir, resume_dir;
  int64_t stop_after = 0;
  std::string device;  // empty: the CPU for a new run, the checkpoint's device for --resume
  bool vocab_set = false, warmup_set = false;
  std::string text_path, tokenizer_path, model_path;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      print_usage();
      return 0;
    }
    if (a == "--split-paragraphs") {  // a switch: no value
      s.text.split_paragraphs = true;
      continue;
    }
    if (a == "--gate-dt-per-channel") {  // a switch: KDA's dt drawn per channel (fla's init)
      s.model.gate_dt_per_channel = true;
      continue;
    }
    if (a == "--hybrid-rope") {  // a switch: RoPE on a hybrid's softmax layers too
      s.model.hybrid_rope = true;
      continue;
    }
    if (a == "--deterministic") {  // a switch: bit-reproducible GPU steps
      s.deterministic = true;
      continue;
    }
    const std::string v = flag_value(args, i);
    auto real = [&](const std::string& text) {
      try {
        size_t used = 0;
        const double x = std::stod(text, &used);
        if (used == text.size()) return x;
      } catch (const std::exception&) {
      }
      throw Error("option " + a + ": '" + text + "' is not a number");
    };
    if (a == "--out")
      out_dir = v;
    else if (a == "--resume")
      resume_dir = v;
    else if (a == "--model")
      model_path = v;
    else if (a == "--pattern")
      s.model.pattern = v;
    else if (a == "--width")
      s.model.width = parse_int(v, a);
    else if (a == "--heads")
      s.model.heads = parse_int(v, a);
    else if (a == "--head-dim")
      s.model.head_dim = parse_int(v, a);
    else if (a == "--mlp")
      s.model.mlp_hidden = parse_int(v, a);
    else if (a == "--task")
      s.task.task = train::parse_task(v);
    else if (a == "--vocab") {
      s.task.vocab = s.model.vocab = parse_int(v, a);
      vocab_set = true;
    } else if (a == "--seq-len")
      s.task.seq_len = parse_int(v, a);
    else if (a == "--steps")
      s.steps = parse_int(v, a);
    else if (a == "--batch")
      s.batch = parse_int(v, a);
    else if (a == "--grad-accum")
      s.grad_accum = parse_int(v, a);
    else if (a == "--lr")
      s.optimizer.lr = float(real(v));
    else if (a == "--warmup") {
      s.optimizer.warmup_steps = parse_int(v, a);
      warmup_set = true;
    } else if (a == "--text")
      text_path = v;
    else if (a == "--tokenizer")
      tokenizer_path = v;
    else if (a == "--val-every")
      s.text.val_every = parse_int(v, a);
    else if (a == "--eval-every")
      s.eval_every = parse_int(v, a);
    else if (a == "--eval-examples")
      s.eval_examples = parse_int(v, a);
    else if (a == "--weight-decay")
      s.optimizer.weight_decay = float(real(v));
    else if (a == "--clip")
      s.optimizer.clip_norm = float(real(v));
    else if (a == "--save-every")
      s.save_every = parse_int(v, a);
    else if (a == "--seed")
      s.seed = uint64_t(parse_int(v, a));
    else if (a == "--stop-after")
      stop_after = parse_int(v, a);
    else if (a == "--device")
      device = v;
    else if (a == "--kda-gate")
      s.model.kda_gate = v;
    else if (a == "--gate-dt-max")
      s.model.gate_dt_max = float(real(v));
    else
      throw Error("train: unknown option '" + a + "' (see kda train --help)");
  }
  require(text_path.empty() == tokenizer_path.empty(), "train: --text and --tokenizer go together");
  if (!text_path.empty()) {
    s.text.path = text_path;
    s.text.tokenizer = tokenizer_path;
    if (!vocab_set) s.model.vocab = 0;  // the tokenizer's
  }
  if (!model_path.empty()) {
    namespace fs = std::filesystem;
    if (fs::is_directory(model_path)) {
      s.init_from = fs::absolute(model_path).lexically_normal().string();
      s.architecture = read_json_file((fs::path(model_path) / "config.json").string());
    } else {
      s.architecture = read_json_file(model_path);
    }
    s.architecture.erase("training");  // a checkpoint of ours as the start
  }
  if (!warmup_set)
    s.optimizer.warmup_steps = std::max<int64_t>(1, std::min<int64_t>(100, s.steps / 10));
  require(out_dir.empty() != resume_dir.empty(), "train: give exactly one of --out and --resume");
  if (!device.empty()) s.device = device;
  std::unique_ptr<train::Trainer> trainer =
      resume_dir.empty() ? std::make_unique<train::Trainer>(s, out_dir)
                         : train::Trainer::resume(resume_dir, device, s.deterministic);
  const train::TrainSettings& run = trainer->settings();
  const std::string dir = resume_dir.empty() ? out_dir : resume_dir;
  std::string data = "task " + train::task_name(run.task.task);
  if (const train::TextCorpus* c = trainer->corpus()) {
    data = "text " + run.text.path + " (" + std::to_string(c->train.num_documents()) +
           " documents, " + std::to_string(c->train.num_tokens()) + " tokens; validation " +
           std::to_string(c->validation.num_documents()) + " documents, " +
           std::to_string(c->validation.num_tokens()) + " tokens; vocab " +
           std::to_string(train::config_vocab(trainer->architecture())) + ")";
  }
  std::fprintf(stderr, "kda train: %s, %lld parameters, %s, T = %lld, %s step %lld/%lld\n",
               train::describe_architecture(trainer->architecture()).c_str(),
               (long long)trainer->num_params(), data.c_str(), (long long)run.task.seq_len,
               resume_dir.empty() ? "from" : "resuming at", (long long)trainer->step(),
               (long long)run.steps);
  std::signal(SIGINT, on_sigint);
  const bool tty = isatty(STDERR_FILENO);
  Stopwatch clock;
  const int64_t first = trainer->step();
  trainer->run(stop_after, &g_interrupted, [&](const train::StepLog& e) {
    const double done = double(e.step - first), left = double(run.steps - e.step);
    const double eta = done > 0 ? clock.seconds() / done * left : 0;
    const int width = 24, filled = int(width * double(e.step) / double(run.steps));
    const std::string bar = std::string(filled, '#') + std::string(width - filled, '.');
    if (tty) {
      std::fprintf(stderr, "\r[%s] %lld/%lld loss %.4f lr %.2e %.0f tok/s ETA %.0fs   ",
                   bar.c_str(), (long long)e.step, (long long)run.steps, e.loss, e.lr,
                   e.tokens_per_s, eta);
    } else if (e.step % std::max<int64_t>(1, run.steps / 20) == 0 || e.step == run.steps) {
      std::fprintf(stderr, "step %lld/%lld loss %.4f lr %.2e %.0f tok/s ETA %.0fs\n",
                   (long long)e.step, (long long)run.steps, e.loss, e.lr, e.tokens_per_s, eta);
    }
    if (e.evaluation) {
      std::fprintf(stderr, "%sstep %lld: validation loss %.4f, accuracy %.2f%% (%lld tokens)\n",
                   tty ? "\n" : "", (long long)e.step, e.evaluation->loss,
                   100 * e.evaluation->accuracy, (long long)e.evaluation->tokens);
    }
  });
  if (tty) std::fprintf(stderr, "\n");
  if (g_interrupted.load()) {
    std::fprintf(stderr, "interrupted: saved the checkpoint at step %lld in %s\n",
                 (long long)trainer->step(), dir.c_str());
    return 130;
  }
  if (run.is_text()) {
    const train::Evaluation e = trainer->evaluate_and_log();
    if (e.tokens == 0) {
      std::printf(
          "step %lld: no validation split (--val-every 0); checkpoint, log.jsonl and "
          "loss.svg in %s\n",
          (long long)trainer->step(), dir.c_str());
      return 0;
    }
    std::printf(
        "step %lld: validation loss %.4f (perplexity %.1f), next-token accuracy %.2f%% over %lld "
        "tokens; checkpoint, log.jsonl and loss.svg in %s\n",
        (long long)trainer->step(), e.loss, std::exp(e.loss), 100 * e.accuracy, (long long)e.tokens,
        dir.c_str());
    return 0;
  }
  const double accuracy = trainer->evaluate();
  std::printf("step %lld: test accuracy %.2f%%; checkpoint, log.jsonl and loss.svg in %s\n",
              (long long)trainer->step(), 100 * accuracy, dir.c_str());
  return 0;
}

}  // namespace kda::apps
