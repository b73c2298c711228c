// kda bench recall: trains 2-layer models of every kind of the lineage on MQAR, Palindrome and
// Stack, and reports test accuracy (the Zoology / Kimi Linear synthetic recall tests).
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "apps/bench_util.h"
#include "apps/commands.h"
#include "core/error.h"
#include "core/parallel.h"
#include "core/safetensors.h"
#include "core/timer.h"
#include "train/recall.h"

namespace kda::apps {
namespace {

struct MixerEntry {
  std::string name, pattern;
  bool hybrid_rope = false;  // RoPE on the hybrid's softmax layer (Kimi Linear's MLA has none)
};

// The grid's mixers; kda+softmax_rope is not in the default grid but can be named: at 2 layers
// the NoPE hybrid cannot find Palindrome's mirrored position, the RoPE one can (RECALL.md).
const std::vector<MixerEntry> kMixers = {
    {"softmax", "AA"},     {"linear", "LL"}, {"delta", "DD"},
    {"gated_delta", "GG"}, {"kda", "KK"},    {"kda+softmax", "KA"},
};
const MixerEntry kHybridRope = {"kda+softmax_rope", "KA", true};

void print_usage() {
  std::puts(
      "usage: kda bench recall [--quick] [--steps N] [--lengths 256,512,1024,2048]\n"
      "                        [--mixers softmax,kda,...] [--tasks mqar,palindrome,stack]\n"
      "                        [--lrs 5e-4,1e-3,3e-3] [--jobs N] [--out DIR] [--batch 32]\n"
      "                        [--device cpu|cuda] [--kda-gate softplus|bounded] [--vocab V]\n"
      "                        [--gate-dt-max 0.1] [--seeds 1] [--continue] [--no-train]\n"
      "                        [--shard I/N] [--sweep-below A] [--gate-dt-per-channel]\n"
      "                        [--progress N] [--hybrid-rope] [--deterministic]\n"
      "\n"
      "Trains 2-layer models (2 heads, equal width across mixers) of each kind: softmax, linear,\n"
      "delta, gated_delta, kda and the kda+softmax hybrid, on MQAR (length/8 key-value pairs),\n"
      "Palindrome and Stack, best of a learning-rate sweep, and reports test accuracy.\n"
      "Full grid: heads of 128, vocab 8192, lengths 256-2048, lr {5e-4, 1e-3, 3e-3}, 20000\n"
      "steps (at vocab 8192 MQAR is not learned in 2000; hours of an H200 in all).\n"
      "--quick: heads of 32, vocab 128, lengths 64 and 128, lr 3e-3, 300 steps: a smoke run\n"
      "for two CPU cores (minutes, not a result: MQAR needs far more steps). --jobs N trains N\n"
      "cells at once, one thread each. Writes DIR/recall.md, recall.json (a list of {mixer,\n"
      "task, seq_len, accuracy, lr, seeds}), recall_runs.jsonl (every run, one line each, written\n"
      "as it finishes) and recall.svg (default out/recall). --continue keeps DIR's\n"
      "recall_runs.jsonl and trains only the runs it lacks (same settings), so a grid can span\n"
      "several calls of a time-limited machine; without it an earlier runs file is moved to\n"
      "recall_runs.before.N.jsonl, never overwritten.\n"
      "--seeds N trains every cell from N seeds (17, 18, ...): a cell's accuracy is the mean over\n"
      "them at the learning rate with the best mean, shown with its min-max; MQAR is learned in\n"
      "a sudden transition, so one seed cannot rank mixers near it.\n"
      "--gate-dt-per-channel draws KDA's starting decay per channel (fla's init) instead of\n"
      "once per head.\n"
      "--device cuda trains every cell on the GPU; --jobs N then runs N cells at once on the\n"
      "one GPU, each on its own stream.\n"
      "--shard I/N trains only shard I (0-based) of N of the runs still missing: the runs are\n"
      "dealt longest first to the least loaded shard (cost: tokens a step), the same way in\n"
      "every call that reads the same runs file, so N processes (one a GPU,\n"
      "scripts/recall_grid.sh) split a grid between them. --no-train trains nothing,\n"
      "reports the runs DIR's recall_runs.jsonl holds (cells without one show '-') and lists\n"
      "the runs still missing (with --sweep-below, those its rule still needs).\n"
      "--sweep-below A trains the other learning rates of a cell only where the first one\n"
      "(the first of --lrs) reached a mean accuracy below A (e.g. 0.99: the best of three\n"
      "cannot beat ~100 %); until the first rate's runs of a cell are finished (in this call\n"
      "or an earlier one), its other rates wait for a later --continue call.\n"
      "--progress N: every run prints its step, mean loss and time a step every N steps, and\n"
      "its line of recall_runs.jsonl keeps them (train_loss_curve: [step, loss] pairs).\n"
      "--hybrid-rope puts RoPE on the hybrid's softmax layer (default NoPE, as Kimi Linear's\n"
      "MLA; the softmax model always has RoPE). --mixers kda+softmax_rope names that hybrid as\n"
      "a mixer of its own, so one grid can hold both (not in the default grid).\n"
      "--deterministic: bit-reproducible GPU runs (a run's result is a function of its seed;\n"
      "the softmax attention backward off its fastest kernel); the CPU always is. Not a\n"
      "setting of the runs file: either way a run draws from the same distribution.");
}

std::vector<std::string> split(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(item);
  return out;
}

// accuracy vs length, one panel per task, one line per mixer
std::string svg_plot(const std::vector<std::string>& tasks, const std::vector<int64_t>& lengths,
                     const std::vector<MixerEntry>& mixers,
                     const std::map<std::string, double>& acc) {
  const int panel_w = 300, panel_h = 220, pad = 40;
  const char* colors[] = {"#d62728", "#7f7f7f", "#1f77b4", "#2ca02c",
                          "#9467bd", "#ff7f0e", "#8c564b"};
  std::ostringstream s;
  const int width = int(tasks.size()) * (panel_w + pad) + pad + 120;
  s << "<svg xmlns='http://www.w3.org/2000/svg' width='" << width << "' height='"
    << panel_h + 2 * pad + 14 << "' font-family='sans-serif' font-size='11'>\n";
  s << "<rect width='100%' height='100%' fill='white'/>\n";
  s << "<text x='" << pad << "' y='14'>test accuracy (best learning rate) by sequence length"
    << "</text>\n";
  for (size_t ti = 0; ti < tasks.size(); ++ti) {
    const int x0 = pad + int(ti) * (panel_w + pad), y0 = pad;
    s << "<rect x='" << x0 << "' y='" << y0 << "' width='" << panel_w << "' height='" << panel_h
      << "' fill='none' stroke='black'/>\n";
    s << "<text x='" << x0 + panel_w / 2 << "' y='" << y0 - 8 << "' text-anchor='middle'>"
      << tasks[ti] << "</text>\n";
    for (int tick = 0; tick <= 4; ++tick) {
      const int y = y0 + panel_h - tick * panel_h / 4;
      s << "<text x='" << x0 - 4 << "' y='" << y + 4 << "' text-anchor='end'>" << tick * 25
        << "%</text>\n";
    }
    auto px = [&](size_t li) {
      return x0 + (lengths.size() == 1 ? panel_w / 2
                                       : int(li * (panel_w - 20) / (lengths.size() - 1)) + 10);
    };
    for (size_t li = 0; li < lengths.size(); ++li) {
      s << "<text x='" << px(li) << "' y='" << y0 + panel_h + 14 << "' text-anchor='middle'>"
        << lengths[li] << "</text>\n";
    }
    for (size_t mi = 0; mi < mixers.size(); ++mi) {
      std::ostringstream points, dots;  // dots: a lone cell (or one hidden under a line) shows
      for (size_t li = 0; li < lengths.size(); ++li) {
        const auto it =
            acc.find(mixers[mi].name + "/" + tasks[ti] + "/" + std::to_string(lengths[li]));
        if (it == acc.end()) continue;
        const int x = px(li), y = y0 + panel_h - int(it->second * panel_h);
        points << x << "," << y << " ";
        dots << "<circle cx='" << x << "' cy='" << y << "' r='2.5' fill='"
             << colors[mi % std::size(colors)] << "'/>";
      }
      s << "<polyline fill='none' stroke-width='2' stroke='" << colors[mi % std::size(colors)]
        << "' points='" << points.str() << "'/>" << dots.str() << "\n";
    }
  }
  for (size_t mi = 0; mi < mixers.size(); ++mi) {
    const int x = width - 110, y = pad + 16 * int(mi);
    s << "<rect x='" << x << "' y='" << y - 8 << "' width='10' height='10' fill='"
      << colors[mi % std::size(colors)] << "'/><text x='" << x + 14 << "' y='" << y + 1 << "'>"
      << mixers[mi].name << "</text>\n";
  }
  s << "</svg>\n";
  return s.str();
}

// A runs file can hold hours of GPU time: a call without --continue starts a new one, but first
// moves the old one aside (recall_runs.before.N.jsonl, the first N not taken), never over it.
void keep_earlier_runs(const std::string& out_dir, const std::string& runs_path) {
  if (!std::filesystem::exists(runs_path) || std::filesystem::file_size(runs_path) == 0) return;
  std::string kept;
  for (int n = 1;; ++n) {
    kept = out_dir + "/recall_runs.before." + std::to_string(n) + ".jsonl";
    if (!std::filesystem::exists(kept)) break;
  }
  std::filesystem::rename(runs_path, kept);
  std::printf("moved the earlier runs to %s (--continue reuses them instead)\n", kept.c_str());
}

}  // namespace

int cmd_bench_recall(const Args& args) {
  bool quick = false, continue_runs = false, no_train = false;
  int64_t shard = 0, shards = 1;
  int64_t steps = 0;
  std::vector<int64_t> lengths;
  std::vector<std::string> task_names = {"mqar", "palindrome", "stack"};
  std::vector<MixerEntry> mixers = kMixers;
  std::string out_dir = "out/recall";
  std::vector<float> lrs;
  int64_t jobs = 1, batch = 0, vocab_option = 0, seeds = 1, progress_every = 0;
  std::string device = "cpu", kda_gate = "softplus";
  float gate_dt_max = 0.1f;
  bool gate_dt_per_channel = false, hybrid_rope = false, deterministic = false;
  double sweep_below = 2;  // --sweep-below: off (every learning rate of every cell)
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      print_usage();
      return 0;
    }
    if (a == "--quick") {
      quick = true;
      continue;
    }
    if (a == "--continue") {
      continue_runs = true;
      continue;
    }
    if (a == "--no-train") {
      continue_runs = no_train = true;
      continue;
    }
    if (a == "--gate-dt-per-channel") {
      gate_dt_per_channel = true;
      continue;
    }
    if (a == "--hybrid-rope") {
      hybrid_rope = true;
      continue;
    }
    if (a == "--deterministic") {
      deterministic = true;
      continue;
    }
    const std::string value = flag_value(args, i);
    if (a == "--steps")
      steps = parse_int(value, a);
    else if (a == "--lengths")
      lengths = parse_int_list(value, a);
    else if (a == "--tasks")
      task_names = split(value);
    else if (a == "--out")
      out_dir = value;
    else if (a == "--jobs")
      jobs = parse_int(value, a);
    else if (a == "--batch")
      batch = parse_int(value, a);
    else if (a == "--seeds")
      seeds = parse_int(value, a);
    else if (a == "--progress")
      progress_every = parse_int(value, a);
    else if (a == "--device")
      device = value;
    else if (a == "--kda-gate")
      kda_gate = value;
    else if (a == "--vocab")
      vocab_option = parse_int(value, a);
    else if (a == "--gate-dt-max")
      gate_dt_max = std::stof(value);
    else if (a == "--sweep-below") {
      sweep_below = std::stod(value);
      require(sweep_below > 0 && sweep_below <= 1, "bench recall: --sweep-below takes (0, 1]");
    } else if (a == "--shard") {
      const size_t slash = value.find('/');
      require(slash != std::string::npos, "bench recall: --shard takes I/N, e.g. 0/8");
      shard = parse_int(value.substr(0, slash), a);
      shards = parse_int(value.substr(slash + 1), a);
      require(shards >= 1 && shard >= 0 && shard < shards,
              "bench recall: --shard I/N needs 0 <= I < N");
    } else if (a == "--lrs") {
      for (const std::string& item : split(value)) {
        try {
          lrs.push_back(std::stof(item));
        } catch (const std::exception&) {
          throw Error("bench recall: --lrs: '" + item + "' is not a number");
        }
      }
    } else if (a == "--mixers") {
      mixers.clear();
      for (const std::string& name : split(value)) {
        if (name == kHybridRope.name) {
          mixers.push_back(kHybridRope);
          continue;
        }
        auto it = std::find_if(kMixers.begin(), kMixers.end(),
                               [&](const MixerEntry& m) { return m.name == name; });
        require(it != kMixers.end(), "bench recall: unknown mixer '" + name + "'");
        mixers.push_back(*it);
      }
    } else {
      throw Error("bench recall: unknown option '" + a + "' (see kda bench recall --help)");
    }
  }
  if (lengths.empty())
    lengths = quick ? std::vector<int64_t>{64, 128} : std::vector<int64_t>{256, 512, 1024, 2048};
  // the full grid's default: at vocabulary 8192 nothing learned MQAR in 2000 steps and every
  // delta-rule mixer did in 20,000 (length 256, docs/RECALL.md)
  if (steps == 0) steps = quick ? 300 : 20000;
  if (lrs.empty())
    lrs = quick ? std::vector<float>{3e-3f} : std::vector<float>{5e-4f, 1e-3f, 3e-3f};
  const int64_t head_dim = quick ? 32 : 128, vocab = vocab_option > 0 ? vocab_option
                                                     : quick          ? 128
                                                                      : 8192;
  for (const std::string& t : task_names) train::parse_task(t);
  require(seeds >= 1 && seeds <= 100, "bench recall: --seeds must be in [1, 100]");
  constexpr uint64_t kFirstSeed = 17;

  std::printf(
      "kda bench recall%s: %zu mixers x %zu tasks x %zu lengths x %zu lrs x %lld seeds, %lld "
      "steps, %d threads\n",
      quick ? " --quick" : "", mixers.size(), task_names.size(), lengths.size(), lrs.size(),
      (long long)seeds, (long long)steps, hardware_threads());
  const int64_t run_batch = batch > 0 ? batch : quick ? 16 : 32;
  const int64_t test_examples = quick ? 128 : 512;
  // What a finished run must share with this call to be reused by --continue.
  nlohmann::json settings = {{"steps", steps},
                             {"vocab", vocab},
                             {"head_dim", head_dim},
                             {"batch", run_batch},
                             {"test_examples", test_examples},
                             {"kda_gate", kda_gate},
                             {"gate_dt_max", gate_dt_max},
                             {"device", device}};
  // (only when set: the runs of earlier calls, made without it, stay reusable)
  if (gate_dt_per_channel) settings["gate_dt_per_channel"] = true;
  if (hybrid_rope) settings["hybrid_rope"] = true;
  // Every (task, length, mixer, lr, seed) is one independent training run; --jobs runs that
  // many at once, each single-threaded (small models scale better across runs than inside one).
  struct Cell {
    std::string task;
    int64_t T;
    MixerEntry mixer;
    float lr;
    uint64_t seed;
    train::RecallResult result;
    bool done = false;  // reused from an earlier call (--continue), or trained in this one
  };
  std::vector<Cell> cells;
  for (const std::string& task : task_names)
    for (int64_t T : lengths)
      for (const MixerEntry& m : mixers)
        for (float lr : lrs)
          for (int64_t k = 0; k < seeds; ++k) cells.push_back({task, T, m, lr, kFirstSeed + k, {}});
  std::filesystem::create_directories(out_dir);
  const std::string runs_path = out_dir + "/recall_runs.jsonl";
  size_t reused = 0;
  if (!continue_runs) keep_earlier_runs(out_dir, runs_path);
  if (continue_runs && std::filesystem::exists(runs_path)) {
    std::ifstream in(runs_path);
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      nlohmann::json r;
      try {
        r = nlohmann::json::parse(line);
      } catch (const std::exception&) {
        continue;  // a line cut short when an earlier call was stopped
      }
      if (!r.contains("settings") || r["settings"] != settings) continue;
      for (Cell& c : cells)
        if (!c.done && r["mixer"] == c.mixer.name && r["task"] == c.task && r["seq_len"] == c.T &&
            r["lr"].get<float>() == c.lr && r["seed"].get<uint64_t>() == c.seed) {
          c.result.accuracy = r["accuracy"].get<double>();
          c.result.final_loss = r["final_loss"].is_number() ? r["final_loss"].get<double>() : NAN;
          c.result.seconds = r["seconds"].get<double>();
          c.done = true;
          ++reused;
        }
    }
    std::printf("reusing %zu finished runs of %s\n", reused, runs_path.c_str());
  }
  // The runs to train, longest first (the sequence length stands for a step's cost, plus a
  // fixed share for the launches of a step): with --jobs the long runs start early, and
  // --shard deals them to the least loaded shard in this order (ties by grid order).
  // --sweep-below: a cell's other learning rates only where its first one fell short (decided
  // from the finished runs, the same way in every shard)
  size_t not_needed = 0, waiting = 0;
  auto sweep_needed = [&](const Cell& c) {
    if (sweep_below > 1 || c.lr == lrs[0]) return true;
    double sum = 0;
    int64_t n = 0;
    for (const Cell& f : cells)
      if (f.task == c.task && f.T == c.T && f.mixer.name == c.mixer.name && f.lr == lrs[0]) {
        if (!f.done) {
          ++waiting;
          return false;
        }
        sum += f.result.accuracy, ++n;
      }
    if (n > 0 && sum / double(n) >= sweep_below) {
      ++not_needed;
      return false;
    }
    return true;
  };
  std::vector<size_t> pending;
  for (size_t i = 0; i < cells.size(); ++i)
    if (!cells[i].done && sweep_needed(cells[i])) pending.push_back(i);
  if (sweep_below <= 1)
    std::printf(
        "sweep below %.3g: %zu runs not needed (the first rate reached it), %zu wait for the "
        "first rate's runs\n",
        sweep_below, not_needed, waiting);
  std::stable_sort(pending.begin(), pending.end(),
                   [&](size_t a, size_t b) { return cells[a].T > cells[b].T; });
  std::vector<int64_t> shard_load(size_t(shards), 0);
  std::vector<size_t> order;  // this call's runs, in training order
  for (size_t i : pending) {
    const size_t to =
        size_t(std::min_element(shard_load.begin(), shard_load.end()) - shard_load.begin());
    shard_load[to] += cells[i].T + 256;
    if (int64_t(to) == shard && !no_train) order.push_back(i);
  }
  if (shards > 1 || no_train) {
    std::printf("training %zu of the %zu missing runs", order.size(), pending.size());
    if (shards > 1) std::printf(" (shard %lld of %lld)", (long long)shard, (long long)shards);
    std::printf("\n");
    if (no_train)  // the plan for the calls still to make, longest first
      for (size_t i : pending)
        std::printf("  missing %-16s %-10s T=%-5lld lr %.0e seed %llu\n",
                    cells[i].mixer.name.c_str(), cells[i].task.c_str(), (long long)cells[i].T,
                    cells[i].lr, (unsigned long long)cells[i].seed);
    std::fflush(stdout);  // (a shard's log is a file: show the line before the hours of training)
  }
  bool cut_line = false;  // the file ends inside a line: start ours on a fresh one
  if (continue_runs && std::filesystem::exists(runs_path) &&
      std::filesystem::file_size(runs_path) > 0) {
    std::ifstream tail(runs_path, std::ios::binary);
    tail.seekg(-1, std::ios::end);
    cut_line = tail.get() != '\n';
  }
  std::ofstream runs_out(runs_path, continue_runs ? std::ios::app : std::ios::trunc);
  require(bool(runs_out), "bench recall: cannot write " + runs_path);
  if (cut_line) runs_out << "\n";
  Stopwatch total;
  std::atomic<size_t> next{0};
  std::mutex print_mutex;
  std::exception_ptr failure;
  auto worker = [&](bool single_threaded) {
    if (single_threaded) omp_set_num_threads(1);
    for (size_t k = next++; k < order.size(); k = next++) {
      Cell& c = cells[order[k]];
      train::RecallRun run;
      run.model = {vocab, 2 * head_dim, 2, head_dim, 4 * head_dim, c.mixer.pattern};
      run.model.kda_gate = kda_gate;
      run.model.gate_dt_max = gate_dt_max;
      run.model.gate_dt_per_channel = gate_dt_per_channel;
      run.model.hybrid_rope = hybrid_rope || c.mixer.hybrid_rope;
      run.device = device;
      run.deterministic = deterministic;
      run.task = {train::parse_task(c.task), vocab, c.T, 0};
      run.lr = c.lr;
      run.steps = steps;
      run.batch = run_batch;
      run.test_examples = test_examples;
      run.seed = c.seed;
      run.progress_every = progress_every;
      run.label = c.mixer.name + " " + c.task + " T=" + std::to_string(c.T) + " seed " +
                  std::to_string(c.seed);
      try {
        c.result = train::run_recall(run);
      } catch (...) {  // stop every worker; the first error is rethrown after the join
        std::lock_guard<std::mutex> lock(print_mutex);
        if (!failure) failure = std::current_exception();
        next = order.size();
        return;
      }
      std::lock_guard<std::mutex> lock(print_mutex);
      c.done = true;
      nlohmann::json line = {{"mixer", c.mixer.name},
                             {"task", c.task},
                             {"seq_len", c.T},
                             {"lr", c.lr},
                             {"seed", c.seed},
                             {"accuracy", c.result.accuracy},
                             {"final_loss", c.result.final_loss},
                             {"seconds", c.result.seconds},
                             {"settings", settings}};
      if (!c.result.loss_curve.empty()) line["train_loss_curve"] = c.result.loss_curve;
      runs_out << line.dump() << "\n" << std::flush;  // kept even if the call is stopped later
      std::fprintf(
          stderr, "  %-11s %-10s T=%-5lld lr %.0e seed %llu acc %5.1f%% loss %.3f  [%.0f s]\n",
          c.mixer.name.c_str(), c.task.c_str(), (long long)c.T, c.lr, (unsigned long long)c.seed,
          100 * c.result.accuracy, c.result.final_loss, total.seconds());
    }
  };
  if (jobs <= 1) {
    worker(false);
  } else {
    std::vector<std::thread> threads;
    for (int64_t j = 0; j < jobs; ++j) threads.emplace_back(worker, true);
    for (std::thread& t : threads) t.join();
  }
  if (failure) std::rethrow_exception(failure);
  // A cell's result: the mean over its seeds at the learning rate whose mean is best.
  struct Summary {
    double mean = -1, min = 0, max = 0;
    float lr = 0;
    std::vector<double> per_seed;
  };
  std::map<std::string, Summary> best;
  std::map<std::string, Summary> by_lr;     // every learning rate's, key + "/" + lr index
  std::map<std::string, double> best_mean;  // (the plot's input)
  nlohmann::json results = nlohmann::json::array();
  for (const std::string& task : task_names)
    for (int64_t T : lengths)
      for (const MixerEntry& m : mixers) {
        const std::string key = m.name + "/" + task + "/" + std::to_string(T);
        Summary& top = best[key];
        for (size_t li = 0; li < lrs.size(); ++li) {
          const float lr = lrs[li];
          Summary here;
          here.lr = lr;
          for (const Cell& c : cells)
            if (c.done && c.task == task && c.T == T && c.mixer.name == m.name && c.lr == lr)
              here.per_seed.push_back(c.result.accuracy);
          if (!here.per_seed.empty()) {  // (none yet: --shard, --no-train, --sweep-below)
            double sum = 0;
            for (double a : here.per_seed) sum += a;
            here.mean = sum / double(here.per_seed.size());
            here.min = *std::min_element(here.per_seed.begin(), here.per_seed.end());
            here.max = *std::max_element(here.per_seed.begin(), here.per_seed.end());
            if (here.mean > top.mean) top = here;
          }
          by_lr[key + "/" + std::to_string(li)] = here;
        }
        if (top.per_seed.empty()) continue;  // no run of this cell at any learning rate
        best_mean[key] = top.mean;
        results.push_back({{"mixer", m.name},
                           {"task", task},
                           {"seq_len", T},
                           {"accuracy", top.mean},
                           {"lr", top.lr},
                           {"seeds", top.per_seed},
                           {"accuracy_min", top.min},
                           {"accuracy_max", top.max}});
      }
  std::vector<std::string> header = {"mixer"};
  for (const std::string& task : task_names)
    for (int64_t T : lengths) header.push_back(task + " " + std::to_string(T));
  const auto cell_text = [&](const Summary& c) {
    if (c.per_seed.empty()) return std::string("-");
    std::string text = fmt(100 * c.mean, 1) + "%";
    if (seeds > 1) text += " (" + fmt(100 * c.min, 1) + "-" + fmt(100 * c.max, 1) + ")";
    if (int64_t(c.per_seed.size()) < seeds)  // some seeds not trained yet (--shard, --no-train)
      text += " [" + std::to_string(c.per_seed.size()) + "/" + std::to_string(seeds) + " seeds]";
    return text;
  };
  Table table(header);
  for (const MixerEntry& m : mixers) {
    std::vector<std::string> row = {m.name};
    for (const std::string& task : task_names)
      for (int64_t T : lengths)
        row.push_back(cell_text(best[m.name + "/" + task + "/" + std::to_string(T)]));
    table.add(row);
  }
  std::printf("\ntest accuracy (best lr%s), %.0f s\n",
              seeds > 1 ? "; mean over seeds (min-max)" : "", total.seconds());
  table.print();
  if (quick)
    std::printf(
        "(--quick, %lld steps: a smoke run that shows every mixer trains, not the papers'"
        " ranking;\n MQAR and Palindrome need thousands of steps: docs/RECALL.md)\n",
        static_cast<long long>(steps));
  table.write(out_dir, "recall");
  // With a sweep, every learning rate's cells too (a best-lr table hides how sharp the optimum
  // is, and where a mixer learned at one rate only), appended to recall.md.
  if (lrs.size() > 1) {
    std::vector<std::string> lr_header = header;
    lr_header.insert(lr_header.begin() + 1, "lr");
    Table lr_table(lr_header);
    for (const MixerEntry& m : mixers)
      for (size_t li = 0; li < lrs.size(); ++li) {
        char lr_text[16];
        std::snprintf(lr_text, sizeof lr_text, "%.0e", double(lrs[li]));
        std::vector<std::string> row = {m.name, lr_text};
        for (const std::string& task : task_names)
          for (int64_t T : lengths)
            row.push_back(cell_text(
                by_lr[m.name + "/" + task + "/" + std::to_string(T) + "/" + std::to_string(li)]));
        lr_table.add(row);
      }
    std::printf("\nby learning rate:\n");
    lr_table.print();
    std::string sweep_note;
    if (sweep_below <= 1) {
      char note[200];
      std::snprintf(note, sizeof note,
                    "\n(--sweep-below %.3g: the other rates were trained only where %.0e's mean "
                    "accuracy was below it; '-' marks a run not needed or not yet trained.)\n",
                    sweep_below, double(lrs[0]));
      sweep_note = note;
    }
    write_file_atomic(out_dir + "/recall.md", table.markdown() + "\nBy learning rate:\n\n" +
                                                  lr_table.markdown() + sweep_note);
  }
  write_file_atomic(out_dir + "/recall.json", results.dump(1) + "\n");
  write_file_atomic(out_dir + "/recall.svg", svg_plot(task_names, lengths, mixers, best_mean));
  std::printf("wrote %s/recall.md, recall.csv, recall.json, recall_runs.jsonl, recall.svg\n",
              out_dir.c_str());
  return 0;
}

}  // namespace kda::apps
