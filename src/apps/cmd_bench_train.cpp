// kda bench train: training throughput on this machine. A few optimizer steps of a model (a
// kimi_linear / gpt2 config, or a lineage pattern) on random tokens, or on a recall task's
// batches (only their answers are scored, and the LM head runs over those rows alone);
// tokens/s, the model FLOP rate by the 6 N rule (N: the matrix parameters one token multiplies
// through, experts counted at top_k / num_experts, the embedding lookup not at all, the head
// at the share of rows scored) and that rate against the measured fp32 GEMM ceiling.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "apps/bench_util.h"
#include "apps/commands.h"
#include "core/error.h"
#include "core/random.h"
#include "core/timer.h"
#include "train/adamw.h"
#include "train/model_factory.h"
#include "train/tasks.h"

namespace kda::apps {
namespace {

using json = nlohmann::json;

void print_usage() {
  std::puts(
      "usage: kda bench train [--model CONFIG.json | --pattern KKKA --width 256 --heads 2\n"
      "                        --head-dim 128 --mlp 512 --vocab 8192] [--seq-len 256]\n"
      "                        [--batch 8] [--steps 5] [--task mqar|palindrome|stack]\n"
      "\n"
      "Times --steps optimizer steps (after one warm-up step) of forward, backward and AdamW on\n"
      "random tokens (every position scored), or with --task on that recall task's batches\n"
      "(only the answers scored: the LM head runs over those rows alone), and prints tokens/s,\n"
      "model GFLOP/s (6 N per token, N the matrix parameters a token passes through, the head\n"
      "counted at the share of rows scored) and that rate as a share of the fp32 GEMM ceiling.");
}

// Matrix parameters one token multiplies through (see the file comment); the LM head (its own
// matrix, or GPT-2's tied wte) counts at head_share, the share of rows it runs over.
double active_matrix_params(train::TrainableModel& model, const json& config, double head_share) {
  const std::string type = config.at("model_type");
  double experts_share = 1.0;
  if (type == "kimi_linear" && config.value("num_experts", 0) > 0)
    experts_share = config.value("num_experts_per_token", 1.0) / config.value("num_experts", 1.0);
  double n = 0;
  for (const train::Param* p : model.params()) {
    if (p->value.rank() < 2) continue;
    const std::string& name = p->name;
    if (name == "model.embed_tokens.weight" || name == "embed" || name.ends_with("wpe.weight"))
      continue;  // lookups (GPT-2's tied wte is its head, so it counts)
    const bool head = name == "lm_head" || name == "lm_head.weight" || name.ends_with("wte.weight");
    const double share = head                                          ? head_share
                         : name.find(".experts.") != std::string::npos ? experts_share
                                                                       : 1.0;
    n += share * double(p->value.numel());
  }
  return n;
}

}  // namespace

int cmd_bench_train(const Args& args) {
  train::LineageConfig lineage{8192, 256, 2, 128, 512, "KKKA"};
  std::string model_path, task;
  int64_t seq_len = 256, batch = 8, steps = 5;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      print_usage();
      return 0;
    }
    const std::string v = flag_value(args, i);
    if (a == "--model")
      model_path = v;
    else if (a == "--pattern")
      lineage.pattern = v;
    else if (a == "--width")
      lineage.width = parse_int(v, a);
    else if (a == "--heads")
      lineage.heads = parse_int(v, a);
    else if (a == "--head-dim")
      lineage.head_dim = parse_int(v, a);
    else if (a == "--mlp")
      lineage.mlp_hidden = parse_int(v, a);
    else if (a == "--vocab")
      lineage.vocab = parse_int(v, a);
    else if (a == "--seq-len")
      seq_len = parse_int(v, a);
    else if (a == "--batch")
      batch = parse_int(v, a);
    else if (a == "--steps")
      steps = parse_int(v, a);
    else if (a == "--task")
      task = v;
    else
      throw Error("bench train: unknown option '" + a + "' (see kda bench train --help)");
  }
  require(seq_len >= 1 && batch >= 1 && steps >= 1, "bench train: sizes must be >= 1");
  json config = train::lineage_config_json(lineage);
  if (!model_path.empty()) {
    std::ifstream in(model_path);
    require(bool(in), "bench train: cannot open " + model_path);
    config = json::parse(in);
    config.erase("training");
  }
  const auto model = train::new_trainable(config, 1);
  const int64_t vocab = train::config_vocab(config);
  train::AdamWConfig opt;
  opt.warmup_steps = 1;
  opt.total_steps = steps + 1;
  train::AdamW adamw(model->params(), opt);
  Random rng(2);
  std::vector<int32_t> inputs(size_t(batch * seq_len)), targets(inputs.size());
  std::optional<train::TaskStream> tasks;
  if (!task.empty()) tasks.emplace(train::TaskSpec{train::parse_task(task), vocab, seq_len}, 2, 0);
  int64_t scored = 0, rows = 0;
  auto step = [&] {
    if (tasks) {
      train::Batch b = tasks->next(batch);
      inputs = std::move(b.inputs);
      targets = std::move(b.targets);
    } else {
      for (auto& x : inputs) x = int32_t(rng.integer(0, vocab - 1));
      for (auto& x : targets) x = int32_t(rng.integer(0, vocab - 1));
    }
    for (int32_t t : targets) scored += t >= 0;
    rows += int64_t(targets.size());
    model->zero_grad();
    model->forward_backward(inputs.data(), targets.data(), batch, seq_len, true);
    adamw.step();
    model->after_optimizer_step();
  };
  std::printf("machine: %s\n", machine_description().c_str());
  std::printf("model: %s, %lld parameters\n", train::describe_architecture(config).c_str(),
              (long long)model->num_params());
  const double gemm = measure_gemm_gflops(1024, 5);
  step();  // warm-up
  std::vector<double> times;
  for (int64_t s = 0; s < steps; ++s) {
    Stopwatch clock;
    step();
    times.push_back(clock.seconds());
  }
  std::sort(times.begin(), times.end());
  const double median = times[times.size() / 2];
  const double tokens = double(batch * seq_len);
  const double head_share = double(scored) / double(rows);
  const double n = active_matrix_params(*model, config, head_share);
  const double gflops = 6.0 * n * tokens / median / 1e9;
  if (tasks)
    std::printf("task %s: %.1f %% of the positions scored (the LM head's rows)\n", task.c_str(),
                100.0 * head_share);
  Table table({"batch x seq", "step ms (median)", "tokens/s", "6N GFLOP/s", "% of GEMM"});
  table.add({std::to_string(batch) + " x " + std::to_string(seq_len), fmt(median * 1e3, 1),
             fmt(tokens / median, 0), fmt(gflops, 1), fmt(100.0 * gflops / gemm, 1)});
  std::printf("fp32 GEMM 1024^3 ceiling: %.1f GFLOP/s; N = %.2f M matrix parameters per token\n\n",
              gemm, n / 1e6);
  table.print();
  return 0;
}

}  // namespace kda::apps
