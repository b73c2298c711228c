// kda tokenize: text -> token ids (a JSON array), or ids -> text.
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "apps/bench_util.h"
#include "apps/commands.h"
#include "core/error.h"
#include "tokenizer/tokenizer.h"

namespace kda::apps {
namespace {

void print_usage() {
  std::puts(
      "usage: kda tokenize -t TOKENIZER (--text STRING | --decode ID,ID,...) [--no-special]\n"
      "                    [--chat]\n"
      "\n"
      "TOKENIZER: a model folder (tiktoken.model, vocab.json + merges.txt, or encoder.json +\n"
      "vocab.bpe), a NAME.tiktoken rank file (pattern and special tokens from NAME.json beside\n"
      "it), or Kimi's tiktoken.model.\n"
      "\n"
      "--text prints the ids as a JSON array; special tokens written in the text (e.g.\n"
      "<|endoftext|>) become their ids unless --no-special is given. --chat wraps the text as a\n"
      "user message in the tokenizer's chat template first. --decode prints the text of the\n"
      "ids, followed by a newline.");
}

std::vector<int32_t> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    while (!item.empty() && item.front() == ' ') item.erase(item.begin());
    while (!item.empty() && item.back() == ' ') item.pop_back();
    if (item.empty()) continue;
    const int64_t id = parse_int(item, "--decode");
    require(id >= 0 && id <= INT32_MAX, "option --decode: id " + item + " is out of range");
    ids.push_back(int32_t(id));
  }
  return ids;
}

}  // namespace

int cmd_tokenize(const Args& args) {
  std::string tokenizer_path, text, decode;
  bool have_text = false, have_decode = false, allow_special = true, chat = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      print_usage();
      return 0;
    }
    if (a == "--no-special") {
      allow_special = false;
    } else if (a == "--chat") {
      chat = true;
    } else if (a == "-t" || a == "--tokenizer") {
      tokenizer_path = flag_value(args, i);
    } else if (a == "--text") {
      text = flag_value(args, i);
      have_text = true;
    } else if (a == "--decode") {
      decode = flag_value(args, i);
      have_decode = true;
    } else {
      throw Error("tokenize: unknown option '" + a + "' (see kda tokenize --help)");
    }
  }
  require(!tokenizer_path.empty(), "tokenize: -t TOKENIZER is required (see kda tokenize --help)");
  require(have_text != have_decode, "tokenize: give exactly one of --text and --decode");
  const auto tok = tokenizer::load_tokenizer(tokenizer_path);
  if (have_decode) {
    const std::string out = tok->decode(parse_ids(decode));
    std::fwrite(out.data(), 1, out.size(), stdout);
    std::fputc('\n', stdout);
    return 0;
  }
  if (chat) text = tok->apply_chat_template({{"user", text}});
  const std::vector<int32_t> ids = tok->encode(text, allow_special || chat);
  std::string out = "[";
  for (size_t k = 0; k < ids.size(); ++k) {
    if (k) out += ',';
    out += std::to_string(ids[k]);
  }
  out += "]\n";
  std::fwrite(out.data(), 1, out.size(), stdout);
  return 0;
}

}  // namespace kda::apps
