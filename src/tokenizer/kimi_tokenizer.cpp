// Kimi's tiktoken.model: pattern, special tokens, chat format and long-run splitting, as
// tokenization_kimi.py (Kimi Linear / K2 family) defines them.
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "tokenizer/text_file.h"
#include "tokenizer/tiktoken_tokenizer.h"

namespace kda::tokenizer {

const std::string& kimi_pattern() {
  static const std::string pattern = [] {
    const char* const parts[] = {
        R"([\p{Han}]+)",
        R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*)"
        R"([\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?)",
        R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+)"
        R"([\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?)",
        R"(\p{N}{1,3})",
        R"( ?[^\s\p{L}\p{N}]+[\r\n]*)",
        R"(\s*[\r\n]+)",
        R"(\s+(?!\S))",
        R"(\s+)",
    };
    std::string joined;
    for (const char* part : parts) joined += (joined.empty() ? "" : "|") + std::string(part);
    return joined;
  }();
  return pattern;
}

// K2-family listing (../shared/notes/kimi-linear.md): 163584 + offset.
const std::vector<std::pair<std::string, int32_t>>& kimi_special_offsets() {
  static const std::vector<std::pair<std::string, int32_t>> offsets = {
      {"[BOS]", 0},
      {"[EOS]", 1},
      {"<|im_end|>", 2},
      {"<|im_user|>", 3},
      {"<|im_assistant|>", 4},
      {"<|start_header_id|>", 6},
      {"<|end_header_id|>", 7},
      {"[EOT]", 9},
      {"<|im_system|>", 10},
      {"<|tool_calls_section_begin|>", 11},
      {"<|tool_calls_section_end|>", 12},
      {"<|tool_call_begin|>", 13},
      {"<|tool_call_argument_begin|>", 14},
      {"<|tool_call_end|>", 15},
      {"<|im_middle|>", 17},
      {"[UNK]", 254},
      {"[PAD]", 255},
  };
  return offsets;
}

std::string kimi_chat_prompt(const std::vector<ChatMessage>& messages) {
  std::string prompt;
  for (const ChatMessage& m : messages) {
    if (m.role == "system" || m.role == "tool")
      prompt += "<|im_system|>";
    else if (m.role == "user")
      prompt += "<|im_user|>";
    else if (m.role == "assistant")
      prompt += "<|im_assistant|>";
    else
      throw Error("chat template: unknown role '" + m.role +
                  "' (expected system, user, assistant or tool)");
    prompt += m.role + "<|im_middle|>" + m.content + "<|im_end|>";
  }
  return prompt + "<|im_assistant|>assistant<|im_middle|>";
}

namespace {

// Python's str.isspace: bidirectional class WS, B or S, or general category Zs.
bool python_isspace(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

// Decodes the code point at text[i] (valid UTF-8) and moves i past it.
uint32_t next_code_point(std::string_view text, size_t& i) {
  const auto lead = uint8_t(text[i]);
  const size_t len = lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
  uint32_t c = len == 1 ? lead : lead & (0x7F >> len);
  for (size_t k = 1; k < len; ++k) c = (c << 6) | (uint8_t(text[i + k]) & 0x3F);
  i += len;
  return c;
}

}  // namespace

std::vector<std::string_view> kimi_split_long_runs(std::string_view text, size_t chunk_chars,
                                                   size_t max_run_chars) {
  std::vector<std::string_view> out;
  size_t i = 0;
  do {
    // One chunk of up to chunk_chars characters, cut like _split_whitespaces_or_nonwhitespaces.
    size_t slice_start = i, run = 0, chars = 0;
    bool run_is_space = false;
    while (i < text.size() && chars < chunk_chars) {
      const size_t at = i;
      const bool is_space = python_isspace(next_code_point(text, i));
      if (chars++ == 0) run_is_space = is_space;
      if (run_is_space != is_space) {
        run = 1;
        run_is_space = is_space;
      } else if (++run > max_run_chars) {
        out.push_back(text.substr(slice_start, at - slice_start));
        slice_start = at;
        run = 1;
      }
    }
    out.push_back(text.substr(slice_start, i - slice_start));
  } while (i < text.size());
  return out;
}

std::unique_ptr<TiktokenTokenizer> open_kimi_tiktoken(const std::string& path) {
  TiktokenConfig config;
  config.name = path;
  config.ranks = load_tiktoken_ranks(path);
  config.pattern = kimi_pattern();
  config.kimi_chat = true;
  config.kimi_split_long_runs = true;
  config.stop_tokens = {"<|im_end|>", "[EOS]"};
  const auto base = int32_t(config.ranks.size());  // tokenization_kimi.py: len(mergeable_ranks)

  std::map<int32_t, std::string> names;
  for (const auto& [text, offset] : kimi_special_offsets()) names[base + offset] = text;
  const auto side = std::filesystem::path(path).parent_path() / "tokenizer_config.json";
  if (std::filesystem::exists(side)) {  // the checkpoint's own names win, as in the HF code
    nlohmann::json cfg;
    try {
      cfg = nlohmann::json::parse(read_text_file(side.string()));
    } catch (const nlohmann::json::exception& e) {
      throw Error(side.string() + ": not valid JSON (" + e.what() + ")");
    }
    if (cfg.is_object() && cfg.contains("added_tokens_decoder")) {
      const nlohmann::json& added = cfg["added_tokens_decoder"];
      require(added.is_object(), side.string() + ": 'added_tokens_decoder' is not an object");
      names.clear();
      for (const auto& [key, token] : added.items()) {
        const int64_t id = parse_decimal(key, RankTable::kMaxRank);
        require(id >= 0 && token.is_object() && token.contains("content") &&
                    token["content"].is_string(),
                side.string() + ": added_tokens_decoder entry '" + key +
                    "' needs an integer key and a string 'content'");
        names[int32_t(id)] = token["content"].get<std::string>();
      }
    }
  }
  for (int32_t id = base; id < base + kKimiSpecialCount; ++id) {
    const auto it = names.find(id);
    config.special_tokens.emplace_back(
        it != names.end() ? it->second : "<|reserved_token_" + std::to_string(id) + "|>", id);
  }
  return std::make_unique<TiktokenTokenizer>(std::move(config));
}

}  // namespace kda::tokenizer
