// kda info DIR_or_CONFIG: what a config implies (architecture, parameters, layer map, memory
// per sequence), from config.json alone: no weights are read.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "apps/bench_util.h"
#include "apps/commands.h"
#include "core/error.h"
#include "model/causal_lm.h"

namespace kda::apps {
namespace {

void print_usage() {
  std::puts(
      "usage: kda info DIR_or_CONFIG\n"
      "\n"
      "DIR: a model folder (its config.json is read; weights are not needed).\n"
      "CONFIG: a config.json file.\n"
      "Prints the architecture, parameter count (total and active per token), the layer map, and\n"
      "memory per sequence: fixed recurrent state per state layer, cache bytes per token per\n"
      "cache layer (bf16), and the totals at 4K, 128K and 1M tokens of context.");
}

nlohmann::json read_config(const std::string& path) {
  std::filesystem::path file(path);
  if (std::filesystem::is_directory(file)) file /= "config.json";
  std::ifstream in(file);
  require(bool(in), file.string() + ": cannot open (expected a model folder or a config.json)");
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw Error(file.string() + ": not valid JSON: " + e.what());
  }
}

// "1.23 M" style, with the exact count after it.
std::string count_text(int64_t n) {
  const double v = double(n);
  std::string short_form = std::to_string(n);
  if (v >= 1e9) {
    short_form = fmt(v / 1e9, 2) + " B";
  } else if (v >= 1e6) {
    short_form = fmt(v / 1e6, 2) + " M";
  } else if (v >= 1e3) {
    short_form = fmt(v / 1e3, 2) + " K";
  }
  return short_form + " (" + std::to_string(n) + ")";
}

}  // namespace

int cmd_info(const Args& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    print_usage();
    return args.empty() ? 2 : 0;
  }
  require(args.size() == 1, "kda info takes one model folder or config.json (got " +
                                std::to_string(args.size()) + " arguments)");
  const model::ArchitectureInfo info = model::describe_config(read_config(args[0]));

  std::printf("%s\n", args[0].c_str());
  std::printf("  model_type      %s\n", info.model_type.c_str());
  std::printf("  architecture    %s\n", info.summary.c_str());
  std::printf("  parameters      %s total, %s active per token\n",
              count_text(info.total_params).c_str(), count_text(info.active_params).c_str());

  std::printf("  layers (%zu)\n", info.layer_kinds.size());
  for (size_t first = 0; first < info.layer_kinds.size();) {
    size_t end = first + 1;
    while (end < info.layer_kinds.size() && info.layer_kinds[end] == info.layer_kinds[first]) ++end;
    const std::string range = end - first == 1
                                  ? std::to_string(first)
                                  : std::to_string(first) + "-" + std::to_string(end - 1);
    std::printf("    %-9s %s\n", range.c_str(), info.layer_kinds[first].c_str());
    first = end;
  }

  // exact byte counts beside the rounded ones: these are the numbers people compare
  std::printf("  memory per sequence (recurrent state fp32, conv state and caches bf16)\n");
  std::printf("    fixed state   %lld layers x %lld B (%s) = %lld B (%s)\n",
              (long long)info.num_state_layers, (long long)info.state_bytes_per_layer,
              human_bytes(double(info.state_bytes_per_layer)).c_str(),
              (long long)(info.num_state_layers * info.state_bytes_per_layer),
              human_bytes(double(info.num_state_layers * info.state_bytes_per_layer)).c_str());
  std::printf("    cache         %lld layers x %lld B per token = %lld B per token\n",
              (long long)info.num_cache_layers, (long long)info.cache_bytes_per_token_per_layer,
              (long long)(info.num_cache_layers * info.cache_bytes_per_token_per_layer));
  const std::pair<const char*, int64_t> contexts[] = {
      {"4K", 4096}, {"128K", 131072}, {"1M", 1048576}};
  for (const auto& [label, tokens] : contexts) {
    const std::string at = std::string("at ") + label + " tokens";
    std::printf("    %-15s %s\n", at.c_str(),
                human_bytes(double(info.memory_per_sequence(tokens))).c_str());
  }
  return 0;
}

}  // namespace kda::apps
