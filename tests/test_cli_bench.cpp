// The measuring commands end to end through the built binary: they run, write their files,
// and fail with a clear message on bad flags.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "run_command.h"
#include "scratch_dir.h"

namespace {

using kda::testing::CommandResult;

CommandResult run(const std::string& args) {
  return kda::testing::run_kda(args);
}

std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(CliBench, LineageWritesMarkdownAndCsvWithEveryMixer) {
  const kda::testing::ScratchDir scratch;  // this test's own folder
  const std::filesystem::path out_root(scratch.str());
  const CommandResult r =
      run("lineage --contexts 64,200 --heads 2 --dim 32 --out " + out_root.string());
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string csv = slurp(out_root / "lineage.csv");
  for (const char* mixer :
       {"GPT-2 recompute", "KV cache", "linear attention", "DeltaNet", "Gated DeltaNet", "KDA"}) {
    EXPECT_NE(csv.find(mixer), std::string::npos) << mixer;
  }
  EXPECT_EQ(csv.find("NO ("), std::string::npos) << "decode disagrees with prefill:\n" << csv;
  EXPECT_NE(slurp(out_root / "lineage.md").find("| KDA |"), std::string::npos);
}

TEST(CliBench, RecallWritesJsonOfEveryCell) {
  const kda::testing::ScratchDir scratch;  // this test's own folder
  const std::filesystem::path out_root(scratch.str());
  const CommandResult r =
      run("bench recall --quick --steps 3 --lengths 16 --mixers kda,softmax --tasks "
          "mqar,stack --out " +
          out_root.string());
  ASSERT_EQ(r.status, 0) << r.output;
  // --quick's table is too short a run to rank the mixers, and says so under the table
  EXPECT_NE(r.output.find("(--quick, 3 steps: a smoke run"), std::string::npos) << r.output;
  const auto results = nlohmann::json::parse(slurp(out_root / "recall.json"));
  ASSERT_EQ(results.size(), 4u);
  for (const auto& cell : results) {
    EXPECT_TRUE(cell.contains("mixer") && cell.contains("task") && cell.contains("seq_len"));
    const double acc = cell["accuracy"].get<double>();
    EXPECT_GE(acc, 0.0);
    EXPECT_LE(acc, 1.0);
  }
  EXPECT_NE(slurp(out_root / "recall.svg").find("<svg"), std::string::npos);
}

// The first table of a markdown text that starts with `header`: its lines, header included.
std::vector<std::string> table_from(const std::string& text, const std::string& header) {
  std::vector<std::string> rows;
  const size_t at = text.find(header);
  if (at == std::string::npos) return rows;
  std::istringstream lines(text.substr(at));
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("|", 0) != 0) break;  // a table's lines all start with '|'
    rows.push_back(line);
  }
  return rows;
}

// docs/RECALL.md's grid is what its command makes of docs/recall_v8192_runs.jsonl: the best-rate
// table the command writes stands in RECALL.md row for row, no row more or less (a run added to
// the file without the table, a table edited by hand, or a row added by hand fails here). The
// six mixers and the RoPE hybrid.
TEST(CliBench, RecallDocsTableIsWhatTheRunsFileGives) {
  const kda::testing::ScratchDir scratch;
  const std::filesystem::path out_root(scratch.str()), docs(KDA_DOCS_DIR);
  std::filesystem::copy_file(docs / "recall_v8192_runs.jsonl", out_root / "recall_runs.jsonl");
  const CommandResult r =
      run("bench recall --device cuda --vocab 8192 --kda-gate bounded --gate-dt-max 0.01 --steps "
          "20000 --lrs 1e-3,5e-4,3e-3 --lengths 256,512,1024,2048 --mixers "
          "softmax,linear,delta,gated_delta,kda,kda+softmax,kda+softmax_rope --no-train --out " +
          out_root.string());
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string written = slurp(out_root / "recall.md"), doc = slurp(docs / "RECALL.md");
  const std::string header = "| mixer | mqar 256 |";
  const std::vector<std::string> want = table_from(written, header), have = table_from(doc, header);
  ASSERT_EQ(want.size(), 9u) << written;  // header, rule, six mixers and the RoPE hybrid
  EXPECT_EQ(have, want) << "docs/RECALL.md's first grid differs from what the runs file gives:\n"
                        << written;
  for (const std::string& line : want)
    EXPECT_EQ(line.find("| - |"), std::string::npos) << "a cell without a run: " << line;
}

// recall.svg draws what recall.json says: one panel a task, in it one polyline a mixer (in the
// order of --mixers) with a point a length, left to right, at the height of the cell's accuracy
// (0 % at the panel's bottom, 100 % at its top), and a legend naming the mixers. Drawn from the
// grid of docs/recall_v8192_runs.jsonl, whose cells span 0-100 %.
TEST(CliBench, RecallPlotDrawsEveryCellAtItsAccuracy) {
  const kda::testing::ScratchDir scratch;
  const std::filesystem::path out_root(scratch.str()), docs(KDA_DOCS_DIR);
  std::filesystem::copy_file(docs / "recall_v8192_runs.jsonl", out_root / "recall_runs.jsonl");
  const std::vector<std::string> mixers = {
      "softmax", "linear", "delta", "gated_delta", "kda", "kda+softmax", "kda+softmax_rope"};
  const std::vector<std::string> tasks = {"mqar", "palindrome", "stack"};
  const std::vector<int64_t> lengths = {256, 512, 1024, 2048};
  std::string mixer_list;
  for (const std::string& m : mixers) mixer_list += (mixer_list.empty() ? "" : ",") + m;
  const CommandResult r =
      run("bench recall --device cuda --vocab 8192 --kda-gate bounded --gate-dt-max 0.01 --steps "
          "20000 --lrs 1e-3,5e-4,3e-3 --lengths 256,512,1024,2048 --mixers " +
          mixer_list + " --no-train --out " + out_root.string());
  ASSERT_EQ(r.status, 0) << r.output;
  std::map<std::string, double> accuracy;  // "mixer/task/length"
  for (const auto& cell : nlohmann::json::parse(slurp(out_root / "recall.json")))
    accuracy[cell["mixer"].get<std::string>() + "/" + cell["task"].get<std::string>() + "/" +
             std::to_string(cell["seq_len"].get<int64_t>())] = cell["accuracy"].get<double>();
  ASSERT_EQ(accuracy.size(), mixers.size() * tasks.size() * lengths.size());

  const std::string svg = slurp(out_root / "recall.svg");
  std::vector<std::vector<std::pair<int, int>>> lines;  // each polyline's points
  for (size_t at = svg.find("<polyline"); at != std::string::npos;
       at = svg.find("<polyline", at + 1)) {
    const size_t begin = svg.find("points='", at) + 8, end = svg.find('\'', begin);
    std::istringstream points(svg.substr(begin, end - begin));
    std::vector<std::pair<int, int>> line;
    for (std::string xy; points >> xy;) {
      const size_t comma = xy.find(',');
      line.emplace_back(std::stoi(xy.substr(0, comma)), std::stoi(xy.substr(comma + 1)));
    }
    lines.push_back(line);
  }
  ASSERT_EQ(lines.size(), tasks.size() * mixers.size()) << svg;
  const int top = 40, height = 220;  // the panels' frame: <rect ... y='40' ... height='220'>
  ASSERT_NE(svg.find("y='" + std::to_string(top) + "' width='300' height='" +
                     std::to_string(height) + "'"),
            std::string::npos);
  for (size_t t = 0; t < tasks.size(); ++t) {
    for (size_t m = 0; m < mixers.size(); ++m) {
      const auto& line = lines[t * mixers.size() + m];
      ASSERT_EQ(line.size(), lengths.size()) << tasks[t] << " " << mixers[m];
      for (size_t l = 0; l < lengths.size(); ++l) {
        const double acc =
            accuracy.at(mixers[m] + "/" + tasks[t] + "/" + std::to_string(lengths[l]));
        EXPECT_NEAR(line[l].second, top + height - acc * height, 1.0)
            << tasks[t] << " " << mixers[m] << " " << lengths[l] << ": " << acc;
        if (l > 0) EXPECT_GT(line[l].first, line[l - 1].first);
        if (m > 0) EXPECT_EQ(line[l].first, lines[t * mixers.size()][l].first);  // same x a length
      }
    }
    if (t > 0)
      EXPECT_GT(lines[t * mixers.size()][0].first, lines[(t - 1) * mixers.size()].back().first);
  }
  size_t legend = 0;
  for (const std::string& m : mixers) {
    const size_t at = svg.find("'>" + m + "</text>", legend);
    EXPECT_NE(at, std::string::npos) << m;
    legend = at == std::string::npos ? legend : at;
  }
}

// --progress N: every run reports its step, mean loss and time a step every N steps (and only
// then), labelled with its cell, so that a long GPU run's log shows how far it is.
TEST(CliBench, RecallProgressReportsEveryNSteps) {
  const kda::testing::ScratchDir scratch;  // this test's own folder
  const std::filesystem::path out_root(scratch.str());
  const CommandResult r =
      run("bench recall --quick --steps 6 --lengths 16 --mixers delta --tasks stack "
          "--progress 2 --out " +
          (out_root / "recall_progress").string());
  ASSERT_EQ(r.status, 0) << r.output;
  for (const char* step : {"step 2/6 loss ", "step 4/6 loss ", "step 6/6 loss "})
    EXPECT_NE(r.output.find(std::string("[delta stack T=16 seed 17] ") + step), std::string::npos)
        << step << "\n"
        << r.output;
  EXPECT_EQ(r.output.find("step 3/6"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" ms/step"), std::string::npos) << r.output;
  // the runs file keeps the same curve: (step, the interval's mean loss), as printed
  const auto run_line =
      nlohmann::json::parse(slurp(out_root / "recall_progress" / "recall_runs.jsonl"));
  const auto& curve = run_line.at("train_loss_curve");
  ASSERT_EQ(curve.size(), 3u) << run_line.dump();
  for (size_t i = 0; i < 3; ++i) {
    const int64_t step = curve[i][0].get<int64_t>();
    const double loss = curve[i][1].get<double>();
    EXPECT_EQ(step, int64_t(2 * (i + 1)));
    ASSERT_TRUE(std::isfinite(loss) && loss > 0) << loss;
    char printed[64];
    std::snprintf(printed, sizeof printed, "step %lld/6 loss %.3f ", (long long)step, loss);
    EXPECT_NE(r.output.find(printed), std::string::npos) << printed << "\n" << r.output;
  }
  // without the flag a run prints nothing until it ends
  const CommandResult quiet =
      run("bench recall --quick --steps 2 --lengths 16 --mixers delta --tasks stack --out " +
          (out_root / "recall_quiet").string());
  ASSERT_EQ(quiet.status, 0) << quiet.output;
  EXPECT_EQ(quiet.output.find("ms/step"), std::string::npos) << quiet.output;
  EXPECT_FALSE(nlohmann::json::parse(slurp(out_root / "recall_quiet" / "recall_runs.jsonl"))
                   .contains("train_loss_curve"));
}

// The runs of recall_runs.jsonl (one JSON object a line); with skip_cut, lines that do not
// parse (cut short by a stopped call) are skipped instead of failing the test.
std::vector<nlohmann::json> read_runs(const std::filesystem::path& path, bool skip_cut = false) {
  std::vector<nlohmann::json> runs;
  std::istringstream in(slurp(path));
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/!skip_cut);
    if (!j.is_discarded()) runs.push_back(std::move(j));
  }
  return runs;
}

// --seeds 3: every cell trains from three seeds; recall.json holds their mean (at the learning
// rate with the best mean) with the per-seed values, recall_runs.jsonl every run.
TEST(CliBench, RecallSeedsAverageAndListEveryRun) {
  const kda::testing::ScratchDir scratch;  // this test's own folder
  const std::filesystem::path out_root(scratch.str());
  const auto out = out_root / "recall_seeds";
  const CommandResult r =
      run("bench recall --quick --steps 4 --lengths 16 --mixers delta --tasks mqar --lrs "
          "3e-3,1e-2 --seeds 3 --jobs 2 --out " +
          out.string());
  ASSERT_EQ(r.status, 0) << r.output;
  const auto results = nlohmann::json::parse(slurp(out / "recall.json"));
  ASSERT_EQ(results.size(), 1u);
  const auto& cell = results[0];
  const std::vector<double> seeds = cell["seeds"].get<std::vector<double>>();
  ASSERT_EQ(seeds.size(), 3u);
  double sum = 0;
  for (double a : seeds) sum += a;
  EXPECT_NEAR(cell["accuracy"].get<double>(), sum / 3, 1e-12);
  EXPECT_EQ(cell["accuracy_min"].get<double>(), *std::min_element(seeds.begin(), seeds.end()));
  EXPECT_EQ(cell["accuracy_max"].get<double>(), *std::max_element(seeds.begin(), seeds.end()));
  const auto runs = read_runs(out / "recall_runs.jsonl");
  ASSERT_EQ(runs.size(), 6u);  // 2 learning rates x 3 seeds
  std::set<std::pair<float, int64_t>> distinct;
  double best_mean = -1;
  for (const float lr : {3e-3f, 1e-2f}) {
    double lr_sum = 0;
    for (const auto& run_entry : runs)
      if (run_entry["lr"].get<float>() == lr) lr_sum += run_entry["accuracy"].get<double>();
    best_mean = std::max(best_mean, lr_sum / 3);
  }
  for (const auto& run_entry : runs)
    distinct.insert({run_entry["lr"].get<float>(), run_entry["seed"].get<int64_t>()});
  EXPECT_EQ(distinct.size(), 6u);
  EXPECT_NEAR(cell["accuracy"].get<double>(), best_mean, 1e-12);  // the best lr's mean
  EXPECT_NE(r.output.find("mean over seeds"), std::string::npos) << r.output;
  // recall.md also lists every learning rate's mean over seeds, each row its own rate's runs
  const std::string md = slurp(out / "recall.md");
  ASSERT_NE(md.find("By learning rate"), std::string::npos) << md;
  for (const float lr : {3e-3f, 1e-2f}) {
    double lr_sum = 0;
    for (const auto& run_entry : runs)
      if (run_entry["lr"].get<float>() == lr) lr_sum += run_entry["accuracy"].get<double>();
    char row[64];
    std::snprintf(row, sizeof row, "| delta | %.0e | %.1f%%", double(lr), 100 * lr_sum / 3);
    EXPECT_NE(md.find(row), std::string::npos) << row << "\n" << md;
  }
  EXPECT_EQ(run("bench recall --quick --seeds 0").status, 1);
}

// The table's choices from a runs file written here (--no-train reports it as it is): the best
// learning rate is the one with the best mean over seeds (here the middle one, while another has
// the best single seed), ties go to the first rate listed, and --sweep-below A asks for a
// cell's other rates only where the first rate's mean is below A (a mean of exactly A is not).
TEST(CliBench, RecallBestRateAndSweepFromAWrittenRunsFile) {
  const kda::testing::ScratchDir scratch;
  const std::filesystem::path out(scratch.str());
  const std::string grid = "bench recall --quick --steps 2 --lengths 16 --mixers delta --seeds 2";
  ASSERT_EQ(
      run(grid + " --tasks mqar --lrs 1e-3 --seeds 1 --out " + (out / "real").string()).status, 0);
  const nlohmann::json real = read_runs(out / "real" / "recall_runs.jsonl").at(0);
  std::string lines;
  auto add = [&](const char* task, double lr, int64_t seed, double accuracy) {
    nlohmann::json j = real;
    j["task"] = task, j["lr"] = float(lr), j["seed"] = seed, j["accuracy"] = accuracy;
    lines += j.dump() + "\n";
  };
  // mqar: means 0.50 / 0.65 / 0.50 at 1e-3 / 3e-3 / 5e-4; the best single seed is 5e-4's 0.90
  add("mqar", 1e-3, 17, 0.50), add("mqar", 1e-3, 18, 0.50);
  add("mqar", 3e-3, 17, 0.70), add("mqar", 3e-3, 18, 0.60);
  add("mqar", 5e-4, 17, 0.90), add("mqar", 5e-4, 18, 0.10);
  // stack: a tie between the first and the last rate (0.40); palindrome: the first rate's mean
  // is exactly 0.5 (no sweep), stack's 0.40 (sweep: 3e-3's runs are missing)
  add("stack", 1e-3, 17, 0.30), add("stack", 1e-3, 18, 0.50);
  add("stack", 5e-4, 17, 0.40), add("stack", 5e-4, 18, 0.40);
  add("palindrome", 1e-3, 17, 0.25), add("palindrome", 1e-3, 18, 0.75);
  std::filesystem::create_directories(out / "written");
  std::ofstream(out / "written" / "recall_runs.jsonl") << lines;
  const CommandResult r =
      run(grid +
          " --tasks mqar,palindrome,stack --lrs 1e-3,3e-3,5e-4 --no-train --sweep-below 0.5"
          " --continue --out " +
          (out / "written").string());
  ASSERT_EQ(r.status, 0) << r.output;
  std::map<std::string, nlohmann::json> cell;
  for (const auto& c : nlohmann::json::parse(slurp(out / "written" / "recall.json")))
    cell[c["task"].get<std::string>()] = c;
  ASSERT_EQ(cell.size(), 3u) << r.output;
  EXPECT_NEAR(cell["mqar"]["accuracy"].get<double>(), 0.65, 1e-12);
  EXPECT_NEAR(cell["mqar"]["lr"].get<double>(), 3e-3, 1e-9);
  EXPECT_EQ(cell["mqar"]["seeds"].get<std::vector<double>>(), (std::vector<double>{0.70, 0.60}));
  EXPECT_EQ(cell["mqar"]["accuracy_min"].get<double>(), 0.60);
  EXPECT_EQ(cell["mqar"]["accuracy_max"].get<double>(), 0.70);
  EXPECT_NEAR(cell["stack"]["accuracy"].get<double>(), 0.40, 1e-12);
  EXPECT_NEAR(cell["stack"]["lr"].get<double>(), 1e-3, 1e-9);  // the tie: the first rate listed
  EXPECT_NEAR(cell["palindrome"]["accuracy"].get<double>(), 0.50, 1e-12);
  // what is still missing: stack's 3e-3 (both seeds); nothing of palindrome (at 0.5 exactly)
  // nor of mqar (every rate there)
  std::vector<std::string> missing;
  std::istringstream in(r.output);
  for (std::string line; std::getline(in, line);)
    if (line.find("missing") != std::string::npos && line.find("T=") != std::string::npos)
      missing.push_back(line);
  ASSERT_EQ(missing.size(), 2u) << r.output;
  for (const std::string& line : missing) {
    EXPECT_NE(line.find("stack"), std::string::npos) << line;
    EXPECT_NE(line.find("lr 3e-03"), std::string::npos) << line;
  }
}

// --continue matches a run by mixer, task, length, rate and seed, not by its place in the file
// (the lines reversed, one taken out: exactly that one is missing, and every rate's mean is its
// own runs'), and only under the same settings: a change to any of them reuses nothing.
TEST(CliBench, RecallContinueMatchesRunsByTheirKeysAndSettings) {
  const kda::testing::ScratchDir scratch;
  const std::filesystem::path out(scratch.str());
  const std::string grid =
      "bench recall --quick --steps 2 --lengths 16 --mixers delta --tasks mqar --lrs 1e-3,3e-3"
      " --seeds 2";
  ASSERT_EQ(run(grid + " --out " + (out / "real").string()).status, 0);
  const std::vector<nlohmann::json> runs = read_runs(out / "real" / "recall_runs.jsonl");
  ASSERT_EQ(runs.size(), 4u);
  auto missing_of = [&](const std::vector<nlohmann::json>& lines, const std::string& name) {
    std::filesystem::create_directories(out / name);
    std::ofstream file(out / name / "recall_runs.jsonl");
    for (const auto& j : lines) file << j.dump() << "\n";
    file.close();
    const CommandResult r = run(grid + " --no-train --continue --out " + (out / name).string());
    EXPECT_EQ(r.status, 0) << r.output;
    std::vector<std::string> missing;
    std::istringstream in(r.output);
    for (std::string line; std::getline(in, line);)
      if (line.find("missing") != std::string::npos && line.find("T=") != std::string::npos)
        missing.push_back(line);
    return missing;
  };
  std::vector<nlohmann::json> reversed(runs.rbegin(), runs.rend());
  const nlohmann::json taken = reversed[1];
  reversed.erase(reversed.begin() + 1);
  const auto missing = missing_of(reversed, "reversed");
  ASSERT_EQ(missing.size(), 1u);
  char want[64];
  std::snprintf(want, sizeof want, "lr %.0e seed %lld", taken["lr"].get<double>(),
                (long long)taken["seed"].get<int64_t>());
  EXPECT_NE(missing[0].find(want), std::string::npos) << missing[0] << " vs " << want;
  // each rate's mean in recall.md is its own runs' (those left in the file)
  const std::string md = slurp(out / "reversed" / "recall.md");
  for (const double lr : {1e-3, 3e-3}) {
    double sum = 0;
    int n = 0;
    for (const auto& j : reversed)
      if (std::abs(j["lr"].get<double>() - lr) < 1e-9) sum += j["accuracy"].get<double>(), ++n;
    char row[64];
    std::snprintf(row, sizeof row, "| delta | %.0e | %.1f%%", lr, 100 * sum / n);
    EXPECT_NE(md.find(row), std::string::npos) << row << "\n" << md;
  }
  // any setting changed: none of the four is reused
  for (const char* key : {"batch", "vocab", "head_dim", "kda_gate", "gate_dt_max", "steps",
                          "test_examples", "device"}) {
    std::vector<nlohmann::json> changed = runs;
    for (auto& j : changed) {
      auto& v = j["settings"][key];
      if (v.is_string())
        v = v.get<std::string>() == "cpu" ? "cuda" : "bounded";
      else if (v.is_number_integer())
        v = v.get<int64_t>() + 1;
      else
        v = v.get<double>() * 2;
    }
    EXPECT_EQ(missing_of(changed, std::string("changed_") + key).size(), 4u) << key;
  }
}

// --continue: a second call with the same settings reuses every finished run (trains none and
// gives the same table); one with other settings trains again; a cut-off last line is skipped.
TEST(CliBench, RecallContinueReusesFinishedRuns) {
  const kda::testing::ScratchDir scratch;  // this test's own folder
  const std::filesystem::path out_root(scratch.str());
  const auto out = out_root / "recall_continue";
  std::filesystem::remove_all(out);
  const std::string base =
      "bench recall --quick --lengths 16 --mixers delta --tasks stack "
      "--lrs 3e-3 --seeds 2 --out " +
      out.string();
  const CommandResult first = run(base + " --steps 3");
  ASSERT_EQ(first.status, 0) << first.output;
  const std::string table = slurp(out / "recall.json");
  ASSERT_EQ(read_runs(out / "recall_runs.jsonl").size(), 2u);
  {
    std::ofstream cut(out / "recall_runs.jsonl", std::ios::app);
    cut << "{\"mixer\": \"delta\", \"task";  // a line an earlier call did not finish
  }
  const CommandResult again = run(base + " --steps 3 --continue");
  ASSERT_EQ(again.status, 0) << again.output;
  EXPECT_NE(again.output.find("reusing 2 finished runs"), std::string::npos) << again.output;
  EXPECT_EQ(again.output.find(" seed 17 acc"), std::string::npos) << again.output;  // none ran
  EXPECT_EQ(slurp(out / "recall.json"), table);
  const CommandResult other = run(base + " --steps 4 --continue");
  ASSERT_EQ(other.status, 0) << other.output;
  EXPECT_NE(other.output.find("reusing 0 finished runs"), std::string::npos) << other.output;
  EXPECT_NE(other.output.find(" seed 17 acc"), std::string::npos) << other.output;
  // the runs after the cut line start on a line of their own
  const auto runs = read_runs(out / "recall_runs.jsonl", /*skip_cut=*/true);
  EXPECT_EQ(runs.size(), 4u);  // 2 with 3 steps, 2 with 4
}

// Without --continue a call starts a new runs file, but an earlier one (hours of GPU time, and
// --continue is easy to forget) is moved aside to recall_runs.before.N.jsonl, never overwritten.
TEST(CliBench, RecallWithoutContinueKeepsTheEarlierRuns) {
  const kda::testing::ScratchDir scratch;
  const std::filesystem::path out(scratch.str());
  const std::string base =
      "bench recall --quick --lengths 16 --mixers delta --tasks stack --lrs 3e-3 --out " +
      out.string();
  const CommandResult first = run(base + " --steps 3");
  ASSERT_EQ(first.status, 0) << first.output;
  const std::string first_runs = slurp(out / "recall_runs.jsonl");
  ASSERT_EQ(read_runs(out / "recall_runs.jsonl").size(), 1u);
  const std::pair<const char*, int64_t> calls[] = {{"recall_runs.before.1.jsonl", 4},
                                                   {"recall_runs.before.2.jsonl", 5}};
  for (const auto& [kept, steps] : calls) {
    const CommandResult again = run(base + " --steps " + std::to_string(steps));
    ASSERT_EQ(again.status, 0) << again.output;
    EXPECT_NE(again.output.find("moved the earlier runs to"), std::string::npos) << again.output;
    ASSERT_TRUE(std::filesystem::exists(out / kept)) << again.output;
    ASSERT_EQ(read_runs(out / "recall_runs.jsonl").size(), 1u);  // this call's run alone
    EXPECT_EQ(read_runs(out / "recall_runs.jsonl")[0].at("settings").at("steps").get<int64_t>(),
              steps);
  }
  EXPECT_EQ(slurp(out / "recall_runs.before.1.jsonl"), first_runs);  // the first, untouched
  EXPECT_EQ(
      read_runs(out / "recall_runs.before.2.jsonl")[0].at("settings").at("steps").get<int64_t>(),
      4);
}

// --hybrid-rope trains the hybrid with RoPE on its softmax layer: a setting of its own, so runs
// made without it are not reused for it (and the other way round).
TEST(CliBench, RecallHybridRopeIsASettingOfItsOwn) {
  const kda::testing::ScratchDir scratch;
  const auto out = std::filesystem::path(scratch.str()) / "recall_hybrid_rope";
  const std::string base =
      "bench recall --quick --lengths 16 --mixers kda+softmax --tasks stack --lrs 3e-3 "
      "--steps 3 --out " +
      out.string();
  const CommandResult rope = run(base + " --hybrid-rope");
  ASSERT_EQ(rope.status, 0) << rope.output;
  const auto runs = read_runs(out / "recall_runs.jsonl");
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_EQ(runs[0]["settings"].value("hybrid_rope", false), true);
  const CommandResult nope = run(base + " --continue");
  ASSERT_EQ(nope.status, 0) << nope.output;
  EXPECT_NE(nope.output.find("reusing 0 finished runs"), std::string::npos) << nope.output;
  const auto both = read_runs(out / "recall_runs.jsonl");
  ASSERT_EQ(both.size(), 2u);
  EXPECT_FALSE(both[1]["settings"].contains("hybrid_rope"));
}

// kda+softmax_rope is the hybrid with RoPE as a mixer of its own: one grid holds both hybrids,
// and its run is the --hybrid-rope run of kda+softmax (the same loss, bit for bit on the CPU),
// not the NoPE one.
TEST(CliBench, RecallRopeHybridIsAMixerOfItsOwn) {
  const kda::testing::ScratchDir scratch;
  const auto dir = std::filesystem::path(scratch.str());
  const std::string base =
      "bench recall --quick --lengths 16 --tasks stack --lrs 3e-3 --steps 3 --out ";
  const CommandResult both =
      run(base + (dir / "both").string() + " --mixers kda+softmax,kda+softmax_rope");
  ASSERT_EQ(both.status, 0) << both.output;
  const CommandResult flag =
      run(base + (dir / "flag").string() + " --mixers kda+softmax --hybrid-rope");
  ASSERT_EQ(flag.status, 0) << flag.output;
  const auto runs = read_runs(dir / "both" / "recall_runs.jsonl");
  const auto flagged = read_runs(dir / "flag" / "recall_runs.jsonl");
  ASSERT_EQ(runs.size(), 2u);
  ASSERT_EQ(flagged.size(), 1u);
  double nope = NAN, rope = NAN;
  for (const auto& r : runs) {
    EXPECT_FALSE(r["settings"].contains("hybrid_rope"));
    (r["mixer"] == "kda+softmax" ? nope : rope) = r["final_loss"].get<double>();
  }
  ASSERT_TRUE(std::isfinite(nope) && std::isfinite(rope)) << both.output;
  EXPECT_EQ(rope, flagged[0]["final_loss"].get<double>());
  EXPECT_NE(rope, nope);
  EXPECT_NE(both.output.find("kda+softmax_rope"), std::string::npos) << both.output;
}

// --deterministic (bit-reproducible GPU runs) is no setting of the runs file: a run made with it
// is reused by a call without it.
TEST(CliBench, RecallDeterministicIsNoSetting) {
  const kda::testing::ScratchDir scratch;
  const auto out = std::filesystem::path(scratch.str()) / "recall_deterministic";
  const std::string base =
      "bench recall --quick --lengths 16 --mixers delta --tasks stack --lrs 3e-3 --steps 3 "
      "--out " +
      out.string();
  const CommandResult det = run(base + " --deterministic");
  ASSERT_EQ(det.status, 0) << det.output;
  const CommandResult again = run(base + " --continue");
  ASSERT_EQ(again.status, 0) << again.output;
  EXPECT_NE(again.output.find("reusing 1 finished runs"), std::string::npos) << again.output;
  const auto runs = read_runs(out / "recall_runs.jsonl");
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_FALSE(runs[0]["settings"].contains("deterministic"));
}

// --shard I/N: N calls over the same runs file split the missing runs between them, each run
// in exactly one shard; --no-train reports the merged file without training, and a cell with
// no run yet shows "-" (and is left out of recall.json).
TEST(CliBench, RecallShardsSplitTheGridAndNoTrainReports) {
  const kda::testing::ScratchDir scratch;  // this test's own folder
  const std::filesystem::path out_root(scratch.str());
  const auto out = out_root / "recall_shards";
  std::filesystem::remove_all(out);
  const std::string grid =
      "bench recall --quick --steps 2 --lengths 16,32 --mixers delta,kda --tasks mqar,stack "
      "--lrs 3e-3";
  std::set<std::string> seen;
  std::string merged;
  for (int i = 0; i < 3; ++i) {
    const auto dir = out / ("shard" + std::to_string(i));
    const CommandResult r =
        run(grid + " --continue --shard " + std::to_string(i) + "/3 --out " + dir.string());
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(r.output.find("of the 8 missing runs (shard " + std::to_string(i) + " of 3)"),
              std::string::npos)
        << r.output;
    const auto runs = read_runs(dir / "recall_runs.jsonl");
    EXPECT_GE(runs.size(), 2u);  // 8 runs over 3 shards, dealt by length: 3 / 3 / 2
    EXPECT_LE(runs.size(), 3u);
    for (const auto& one : runs) {
      const std::string key = one["mixer"].get<std::string>() + "/" +
                              one["task"].get<std::string>() + "/" +
                              std::to_string(one["seq_len"].get<int64_t>());
      EXPECT_TRUE(seen.insert(key).second) << key << " trained by two shards";
      merged += one.dump() + "\n";
    }
  }
  EXPECT_EQ(seen.size(), 8u);
  std::filesystem::create_directories(out / "all");
  {
    std::ofstream f(out / "all" / "recall_runs.jsonl");
    f << merged;
  }
  const CommandResult report = run(grid + " --no-train --out " + (out / "all").string());
  ASSERT_EQ(report.status, 0) << report.output;
  EXPECT_NE(report.output.find("reusing 8 finished runs"), std::string::npos) << report.output;
  EXPECT_EQ(report.output.find(" seed 17 acc"), std::string::npos) << report.output;
  EXPECT_EQ(nlohmann::json::parse(slurp(out / "all" / "recall.json")).size(), 4u * 2u);
  // one shard's file alone: the other shards' cells are missing, shown as "-"
  const CommandResult part = run(grid + " --no-train --out " + (out / "shard2").string());
  ASSERT_EQ(part.status, 0) << part.output;
  EXPECT_NE(part.output.find("training 0 of the"), std::string::npos) << part.output;
  // ... and lists each missing run once: the 8 cells less the shard's own
  const size_t own = read_runs(out / "shard2" / "recall_runs.jsonl").size();
  size_t listed = 0;
  for (size_t at = part.output.find("  missing "); at != std::string::npos;
       at = part.output.find("  missing ", at + 1))
    ++listed;
  EXPECT_EQ(listed, 8u - own) << part.output;
  std::set<std::string> own_keys;
  for (const auto& one : read_runs(out / "shard2" / "recall_runs.jsonl"))
    own_keys.insert(one["mixer"].get<std::string>() + "/" + one["task"].get<std::string>() + "/" +
                    std::to_string(one["seq_len"].get<int64_t>()));
  for (const auto& one : read_runs(out / "all" / "recall_runs.jsonl")) {
    const std::string mixer = one["mixer"], task = one["task"];
    const int64_t T = one["seq_len"];
    char line[128];
    std::snprintf(line, sizeof line, "  missing %-16s %-10s T=%-5lld lr 3e-03 seed 17\n",
                  mixer.c_str(), task.c_str(), (long long)T);
    const bool is_own = own_keys.count(mixer + "/" + task + "/" + std::to_string(T)) > 0;
    EXPECT_EQ(part.output.find(line) != std::string::npos, !is_own) << line << part.output;
  }
  const auto partial = nlohmann::json::parse(slurp(out / "shard2" / "recall.json"));
  EXPECT_EQ(partial.size(), read_runs(out / "shard2" / "recall_runs.jsonl").size());
  EXPECT_NE(slurp(out / "shard2" / "recall.md").find("| - |"), std::string::npos);
  EXPECT_EQ(run(grid + " --shard 3/3").status, 1);
  EXPECT_EQ(run(grid + " --shard 1").status, 1);
}

// --sweep-below A: the first call trains the first learning rate only (the others wait for its
// runs); the next trains a second rate exactly for the cells whose first-rate accuracy is < A.
TEST(CliBench, RecallSweepBelowTrainsOtherRatesOnlyWhereNeeded) {
  const kda::testing::ScratchDir scratch;  // this test's own folder
  const std::filesystem::path out_root(scratch.str());
  const auto out = out_root / "recall_sweep";
  std::filesystem::remove_all(out);
  const std::string grid =
      "bench recall --quick --steps 3 --lengths 16,24 --mixers delta,softmax --tasks stack "
      "--lrs 3e-3,1e-3 --sweep-below 0.01 --continue --out " +
      out.string();
  const CommandResult first = run(grid);
  ASSERT_EQ(first.status, 0) << first.output;
  EXPECT_NE(first.output.find("4 wait for the first rate's runs"), std::string::npos)
      << first.output;
  auto runs = read_runs(out / "recall_runs.jsonl");
  ASSERT_EQ(runs.size(), 4u);
  std::set<std::string> below;
  for (const auto& one : runs) {
    EXPECT_FLOAT_EQ(one["lr"].get<float>(), 3e-3f);
    if (one["accuracy"].get<double>() < 0.01)
      below.insert(one["mixer"].get<std::string>() + "/" +
                   std::to_string(one["seq_len"].get<int64_t>()));
  }
  const CommandResult second = run(grid);
  ASSERT_EQ(second.status, 0) << second.output;
  runs = read_runs(out / "recall_runs.jsonl");
  std::set<std::string> swept;
  for (const auto& one : runs)
    if (one["lr"].get<float>() == 1e-3f)
      swept.insert(one["mixer"].get<std::string>() + "/" +
                   std::to_string(one["seq_len"].get<int64_t>()));
  EXPECT_EQ(swept, below);
  EXPECT_EQ(runs.size(), 4u + below.size());
  EXPECT_NE(slurp(out / "recall.md").find("--sweep-below 0.01"), std::string::npos);
}

// kda bench tasks: one line a task and length, the same hash on a second call (the streams are
// seeded), and a clear error on a bad flag.
// bench train on a recall task: the head runs over the answers alone, and the line saying how
// many positions were scored tells the reader what the FLOP rate counts.
TEST(CliBench, TrainTimesRandomTokensOrATasksBatches) {
  const std::string model =
      "bench train --pattern DK --width 32 --heads 2 --head-dim 16 --mlp 32 --vocab 64 "
      "--seq-len 64 --batch 2 --steps 1";
  const CommandResult plain = run(model);
  ASSERT_EQ(plain.status, 0) << plain.output;
  EXPECT_NE(plain.output.find("tokens/s"), std::string::npos) << plain.output;
  EXPECT_EQ(plain.output.find("positions scored"), std::string::npos) << plain.output;
  const CommandResult mqar = run(model + " --task mqar");
  ASSERT_EQ(mqar.status, 0) << mqar.output;
  const size_t at = mqar.output.find("task mqar: ");
  ASSERT_NE(at, std::string::npos) << mqar.output;
  // MQAR at length 64: 8 pairs, 8 answers of 64 positions
  const double share = std::stod(mqar.output.substr(at + 11));
  EXPECT_NEAR(share, 12.5, 0.01) << mqar.output;
  const CommandResult bad = run(model + " --task copying");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.output.find("unknown task 'copying'"), std::string::npos) << bad.output;
}

TEST(CliBench, TasksTimesEveryTaskAndHashesItsBatches) {
  const std::string args = "bench tasks --lengths 16,32 --vocab 64 --batch 4 --batches 2";
  const CommandResult first = run(args), second = run(args);
  ASSERT_EQ(first.status, 0) << first.output;
  for (const char* line : {"mqar       T=16 ", "palindrome T=32 ", "stack      T=16 "})
    EXPECT_NE(first.output.find(line), std::string::npos) << line << "\n" << first.output;
  auto hashes = [](const std::string& out) {
    std::string all;
    for (size_t at = out.find("(hash "); at != std::string::npos; at = out.find("(hash ", at + 1))
      all += out.substr(at, 23);
    return all;
  };
  EXPECT_EQ(hashes(first.output).size(), 6u * 23u);
  EXPECT_EQ(hashes(first.output), hashes(second.output));
  EXPECT_EQ(run("bench tasks --frobnicate 1").status, 1);
}

TEST(CliBench, VerifyPassesTheFixturesAndFailsABrokenFile) {
  const kda::testing::ScratchDir scratch;  // this test's own folder
  const std::filesystem::path out_root(scratch.str());
  const std::string ops = std::string(KDA_SHARED_DIR) + "/fixtures/ops";
  const CommandResult good = run("verify " + ops);
  EXPECT_EQ(good.status, 0) << good.output;
  EXPECT_NE(good.output.find(" 0 failed"), std::string::npos);
  // a copy of a fixture with one byte of the output changed
  std::filesystem::create_directories(out_root);
  const auto broken = out_root / "broken.safetensors";
  std::filesystem::copy_file(ops + "/gdn.safetensors", broken,
                             std::filesystem::copy_options::overwrite_existing);
  std::fstream f(broken, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(0, std::ios::end);
  const auto size = f.tellg();
  f.seekp(size - std::streamoff(3));  // inside the last tensor's data
  f.put(char(0x7f));
  f.close();
  const CommandResult bad = run("verify " + broken.string());
  EXPECT_EQ(bad.status, 1) << bad.output;
}

TEST(CliBench, BadFlagsGiveOneClearError) {
  const CommandResult r = run("lineage --contexts 12x");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("--contexts"), std::string::npos) << r.output;
  EXPECT_EQ(run("frobnicate").status, 2);
}

}  // namespace

namespace {

// A recall cell that fails inside a worker thread (here: training on a GPU this machine does not
// have, or a build without CUDA) ends the command with one clear error, not a crash.
TEST(CliBench, RecallOnCudaWithoutAGpuFailsCleanly) {
  const kda::testing::ScratchDir scratch;  // this test's own folder
  const std::filesystem::path out_root(scratch.str());
  const CommandResult r =
      run("bench recall --quick --steps 2 --lengths 64 --tasks mqar "
          "--mixers kda,softmax --jobs 2 --device cuda --out " +
          (out_root / "recall_cuda").string());
  if (r.status == 0) GTEST_SKIP() << "a GPU is present: " << r.output;
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_TRUE(r.output.find("cuda") != std::string::npos ||
              r.output.find("CUDA") != std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("terminate"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("internal error"), std::string::npos) << r.output;
}

}  // namespace
