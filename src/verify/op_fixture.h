// Evaluates golden op fixture files (the ../shared/fixtures/ops format) through every path the
// build has and measures each output, state and gradient against the file. The op and its
// parameters come from the file's metadata, never from its name.
#pragma once
#include <map>
#include <string>
#include <vector>

#include "core/safetensors.h"

namespace kda::verify {

struct CheckRow {
  std::string path;      // "reference", "chunked", "recurrent", "decode", "flash", ...
  std::string quantity;  // "o", "ht", "dq", ...
  double error = 0;      // ||ours - fixture|| / ||fixture||
  double tolerance = 0;
  bool passed() const { return error <= tolerance; }  // false for NaN
};

struct FixtureReport {
  std::string file;
  std::string op;
  std::vector<CheckRow> rows;
  bool passed() const;
};

// Tolerances of the fixtures README for fp32 CPU paths.
constexpr double kOutputTolerance = 1e-5;
constexpr double kGradientTolerance = 1e-4;

FixtureReport check_op_fixture(const std::string& path);

// Reading a fixture: tensors as fp32 vectors, metadata as JSON-decoded values.
class Fixture {
 public:
  explicit Fixture(const std::string& path);
  bool has(const std::string& name) const { return file_.contains(name); }
  std::vector<float> f32(const std::string& name) const;
  std::vector<int64_t> i64(const std::string& name) const;
  std::vector<int64_t> shape(const std::string& name) const;
  std::string op() const;
  bool has_meta(const std::string& key) const { return file_.metadata().count(key) != 0; }
  int64_t meta_int(const std::string& key) const;
  double meta_double(const std::string& key, double fallback) const;
  bool meta_bool(const std::string& key, bool fallback) const;
  std::string meta_string(const std::string& key) const;
  const std::string& path() const { return file_.path(); }

 private:
  SafetensorsFile file_;
};

// Appends a row comparing `ours` with fixture tensor `name`.
void add_row(FixtureReport& report, const Fixture& fx, const std::string& path,
             const std::string& name, const std::vector<float>& ours, double tolerance);
void add_row(FixtureReport& report, const Fixture& fx, const std::string& path,
             const std::string& name, const std::vector<double>& ours, double tolerance);

// One checker per op family (op_fixture_*.cpp).
void check_delta_family(const Fixture& fx, FixtureReport& report);
void check_linear_attention(const Fixture& fx, FixtureReport& report);
void check_softmax_attention(const Fixture& fx, FixtureReport& report);

}  // namespace kda::verify
