#include "verify/op_fixture.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace kda::verify {

using json = nlohmann::json;

bool FixtureReport::passed() const {
  if (rows.empty()) return false;
  for (const CheckRow& r : rows)
    if (!r.passed()) return false;
  return true;
}

Fixture::Fixture(const std::string& path) : file_(SafetensorsFile::open(path)) {}

std::vector<float> Fixture::f32(const std::string& name) const {
  const Tensor t = file_.load(name, DType::f32);
  return std::vector<float>(t.f32(), t.f32() + t.numel());
}

std::vector<int64_t> Fixture::i64(const std::string& name) const {
  const Tensor t = file_.load(name, DType::i64);
  return std::vector<int64_t>(t.data<int64_t>(), t.data<int64_t>() + t.numel());
}

std::vector<int64_t> Fixture::shape(const std::string& name) const {
  return file_.view(name).shape;
}

static json meta_value(const SafetensorsFile& file, const std::string& key) {
  const auto it = file.metadata().find(key);
  require(it != file.metadata().end(), file.path() + ": metadata has no '" + key + "'");
  try {
    return json::parse(it->second);
  } catch (const json::exception&) {
    return json(it->second);  // a bare string
  }
}

std::string Fixture::op() const {
  const json v = meta_value(file_, "op");
  require(v.is_string(), path() + ": metadata 'op' is not a string");
  return v.get<std::string>();
}

int64_t Fixture::meta_int(const std::string& key) const {
  const json v = meta_value(file_, key);
  require(v.is_number_integer(), path() + ": metadata '" + key + "' is not an integer");
  return v.get<int64_t>();
}

double Fixture::meta_double(const std::string& key, double fallback) const {
  if (!has_meta(key)) return fallback;
  const json v = meta_value(file_, key);
  require(v.is_number(), path() + ": metadata '" + key + "' is not a number");
  return v.get<double>();
}

std::string Fixture::meta_string(const std::string& key) const {
  const json v = meta_value(file_, key);
  require(v.is_string(), path() + ": metadata '" + key + "' is not a string");
  return v.get<std::string>();
}

bool Fixture::meta_bool(const std::string& key, bool fallback) const {
  if (!has_meta(key)) return fallback;
  const json v = meta_value(file_, key);
  require(v.is_boolean(), path() + ": metadata '" + key + "' is not true/false");
  return v.get<bool>();
}

template <class F>
static double relative_error(const std::vector<F>& ours, const std::vector<float>& want) {
  if (ours.size() != want.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = double(ours[i]) - double(want[i]);
    if (!std::isfinite(d)) return NAN;
    num += d * d;
    den += double(want[i]) * double(want[i]);
  }
  if (den == 0) return num == 0 ? 0 : INFINITY;
  return std::sqrt(num / den);
}

void add_row(FixtureReport& report, const Fixture& fx, const std::string& path,
             const std::string& name, const std::vector<float>& ours, double tolerance) {
  report.rows.push_back({path, name, relative_error(ours, fx.f32(name)), tolerance});
}

void add_row(FixtureReport& report, const Fixture& fx, const std::string& path,
             const std::string& name, const std::vector<double>& ours, double tolerance) {
  report.rows.push_back({path, name, relative_error(ours, fx.f32(name)), tolerance});
}

FixtureReport check_op_fixture(const std::string& path) {
  const Fixture fx(path);
  FixtureReport report;
  report.file = path;
  report.op = fx.op();
  if (report.op == "kda" || report.op == "gated_delta_rule" || report.op == "delta_rule") {
    check_delta_family(fx, report);
  } else if (report.op == "linear_attn") {
    check_linear_attention(fx, report);
  } else if (report.op == "softmax_attention") {
    check_softmax_attention(fx, report);
  } else {
    throw Error(path + ": unknown op '" + report.op + "'");
  }
  return report;
}

}  // namespace kda::verify
