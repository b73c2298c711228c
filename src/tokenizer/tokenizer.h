// Text <-> token ids: tiktoken-format BPE (rank files + pre-tokenizer regex + special tokens;
// Kimi's tiktoken.model with its pattern and chat template) and GPT-2 byte-level BPE
// (vocab.json/encoder.json + merges.txt/vocab.bpe).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kda::tokenizer {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant"
  std::string content;
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Special tokens in the text are encoded as their ids when allow_special is true.
  virtual std::vector<int32_t> encode(const std::string& text, bool allow_special = true) const = 0;
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  virtual int64_t vocab_size() const = 0;
  // The prompt for a chat (with the assistant turn opened); throws if the tokenizer has no
  // chat template.
  virtual std::string apply_chat_template(const std::vector<ChatMessage>& messages) const = 0;
  // Ids that end generation (e.g. <|im_end|>, <|endoftext|>).
  virtual std::vector<int32_t> stop_ids() const = 0;
};

// PATH: a model folder (tiktoken.model, or vocab.json + merges.txt, or encoder.json +
// vocab.bpe), a NAME.tiktoken rank file (pattern and specials from a sibling NAME.json), or a
// tiktoken.model file. Throws kda::Error naming what is missing.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path);
// True when load_tokenizer would find a tokenizer in this model folder.
bool folder_has_tokenizer(const std::string& dir);

}  // namespace kda::tokenizer
