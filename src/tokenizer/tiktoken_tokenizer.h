// tiktoken-format BPE: a rank file, a pre-tokenizer pattern and special tokens. Two ways in:
// NAME.tiktoken with its pattern and specials in NAME.json (OpenAI's encodings), and Kimi's
// tiktoken.model with Kimi's own pattern, specials and chat format.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tokenizer/bpe.h"
#include "tokenizer/pretokenizer.h"
#include "tokenizer/special_tokens.h"
#include "tokenizer/tokenizer.h"

namespace kda::tokenizer {

struct TiktokenConfig {
  std::string name;  // the rank file, for messages
  RankTable ranks;
  std::string pattern;  // tiktoken's pat_str (Rust regex syntax)
  std::vector<std::pair<std::string, int32_t>> special_tokens;
  bool kimi_chat = false;                // Kimi's <|im_*|> chat format
  std::vector<std::string> stop_tokens;  // special tokens that end generation (those present)
  // Kimi's Hugging Face wrapper encodes 400k-character chunks, cut again wherever a run of
  // whitespace or non-whitespace passes 25k characters (a tiktoken stack workaround); the
  // cuts change the tokens at those points, so they are part of the format.
  bool kimi_split_long_runs = false;
};

class TiktokenTokenizer final : public Tokenizer {
 public:
  explicit TiktokenTokenizer(TiktokenConfig config);
  std::vector<int32_t> encode(const std::string& text, bool allow_special = true) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int64_t vocab_size() const override;
  std::string apply_chat_template(const std::vector<ChatMessage>& messages) const override;
  std::vector<int32_t> stop_ids() const override;

  const Pretokenizer& pretokenizer() const { return pretokenizer_; }
  const SpecialTokens& special_tokens() const { return specials_; }
  const RankTable& ranks() const { return config_.ranks; }

 private:
  void encode_chunk(std::string_view text, bool allow_special, std::vector<int32_t>& out) const;

  TiktokenConfig config_;
  Pretokenizer pretokenizer_;
  SpecialTokens specials_;
};

// NAME.tiktoken, with {"pat_str": ..., "special_tokens": {text: id}} in NAME.json beside it.
std::unique_ptr<TiktokenTokenizer> open_tiktoken_file(const std::string& path);

// Kimi's tiktoken.model. Specials fill the 256 ids after the ranks: the known Kimi names (or,
// when tokenizer_config.json sits beside the file, its added_tokens_decoder), and
// <|reserved_token_ID|> for the rest.
std::unique_ptr<TiktokenTokenizer> open_kimi_tiktoken(const std::string& path);
// Kimi's pat_str (tokenization_kimi.py), Rust regex syntax with class intersections.
const std::string& kimi_pattern();
// Kimi's named specials as offsets from the first special id (the number of ranks).
const std::vector<std::pair<std::string, int32_t>>& kimi_special_offsets();
constexpr int32_t kKimiSpecialCount = 256;

// Kimi's _split_whitespaces_or_nonwhitespaces over 400k-character chunks, as byte ranges.
std::vector<std::string_view> kimi_split_long_runs(std::string_view text,
                                                   size_t chunk_chars = 400000,
                                                   size_t max_run_chars = 25000);

}  // namespace kda::tokenizer
