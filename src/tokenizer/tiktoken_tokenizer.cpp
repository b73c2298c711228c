#include "tokenizer/tiktoken_tokenizer.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "tokenizer/text_file.h"

namespace kda::tokenizer {

std::string kimi_chat_prompt(const std::vector<ChatMessage>& messages);  // kimi_tokenizer.cpp

TiktokenTokenizer::TiktokenTokenizer(TiktokenConfig config)
    : config_(std::move(config)), pretokenizer_(config_.pattern) {
  for (const auto& [text, id] : config_.special_tokens) {
    require(!config_.ranks.has_rank(id), config_.name + ": special token '" + text + "' id " +
                                             std::to_string(id) + " is also a rank");
    specials_.add(text, id);
  }
}

void TiktokenTokenizer::encode_chunk(std::string_view text, bool allow_special,
                                     std::vector<int32_t>& out) const {
  encode_with_specials(
      text, allow_special ? &specials_ : nullptr, pretokenizer_,
      [&](std::string_view piece) { byte_pair_encode(piece, config_.ranks, out); }, out);
}

std::vector<int32_t> TiktokenTokenizer::encode(const std::string& text, bool allow_special) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 1);
  if (!config_.kimi_split_long_runs) {
    encode_chunk(text, allow_special, out);
    return out;
  }
  require_utf8(text, "encode");
  for (std::string_view chunk : kimi_split_long_runs(text)) encode_chunk(chunk, allow_special, out);
  return out;
}

std::string TiktokenTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (const int32_t id : ids) {
    if (config_.ranks.has_rank(id)) {
      out += config_.ranks.bytes_of(id);
    } else if (const std::string* special = specials_.text_of(id)) {
      out += *special;
    } else {
      throw Error("decode: id " + std::to_string(id) + " is not in the vocabulary of " +
                  config_.name + " (size " + std::to_string(vocab_size()) + ")");
    }
  }
  return out;
}

int64_t TiktokenTokenizer::vocab_size() const {
  return int64_t(std::max(config_.ranks.max_rank(), specials_.max_id())) + 1;
}

std::string TiktokenTokenizer::apply_chat_template(const std::vector<ChatMessage>& messages) const {
  require(config_.kimi_chat, config_.name + ": this tokenizer has no chat template");
  return kimi_chat_prompt(messages);
}

std::vector<int32_t> TiktokenTokenizer::stop_ids() const {
  std::vector<int32_t> ids;
  for (const std::string& name : config_.stop_tokens)
    if (const int32_t id = specials_.id_of(name); id >= 0) ids.push_back(id);
  return ids;
}

std::unique_ptr<TiktokenTokenizer> open_tiktoken_file(const std::string& path) {
  const std::filesystem::path json_path = std::filesystem::path(path).replace_extension(".json");
  require(std::filesystem::exists(path), path + ": no such file");
  require(std::filesystem::exists(json_path),
          path + ": its pattern and special tokens are missing: expected " + json_path.string() +
              " with {\"pat_str\": ..., \"special_tokens\": {...}}");
  nlohmann::json meta;
  try {
    meta = nlohmann::json::parse(read_text_file(json_path.string()));
  } catch (const nlohmann::json::exception& e) {
    throw Error(json_path.string() + ": not valid JSON (" + e.what() + ")");
  }
  const std::string where = json_path.string() + ": ";
  require(meta.is_object() && meta.contains("pat_str") && meta["pat_str"].is_string(),
          where + "field 'pat_str' missing or not a string");
  TiktokenConfig config;
  config.name = path;
  config.pattern = meta["pat_str"].get<std::string>();
  if (meta.contains("special_tokens")) {
    require(meta["special_tokens"].is_object(), where + "'special_tokens' is not an object");
    for (const auto& [text, id] : meta["special_tokens"].items()) {
      require(id.is_number_integer() && id.get<int64_t>() >= 0 &&
                  id.get<int64_t>() <= RankTable::kMaxRank,
              where + "special token '" + text + "' has no valid id");
      config.special_tokens.emplace_back(text, int32_t(id.get<int64_t>()));
    }
  }
  std::sort(config.special_tokens.begin(), config.special_tokens.end(),
            [](const auto& a, const auto& b) { return a.second < b.second; });
  config.stop_tokens = {"<|endoftext|>"};
  config.ranks = load_tiktoken_ranks(path);
  try {
    return std::make_unique<TiktokenTokenizer>(std::move(config));
  } catch (const Error& e) {
    throw Error(where + e.what());
  }
}

}  // namespace kda::tokenizer
