// kda train checkpoints: --save-every, resuming after a SIGKILL (mid-step or mid-save), a log
// left cut short by the kill, the run folder's files, and what loss.svg draws.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/safetensors.h"
#include "run_command.h"
#include "scratch_dir.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using kda::testing::run_kda;
using kda::testing::ScratchDir;

// a tiny model on MQAR: a step takes milliseconds on one core
const std::string kArgs =
    "--pattern KA --width 32 --heads 2 --head-dim 16 --mlp 64 --task mqar --vocab 64"
    " --seq-len 32 --batch 4 --lr 3e-3 --seed 5";

std::string read(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void write(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << text;
}

// log.jsonl's entries; a line that does not parse (a kill mid-write) ends the list
std::vector<json> log_entries(const fs::path& dir) {
  std::ifstream in(dir / "log.jsonl");
  std::vector<json> out;
  std::string line;
  while (std::getline(in, line)) {
    json j = json::parse(line, nullptr, false);
    if (j.is_discarded()) break;
    out.push_back(std::move(j));
  }
  return out;
}

// the entries without their timing, which differs between runs; everything else (step, loss,
// lr, grad_norm, validation) must match bit for bit (json compares doubles exactly)
std::vector<json> untimed(std::vector<json> entries) {
  for (json& e : entries) e.erase("tokens_per_s");
  return entries;
}

// the steps of the training lines (not evaluations), in log order
std::vector<int64_t> steps_of(const std::vector<json>& entries) {
  std::vector<int64_t> steps;
  for (const json& e : entries)
    if (e.contains("loss")) steps.push_back(e.at("step").get<int64_t>());
  return steps;
}

int64_t state_step(const fs::path& dir) {
  return json::parse(read(dir / "trainer_state.json")).at("step").get<int64_t>();
}

// Two runs' logs agree line for line except timing, and their losses are finite (two NaN runs
// must not match each other).
void expect_same_log(const fs::path& got, const fs::path& want) {
  const auto a = untimed(log_entries(got)), b = untimed(log_entries(want));
  ASSERT_EQ(a.size(), b.size()) << got << " vs " << want;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i], b[i]) << "line " << i + 1;
    if (a[i].contains("loss")) {
      EXPECT_TRUE(std::isfinite(a[i].at("loss").get<double>())) << a[i];
    }
  }
}

// The run folder holds the checkpoint's files and nothing else (no temporaries or staged files
// of an atomic write), each of them whole: JSON that parses, safetensors that open, all naming
// `step`.
void expect_complete_checkpoint(const fs::path& dir, int64_t step) {
  std::set<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.insert(entry.path().filename());
  EXPECT_EQ(names,
            (std::set<std::string>{"config.json", "log.jsonl", "loss.svg", "model.safetensors",
                                   "optimizer.safetensors", "trainer_state.json"}))
      << dir;
  const json config = json::parse(read(dir / "config.json"), nullptr, false);
  EXPECT_TRUE(config.is_object() && config.contains("training")) << read(dir / "config.json");
  EXPECT_EQ(state_step(dir), step);
  const auto entries = log_entries(dir);
  const std::string log = read(dir / "log.jsonl");
  EXPECT_EQ(entries.size(), size_t(std::count(log.begin(), log.end(), '\n')))
      << "a log line that does not parse: " << log;
  const auto steps = steps_of(entries);
  ASSERT_FALSE(steps.empty());
  EXPECT_EQ(steps.back(), step);
  const kda::SafetensorsFile model = kda::SafetensorsFile::open(dir / "model.safetensors");
  const kda::SafetensorsFile moments = kda::SafetensorsFile::open(dir / "optimizer.safetensors");
  EXPECT_FALSE(model.names().empty());
  for (const std::string& name : model.names()) {  // AdamW's two moments of each parameter
    EXPECT_TRUE(moments.contains("m." + name)) << name;
    EXPECT_TRUE(moments.contains("v." + name)) << name;
  }
  // both name their step, so that a resume can tell them from those of another save
  EXPECT_EQ(model.metadata().count("step") ? model.metadata().at("step") : "",
            std::to_string(step));
  EXPECT_EQ(moments.metadata().count("step") ? moments.metadata().at("step") : "",
            std::to_string(step));
  const std::string svg = read(dir / "loss.svg");
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_TRUE(svg.size() > 7 && svg.compare(svg.size() - 7, 7, "</svg>\n") == 0);
}

// `kda ARGS` as a child process, its output into `output`; the caller waits for it
pid_t start_kda(const std::string& args, const fs::path& output) {
  std::vector<std::string> words{KDA_BINARY};
  std::istringstream in(args);
  for (std::string w; in >> w;) words.push_back(w);
  const pid_t pid = fork();
  if (pid == 0) {
    const int out = open(output.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(out, 1);
    dup2(out, 2);
    std::vector<char*> argv;
    for (std::string& w : words) argv.push_back(w.data());
    argv.push_back(nullptr);
    execv(KDA_BINARY, argv.data());
    _exit(127);
  }
  return pid;
}

// --save-every 3 saves at each multiple of 3. A run killed by SIGKILL (no chance to save) holds
// the checkpoint of the last multiple of 3 whose save it finished, and resumes from it to the
// very log of a run that never stopped. The save of a multiple of 3 starts as soon as its log
// line is out: the kills come then, after 0 to 2.1 ms, so as to land in the save (about 3 ms on
// a local disk) at different points; each resume is killed again, and the last one finishes. Where
// each kill lands is up to the scheduler; the hand-made aftermaths below pin each case.
TEST(TrainCheckpoints, SigkilledRunResumesFromItsLastSaveEveryCheckpoint) {
  const ScratchDir scratch;
  const fs::path dir = scratch.file("killed"), ref = scratch.file("uninterrupted"),
                 output = scratch.file("output");
  // a long schedule, so that the kills come mid-run; both runs share it
  const std::string run = " --steps 100000 --save-every 3 " + kArgs;
  auto last_step = [&] {
    const auto steps = steps_of(log_entries(dir));
    return steps.empty() ? int64_t(0) : steps.back();
  };
  int64_t logged = 0, saved = 0;
  for (const int delay_us : {0, 700, 1400, 2100}) {
    const pid_t pid = start_kda(
        logged == 0 ? "train --out " + dir.string() + run : "train --resume " + dir.string(),
        output);
    ASSERT_GT(pid, 0);
    // a new step, a multiple of 3, after a save of step 3 or later
    const int64_t before = logged;
    auto saving = [&](int64_t step) { return step > before && step >= 6 && step % 3 == 0; };
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    int status = 0;
    bool ended = false;  // by itself: a failed resume
    while (!saving(last_step()) && !(ended = waitpid(pid, &status, WNOHANG) == pid) &&
           std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    if (!ended) {
      std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
    }
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
        << "the run ended by itself: " << read(output);
    logged = last_step();
    saved = state_step(dir);
    ASSERT_GT(logged, before);
    // step `logged` comes after the save of every multiple of 3 below it; its own save (when a
    // multiple of 3) may have been cut short
    EXPECT_TRUE(saved == logged / 3 * 3 || (logged % 3 == 0 && saved == logged - 3))
        << "checkpoint of step " << saved << " after step " << logged << " was logged";
  }

  const int64_t end = logged + 4;  // past the steps the killed runs logged
  ASSERT_EQ(
      run_kda("train --out " + ref.string() + run + " --stop-after " + std::to_string(end)).status,
      0);
  const auto resumed =
      run_kda("train --resume " + dir.string() + " --stop-after " + std::to_string(end - saved));
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  // each step once, in order, as in the uninterrupted run
  std::vector<int64_t> want;
  for (int64_t i = 1; i <= end; ++i) want.push_back(i);
  EXPECT_EQ(steps_of(log_entries(dir)), want);
  expect_same_log(dir, ref);
  expect_complete_checkpoint(dir, end);
}

// What a SIGKILL mid-step leaves: the checkpoint of step 3, log lines of later steps, the last
// one cut short mid-write. A resume drops them all and goes on as if never stopped.
TEST(TrainCheckpoints, ResumeDropsLogLinesPastTheCheckpointAndALastLineCutShort) {
  const ScratchDir scratch;
  const fs::path dir = scratch.file("killed"), ref = scratch.file("uninterrupted");
  const std::string run = " --steps 8 --eval-every 2 --eval-examples 16 " + kArgs;
  ASSERT_EQ(run_kda("train --out " + ref.string() + run).status, 0);
  ASSERT_EQ(run_kda("train --out " + dir.string() + run + " --stop-after 3").status, 0);
  // lines the killed run wrote after its checkpoint; their values differ from the real ones, so
  // that keeping any would show
  std::ofstream(dir / "log.jsonl", std::ios::app)
      << R"({"grad_norm":1.0,"loss":999.0,"lr":0.001,"step":4,"tokens_per_s":1.0})"
      << "\n"
      << R"({"step":4,"val_accuracy":0.5,"val_loss":999.0,"val_tokens":128})"
      << "\n"
      << R"({"grad_norm":1.0,"loss":999.0,"lr":0.001,"step":5,"tokens_per_s":1.0})"
      << "\n"
      << R"({"grad_norm":1.0,"lo)";  // no newline: the write was cut

  auto resumed = run_kda("train --resume " + dir.string() + " --stop-after 1");
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  // steps 1..4 and the evaluations of steps 2 and 4, each once, as the uninterrupted run's
  auto want = untimed(log_entries(ref));
  want.resize(6);
  EXPECT_EQ(untimed(log_entries(dir)), want);
  EXPECT_EQ(steps_of(log_entries(dir)), (std::vector<int64_t>{1, 2, 3, 4}));

  resumed = run_kda("train --resume " + dir.string());
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  expect_same_log(dir, ref);
}

// A line that does not parse before the last one is no kill's doing: the log is corrupt, and
// a resume says where instead of dropping what follows (or failing on a parser's message).
TEST(TrainCheckpoints, ResumeRefusesALogCorruptBeforeItsLastLine) {
  const ScratchDir scratch;
  const fs::path dir = scratch.file("run");
  ASSERT_EQ(run_kda("train --out " + dir.string() + " --steps 6 --stop-after 3 " + kArgs).status,
            0);
  std::string log = read(dir / "log.jsonl");
  const size_t second = log.find('\n') + 1;
  log.replace(second, log.find('\n', second) - second, R"({"grad_norm":1.0,"lo)");
  write(dir / "log.jsonl", log);
  const auto resumed = run_kda("train --resume " + dir.string());
  EXPECT_EQ(resumed.status, 1) << resumed.output;
  EXPECT_NE(resumed.output.find("log.jsonl: line 2 "), std::string::npos) << resumed.output;
  EXPECT_EQ(resumed.output.find("internal error"), std::string::npos) << resumed.output;
  EXPECT_EQ(read(dir / "log.jsonl"), log) << "the log was changed";
  EXPECT_EQ(state_step(dir), 3);
}

// Every file is written atomically: after a run, and after a resume, the folder holds the
// checkpoint's files only, each whole. (`kda run` loads Kimi Linear and GPT-2 folders only, not
// this lineage model's; the resume loading the files is the load test.)
TEST(TrainCheckpoints, RunFolderHoldsOnlyWholeFiles) {
  const ScratchDir scratch;
  const fs::path dir = scratch.file("run");
  const std::string run = " --steps 6 --save-every 2 --eval-every 3 --eval-examples 16 " + kArgs;
  ASSERT_EQ(run_kda("train --out " + dir.string() + run + " --stop-after 4").status, 0);
  expect_complete_checkpoint(dir, 4);
  const auto resumed = run_kda("train --resume " + dir.string());
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  expect_complete_checkpoint(dir, 6);
}

// A save killed midway. It stages the weights and moments (".model.safetensors.next", ...),
// commits by writing trainer_state.json, then moves the staged files into place; each atomic
// write goes through a temporary ("." + name + ".tmp" + digits). The aftermaths are made here
// from two checkpoints of one run, of steps 3 and 6:
//   killed before the commit: state and files of step 3, staged files of step 6, temporaries;
//   killed after it: state of step 6, staged files of step 6, files of step 3 in place.
// Both resume to the uninterrupted run's log and a clean folder. The torn folder the old
// in-place save could leave (state of step 6 over weights of step 3) is refused: it would
// resume without error to another log.
TEST(TrainCheckpoints, ResumeCompletesOrDropsASaveKilledMidway) {
  const ScratchDir scratch;
  const fs::path ref = scratch.file("uninterrupted"), at3 = scratch.file("step3"),
                 at6 = scratch.file("step6");
  const std::string run = " --steps 8 " + kArgs;
  ASSERT_EQ(run_kda("train --out " + ref.string() + run).status, 0);
  ASSERT_EQ(run_kda("train --out " + at3.string() + run + " --stop-after 3").status, 0);
  ASSERT_EQ(run_kda("train --out " + at6.string() + run + " --stop-after 6").status, 0);
  // the folder of step 6 with the weights and moments of step 3 in place, those of step 6
  // staged
  auto killed_save = [&](const std::string& name) {
    const fs::path dir = scratch.file(name);
    fs::copy(at6, dir);
    for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
      fs::rename(dir / f, dir / (std::string(".") + f + ".next"));
      fs::copy_file(at3 / f, dir / f);
    }
    return dir;
  };

  const fs::path before = killed_save("before_commit");
  fs::copy_file(at3 / "trainer_state.json", before / "trainer_state.json",
                fs::copy_options::overwrite_existing);
  write(before / ".trainer_state.json.tmp12345", "{\"st");
  write(before / "..model.safetensors.next.tmp678", "half a file");
  auto resumed = run_kda("train --resume " + before.string());
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  expect_same_log(before, ref);
  expect_complete_checkpoint(before, 8);

  const fs::path after = killed_save("after_commit");
  resumed = run_kda("train --resume " + after.string());
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  expect_same_log(after, ref);
  expect_complete_checkpoint(after, 8);

  const fs::path torn = scratch.file("torn");
  fs::copy(at6, torn);
  fs::copy_file(at3 / "model.safetensors", torn / "model.safetensors",
                fs::copy_options::overwrite_existing);
  resumed = run_kda("train --resume " + torn.string());
  EXPECT_EQ(resumed.status, 1) << resumed.output;
  EXPECT_NE(resumed.output.find("model.safetensors was saved at step 3"), std::string::npos)
      << resumed.output;
}

// the numbers of a space- or comma-separated list
std::vector<double> numbers(const std::string& text) {
  std::vector<double> out;
  const std::regex number(R"([-+0-9.eE]+)");
  for (auto it = std::sregex_iterator(text.begin(), text.end(), number);
       it != std::sregex_iterator(); ++it)
    out.push_back(std::stod(it->str()));
  return out;
}

// loss.svg draws the whole log, across a resume: one polyline vertex per logged step, placed
// left to right by step and up by loss on shared linear axes, one dot per logged evaluation at
// its step's x, and the y axis labeled with the lowest and highest loss drawn.
TEST(TrainCheckpoints, LossPlotDrawsEveryLoggedStepAndEvaluation) {
  const ScratchDir scratch;
  const fs::path dir = scratch.file("run");
  const std::string run = " --steps 7 --eval-every 2 --eval-examples 16 " + kArgs;
  ASSERT_EQ(run_kda("train --out " + dir.string() + run + " --stop-after 3").status, 0);
  ASSERT_EQ(run_kda("train --resume " + dir.string()).status, 0);
  std::vector<std::pair<double, double>> steps, evals;  // (step, loss) as logged
  for (const json& e : log_entries(dir)) {
    if (e.contains("loss")) steps.emplace_back(e.at("step"), e.at("loss"));
    if (e.contains("val_loss")) evals.emplace_back(e.at("step"), e.at("val_loss"));
  }
  ASSERT_EQ(steps.size(), 7u);
  ASSERT_EQ(evals.size(), 3u);
  const std::string svg = read(dir / "loss.svg");

  std::smatch m;
  ASSERT_TRUE(std::regex_search(svg, m, std::regex("<polyline[^>]* points='([^']*)'"))) << svg;
  const std::vector<double> xy = numbers(m[1].str());
  ASSERT_EQ(xy.size(), 2 * steps.size()) << "one vertex per logged step: " << m[1];
  // the axes: x from the first and last vertices, y from the lowest and highest losses (svg y
  // grows downward)
  size_t low = 0, high = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    if (steps[i].second < steps[low].second) low = i;
    if (steps[i].second > steps[high].second) high = i;
  }
  const size_t last = steps.size() - 1;
  const double x_per_step = (xy[2 * last] - xy[0]) / (steps[last].first - steps[0].first);
  const double y_per_loss =
      (xy[2 * low + 1] - xy[2 * high + 1]) / (steps[low].second - steps[high].second);
  ASSERT_GT(x_per_step, 0) << "later steps to the right";
  ASSERT_LT(y_per_loss, 0) << "higher losses higher up";
  auto x_of = [&](double step) { return xy[0] + x_per_step * (step - steps[0].first); };
  auto y_of = [&](double loss) {
    return xy[2 * high + 1] + y_per_loss * (loss - steps[high].second);
  };
  for (size_t i = 0; i < steps.size(); ++i) {  // 6 significant digits are written: 0.01 px
    EXPECT_NEAR(xy[2 * i], x_of(steps[i].first), 0.01) << "step " << steps[i].first;
    EXPECT_NEAR(xy[2 * i + 1], y_of(steps[i].second), 0.01) << "step " << steps[i].first;
  }

  const std::regex circle("<circle cx='([^']*)' cy='([^']*)'");
  std::vector<std::pair<double, double>> dots;
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), circle); it != std::sregex_iterator();
       ++it)
    dots.emplace_back(std::stod((*it)[1].str()), std::stod((*it)[2].str()));
  ASSERT_EQ(dots.size(), evals.size()) << "one dot per logged evaluation";
  for (size_t i = 0; i < dots.size(); ++i) {
    EXPECT_NEAR(dots[i].first, x_of(evals[i].first), 0.01) << "evaluation " << i;
    EXPECT_NEAR(dots[i].second, y_of(evals[i].second), 0.01) << "evaluation " << i;
  }

  // the y labels: the highest and the lowest loss of either kind
  double lo = steps[0].second, hi = lo;
  for (const auto* set : {&steps, &evals})
    for (const auto& [step, loss] : *set) lo = std::min(lo, loss), hi = std::max(hi, loss);
  std::vector<std::pair<double, double>> labels;  // (y, value), the upper first
  const std::regex label("<text x='[^']*' y='([^']*)'[^>]*>([-+0-9.eE]+)</text>");
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), label); it != std::sregex_iterator();
       ++it)
    labels.emplace_back(std::stod((*it)[1].str()), std::stod((*it)[2].str()));
  ASSERT_EQ(labels.size(), 2u) << svg;
  std::sort(labels.begin(), labels.end());
  EXPECT_NEAR(labels[0].second, hi, 1e-5 * hi);
  EXPECT_NEAR(labels[1].second, lo, 1e-5 * lo);
}

}  // namespace
