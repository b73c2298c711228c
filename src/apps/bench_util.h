// Small helpers shared by the measuring commands (bench, lineage): flags, timing, tables.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "apps/commands.h"
#include "ops/delta_rule/delta_rule.h"

namespace kda::apps {

// The value after flag args[i] (advancing i); throws naming the flag when missing.
std::string flag_value(const Args& args, size_t& i);
int64_t parse_int(const std::string& text, const std::string& flag);
std::vector<int64_t> parse_int_list(const std::string& text, const std::string& flag);

std::string fmt(double value, int decimals);
std::string human_bytes(double bytes);
std::string machine_description();  // CPU model from /proc/cpuinfo

// Minimum wall time of `reps` runs of fn (after one warm-up run when warm_up is true).
double best_seconds(int reps, const std::function<void()>& fn, bool warm_up = true);

// Best-of-`reps` GFLOP/s of a square fp32 GEMM through OpenBLAS on all threads: the ceiling
// the CPU benchmarks report against.
double measure_gemm_gflops(int n, int reps);

// A table printed aligned to the terminal and written as markdown and CSV.
class Table {
 public:
  explicit Table(std::vector<std::string> header) : header_(std::move(header)) {}
  void add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  void print() const;
  std::string markdown() const;
  std::string csv() const;
  // Writes DIR/NAME.md and DIR/NAME.csv atomically, creating DIR.
  void write(const std::string& dir, const std::string& name,
             const std::string& preface = "") const;

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
};

// Random delta-rule inputs (normalised q/k, beta in (0, 1), gates in a realistic range).
struct DeltaInputsBuffer {
  ops::DeltaRuleShape shape;
  std::vector<float> q, k, v, g, beta;
  DeltaInputsBuffer(const ops::DeltaRuleShape& shape, uint64_t seed);
  ops::DeltaRuleInputs<float> inputs() const {
    return {shape,       q.data(), k.data(), v.data(), g.empty() ? nullptr : g.data(),
            beta.data(), nullptr,  {}};
  }
};

}  // namespace kda::apps
