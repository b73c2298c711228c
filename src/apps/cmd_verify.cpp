// kda verify PATH...: golden op fixtures through every path the build has.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>

#include "apps/commands.h"
#include "apps/model_device.h"
#include "core/error.h"
#include "verify/model_fixture.h"
#include "verify/op_fixture.h"

namespace kda::apps {
namespace {

void print_usage() {
  std::puts(
      "usage: kda verify [--device cpu|cuda] [--dtype fp32|bf16] PATH...\n"
      "\n"
      "PATH: a model folder with reference.safetensors (the ../shared/fixtures/models format):\n"
      "logits (1e-4), loss (1e-5) and the greedy continuation through the decode path.\n"
      "\n"
      "Or an op fixture file (.safetensors in the ../shared/fixtures/ops format) or a folder\n"
      "of them. Each file's op and parameters come from its metadata. Every output, state and\n"
      "gradient is compared through every path the build has (float64 reference, chunked,\n"
      "recurrent, decode token by token, backward) as ||ours - file|| / ||file||.\n"
      "Exits 1 if any error is beyond the fixtures' tolerances (fp32: outputs and states 1e-5,\n"
      "gradients 1e-4).\n"
      "\n"
      "--device cuda runs model folders through the CUDA path (default dtype fp32 there, held to\n"
      "the same bounds; bf16 weights do not meet 1e-4 and are for kda_gpu_model's checks).");
}

std::vector<std::string> expand(const Args& args) {
  std::vector<std::string> files;
  for (const std::string& a : args) {
    if (verify::is_model_fixture(a)) {
      files.push_back(a);
    } else if (std::filesystem::is_directory(a)) {
      std::vector<std::string> found;
      for (const auto& e : std::filesystem::directory_iterator(a))
        if (e.path().extension() == ".safetensors" || verify::is_model_fixture(e.path().string()))
          found.push_back(e.path().string());
      std::sort(found.begin(), found.end());
      require(!found.empty(), a + ": no .safetensors files or model folders in this folder");
      files.insert(files.end(), found.begin(), found.end());
    } else {
      files.push_back(a);
    }
  }
  return files;
}

}  // namespace

int cmd_verify(const Args& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    print_usage();
    return args.empty() ? 2 : 0;
  }
  ModelDevice device;
  device.bf16 = false;
  Args paths;
  for (size_t i = 0; i < args.size(); ++i) {
    if ((args[i] == "--device" || args[i] == "--dtype") && i + 1 < args.size()) {
      (args[i] == "--device" ? parse_device : parse_dtype)(args[i + 1], device);
      ++i;
    } else {
      paths.push_back(args[i]);
    }
  }
  require(!paths.empty(), "kda verify: no PATH given");
  verify::ModelLoader loader;
  if (device.cuda) loader = [&](const std::string& p) { return load_model_on(p, device); };
  int failures = 0, checks = 0;
  for (const std::string& path : expand(paths)) {
    std::filesystem::path where(path);
    if (where.filename().empty()) where = where.parent_path();  // "folder/"
    const std::string name = where.filename().string();
    try {
      const bool model = verify::is_model_fixture(path);
      const verify::FixtureReport report =
          model ? verify::check_model_folder(path, loader) : verify::check_op_fixture(path);
      std::printf("%s (%s %s)\n", name.c_str(), model ? "model" : "op", report.op.c_str());
      for (const verify::CheckRow& row : report.rows) {
        ++checks;
        if (!row.passed()) ++failures;
        std::printf("  %-20s %-9s %10.2e  <= %.0e  %s\n", row.path.c_str(), row.quantity.c_str(),
                    row.error, row.tolerance, row.passed() ? "ok" : "FAIL");
      }
    } catch (const Error& e) {
      ++failures;
      std::printf("%s\n  error: %s\n", name.c_str(), e.what());
    }
  }
  std::printf("%d checks, %d failed\n", checks, failures);
  return failures ? 1 : 0;
}

}  // namespace kda::apps
