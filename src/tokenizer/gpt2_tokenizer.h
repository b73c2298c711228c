// GPT-2 byte-level BPE: vocab.json (or encoder.json) maps token strings to ids, merges.txt (or
// vocab.bpe) ranks the merges. Bytes map to printable characters first (bytes_to_unicode),
// pieces come from GPT-2's regex, and each piece is merged by the original encoder.py loop.
#pragma once
#include <array>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "tokenizer/pretokenizer.h"
#include "tokenizer/special_tokens.h"
#include "tokenizer/tokenizer.h"

namespace kda::tokenizer {

const std::string& gpt2_pattern();
// GPT-2's bytes_to_unicode: byte -> the code point standing for it in vocab and merges.
const std::array<uint32_t, 256>& gpt2_byte_to_unicode();

class Gpt2Tokenizer final : public Tokenizer {
 public:
  // Throws kda::Error naming the file (and line) for anything missing or malformed.
  static std::unique_ptr<Gpt2Tokenizer> open(const std::string& vocab_path,
                                             const std::string& merges_path);
  std::vector<int32_t> encode(const std::string& text, bool allow_special = true) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int64_t vocab_size() const override { return int64_t(bytes_of_id_.size()); }
  std::string apply_chat_template(const std::vector<ChatMessage>& messages) const override;
  std::vector<int32_t> stop_ids() const override;

  const Pretokenizer& pretokenizer() const { return pretokenizer_; }

 private:
  Gpt2Tokenizer();
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;

  struct Merge {
    int32_t rank, merged;
  };
  std::string name_;
  std::vector<std::string> bytes_of_id_;  // what each id decodes to
  std::vector<uint8_t> has_id_;
  std::array<int32_t, 256> byte_id_{};          // id of each single-byte symbol, or -1
  std::unordered_map<uint64_t, Merge> merges_;  // (left id << 32 | right id) -> merge
  SpecialTokens specials_;
  Pretokenizer pretokenizer_;
};

}  // namespace kda::tokenizer
