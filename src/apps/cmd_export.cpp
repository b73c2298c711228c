// kda export: a trained checkpoint folder as a shippable Hugging Face model folder: config.json
// without the training settings, the weights in bf16 (or fp16 / fp32) under the same names,
// and the tokenizer files beside them.
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "apps/bench_util.h"
#include "apps/commands.h"
#include "core/error.h"
#include "core/safetensors.h"
#include "model/model_folder.h"

namespace kda::apps {
namespace {

namespace fs = std::filesystem;

void print_usage() {
  std::puts(
      "usage: kda export IN_DIR OUT_DIR [--dtype bf16|f16|f32]\n"
      "\n"
      "Writes OUT_DIR/config.json (IN_DIR's, without its \"training\" object),\n"
      "OUT_DIR/model.safetensors (every tensor of IN_DIR, converted; default bf16) and copies\n"
      "the tokenizer files IN_DIR holds (tiktoken.model, vocab.json + merges.txt, encoder.json +\n"
      "vocab.bpe, tokenizer_config.json). `kda run -m OUT_DIR` loads the result (transformers' "
      "tensor names and config keys).");
}

}  // namespace

int cmd_export(const Args& args) {
  std::vector<std::string> positional;
  std::string dtype_name = "bf16";
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--help" || args[i] == "-h") {
      print_usage();
      return 0;
    }
    if (args[i] == "--dtype") {
      dtype_name = flag_value(args, i);
      continue;
    }
    require(args[i].rfind("--", 0) != 0, "export: unknown option '" + args[i] + "'");
    positional.push_back(args[i]);
  }
  require(positional.size() == 2, "export: give IN_DIR and OUT_DIR (see kda export --help)");
  const DType dtype = dtype_name == "bf16"  ? DType::bf16
                      : dtype_name == "f16" ? DType::f16
                      : dtype_name == "f32"
                          ? DType::f32
                          : throw Error("export: --dtype must be bf16, f16 or f32");
  const fs::path in(positional[0]), out(positional[1]);
  const model::ModelFolder folder = model::ModelFolder::open(in.string());
  require(!fs::exists(out / "model.safetensors"), out.string() + " already holds a model");
  fs::create_directories(out);
  nlohmann::json config = folder.config();
  config.erase("training");
  config["dtype"] = dtype == DType::bf16 ? "bfloat16" : dtype == DType::f16 ? "float16" : "float32";
  write_file_atomic((out / "config.json").string(), config.dump(2) + "\n");

  std::vector<Tensor> converted;
  const std::vector<std::string> names = folder.names();
  converted.reserve(names.size());
  int64_t count = 0;
  for (const std::string& name : names) {
    converted.push_back(Tensor::from_view_as(folder.view(name), dtype));
    count += converted.back().numel();
  }
  std::vector<NamedTensor> named;
  for (size_t i = 0; i < names.size(); ++i) named.push_back({names[i], &converted[i]});
  write_safetensors((out / "model.safetensors").string(), named, {{"format", "pt"}});
  for (const char* file : {"tiktoken.model", "vocab.json", "merges.txt", "encoder.json",
                           "vocab.bpe", "tokenizer_config.json"}) {
    if (fs::exists(in / file))
      fs::copy_file(in / file, out / file, fs::copy_options::overwrite_existing);
  }
  std::printf("%s: %zu tensors, %lld parameters, %s, %lld bytes of weights\n", out.c_str(),
              names.size(), (long long)count, dtype_name.c_str(),
              (long long)fs::file_size(out / "model.safetensors"));
  return 0;
}

}  // namespace kda::apps
