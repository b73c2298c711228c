// kda_gpu_model: the GPU model path's checks and benchmarks (kernels of the model layers, then
// whole models against the fixtures, then prefill / decode timings).
//
//   kda_gpu_model [--check] [--bench] [--small] [--shared DIR] [SUITE ...]
//
// --small: the suites that have one run a small set of checks (for compute-sanitizer).
// With no suite named, every registered suite runs in registration order of its name. Exit
// status 1 when any check fails, 2 on a usage error.
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "bench/gpu/model/gpu_suite.h"
#include "core/error.h"

namespace kda::gpu_check {

std::map<std::string, SuiteFn>& suites() {
  static std::map<std::string, SuiteFn> all;
  return all;
}

bool register_suite(const std::string& name, SuiteFn fn) {
  suites()[name] = std::move(fn);
  return true;
}

}  // namespace kda::gpu_check

int main(int argc, char** argv) {
  using namespace kda::gpu_check;
  SuiteOptions options;
  options.check = false;
  std::vector<std::string> names;
#ifdef KDA_SHARED_DIR
  options.shared_dir = KDA_SHARED_DIR;
#endif
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--check") {
      options.check = true;
    } else if (a == "--bench") {
      options.bench = true;
    } else if (a == "--small") {
      options.small = true;
    } else if (a == "--shared" && i + 1 < argc) {
      options.shared_dir = argv[++i];
    } else if (!a.empty() && a[0] != '-' && suites().count(a)) {
      names.push_back(a);
    } else {
      std::fprintf(
          stderr,
          "usage: kda_gpu_model [--check] [--bench] [--small] [--shared DIR] [SUITE ...]\n");
      std::fprintf(stderr, "suites:");
      for (const auto& [name, fn] : suites()) std::fprintf(stderr, " %s", name.c_str());
      std::fprintf(stderr, "\n");
      return 2;
    }
  }
  if (!options.check && !options.bench) options.check = true;
  if (names.empty())
    for (const auto& [name, fn] : suites()) names.push_back(name);
  Tally tally;
  for (const std::string& name : names) {
    std::printf("== %s\n", name.c_str());
    std::fflush(stdout);
    try {
      suites()[name](options, tally);
    } catch (const std::exception& e) {
      std::printf("CHECK %-60s FAIL (exception: %s)\n", name.c_str(), e.what());
      tally.failed++;
    }
  }
  std::printf("== %d checks passed, %d failed\n", tally.passed, tally.failed);
  return tally.failed ? 1 : 0;
}
