// Which tokenizer a path holds: Kimi's tiktoken.model, NAME.tiktoken + NAME.json, or GPT-2's
// vocab.json + merges.txt / encoder.json + vocab.bpe.
#include <filesystem>

#include "core/error.h"
#include "tokenizer/gpt2_tokenizer.h"
#include "tokenizer/tiktoken_tokenizer.h"
#include "tokenizer/tokenizer.h"

namespace kda::tokenizer {
namespace {

namespace fs = std::filesystem;

bool is_file(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

}  // namespace

bool folder_has_tokenizer(const std::string& dir) {
  const fs::path d(dir);
  return is_file(d / "tiktoken.model") ||
         (is_file(d / "vocab.json") && is_file(d / "merges.txt")) ||
         (is_file(d / "encoder.json") && is_file(d / "vocab.bpe"));
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path) {
  const fs::path p(path);
  std::error_code ec;
  if (fs::is_directory(p, ec)) {
    if (is_file(p / "tiktoken.model")) return open_kimi_tiktoken((p / "tiktoken.model").string());
    if (is_file(p / "vocab.json") && is_file(p / "merges.txt"))
      return Gpt2Tokenizer::open((p / "vocab.json").string(), (p / "merges.txt").string());
    if (is_file(p / "encoder.json") && is_file(p / "vocab.bpe"))
      return Gpt2Tokenizer::open((p / "encoder.json").string(), (p / "vocab.bpe").string());
    throw Error(path +
                ": no tokenizer in this folder (expected tiktoken.model, vocab.json + "
                "merges.txt, or encoder.json + vocab.bpe)");
  }
  require(fs::exists(p, ec), path + ": no such file or folder");
  const std::string name = p.filename().string();
  if (name == "tiktoken.model") return open_kimi_tiktoken(path);
  if (p.extension() == ".tiktoken") return open_tiktoken_file(path);
  if (name == "vocab.json" || name == "merges.txt" || name == "encoder.json" || name == "vocab.bpe")
    return load_tokenizer(p.parent_path().empty() ? "." : p.parent_path().string());
  throw Error(path +
              ": not a tokenizer (expected a model folder, NAME.tiktoken with NAME.json, or "
              "tiktoken.model)");
}

}  // namespace kda::tokenizer
