#include "apps/bench_util.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/blas.h"
#include "core/error.h"
#include "core/random.h"
#include "core/safetensors.h"
#include "core/timer.h"

namespace kda::apps {

std::string flag_value(const Args& args, size_t& i) {
  require(i + 1 < args.size(), "option " + args[i] + " needs a value");
  return args[++i];
}

int64_t parse_int(const std::string& text, const std::string& flag) {
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  require(used == text.size() && !text.empty(),
          "option " + flag + ": '" + text + "' is not an integer");
  return v;
}

std::vector<int64_t> parse_int_list(const std::string& text, const std::string& flag) {
  std::vector<int64_t> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    const int64_t v = parse_int(item, flag);
    require(v >= 1, "option " + flag + ": values must be positive");
    out.push_back(v);
  }
  require(!out.empty(), "option " + flag + " needs at least one value");
  return out;
}

std::string fmt(double value, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, value);
  return buf;
}

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  return fmt(bytes, bytes < 10 && u > 0 ? 1 : 0) + " " + units[u];
}

std::string machine_description() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(colon + 2);
    }
  }
  return "unknown CPU";
}

double best_seconds(int reps, const std::function<void()>& fn, bool warm_up) {
  if (warm_up) fn();
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    Stopwatch w;
    fn();
    best = std::min(best, w.seconds());
  }
  return best;
}

void Table::print() const {
  std::vector<size_t> width(header_.size());
  for (size_t c = 0; c < header_.size(); ++c) width[c] = header_[c].size();
  for (const auto& row : rows_)
    for (size_t c = 0; c < row.size() && c < width.size(); ++c)
      width[c] = std::max(width[c], row[c].size());
  auto line = [&](const std::vector<std::string>& cells) {
    for (size_t c = 0; c < width.size(); ++c) {
      const std::string cell = c < cells.size() ? cells[c] : "";
      std::printf(c == 0 ? "%-*s" : "  %*s", int(width[c]), cell.c_str());
    }
    std::printf("\n");
  };
  line(header_);
  size_t total = 0;
  for (size_t w : width) total += w + 2;
  std::printf("%s\n", std::string(total - 2, '-').c_str());
  for (const auto& row : rows_) line(row);
}

std::string Table::markdown() const {
  std::ostringstream out;
  auto line = [&](const std::vector<std::string>& cells) {
    out << '|';
    for (const auto& c : cells) out << ' ' << c << " |";
    out << '\n';
  };
  line(header_);
  out << '|';
  for (size_t c = 0; c < header_.size(); ++c) out << (c == 0 ? "---|" : "---:|");
  out << '\n';
  for (const auto& row : rows_) line(row);
  return out.str();
}

std::string Table::csv() const {
  std::ostringstream out;
  auto line = [&](const std::vector<std::string>& cells) {
    for (size_t c = 0; c < cells.size(); ++c) {
      const bool quote = cells[c].find_first_of(",\"") != std::string::npos;
      std::string cell = cells[c];
      if (quote) {
        std::string escaped;
        for (char ch : cell) escaped += ch == '"' ? std::string("\"\"") : std::string(1, ch);
        cell = "\"" + escaped + "\"";
      }
      out << (c ? "," : "") << cell;
    }
    out << '\n';
  };
  line(header_);
  for (const auto& row : rows_) line(row);
  return out.str();
}

void Table::write(const std::string& dir, const std::string& name,
                  const std::string& preface) const {
  std::filesystem::create_directories(dir);
  write_file_atomic(dir + "/" + name + ".md", preface + markdown());
  write_file_atomic(dir + "/" + name + ".csv", csv());
}

DeltaInputsBuffer::DeltaInputsBuffer(const ops::DeltaRuleShape& s, uint64_t seed) : shape(s) {
  Random rng(seed);
  const int64_t tokens = s.B * s.T;
  auto unit_rows = [&](std::vector<float>& x) {
    x.resize(tokens * s.H * s.K);
    rng.fill_normal(x);
    for (int64_t r = 0; r < tokens * s.H; ++r) {
      float n2 = 0;
      for (int64_t c = 0; c < s.K; ++c) n2 += x[r * s.K + c] * x[r * s.K + c];
      const float inv = 1.0f / std::sqrt(n2);
      for (int64_t c = 0; c < s.K; ++c) x[r * s.K + c] *= inv;
    }
  };
  unit_rows(q);
  unit_rows(k);
  v.resize(tokens * s.HV * s.V);
  rng.fill_normal(v);
  beta.resize(tokens * s.HV);
  rng.fill_uniform(beta, 0.1f, 0.9f);
  if (s.gate_width() > 0) {
    g.resize(tokens * s.HV * s.gate_width());
    rng.fill_uniform(g, -0.1f, -0.001f);  // per-token log-decays of a trained layer's order
  }
}

// Best-of-`reps` GFLOP/s of a square fp32 GEMM through OpenBLAS on all threads.
double measure_gemm_gflops(int n, int reps) {
  std::vector<float> a(size_t(n) * n), b(a.size()), c(a.size());
  Random rng(1);
  rng.fill_normal(a);
  rng.fill_normal(b);
  gemm_nn(n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);  // warm up
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    Stopwatch w;
    gemm_nn(n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    best = std::min(best, w.seconds());
  }
  return 2.0 * n * n * n / best / 1e9;
}

}  // namespace kda::apps
