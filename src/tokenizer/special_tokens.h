// Special tokens (<|endoftext|>, <|im_end|>, ...) and the encode loop shared by the BPE
// tokenizers: allowed specials are cut out first, the text between them goes through the
// pre-tokenizer, and each piece through the tokenizer's own BPE.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tokenizer/pretokenizer.h"

namespace kda::tokenizer {

class SpecialTokens {
 public:
  struct Match {
    size_t pos = std::string_view::npos;
    size_t length = 0;
    int32_t id = -1;
  };
  // Throws kda::Error on an empty text, or a text or id already present.
  void add(const std::string& text, int32_t id);
  // The first special token in text at or after `from` (the longest one at that position);
  // pos == npos when there is none.
  Match find(std::string_view text, size_t from) const;
  int32_t id_of(std::string_view text) const;    // -1 when absent
  const std::string* text_of(int32_t id) const;  // nullptr when absent
  size_t size() const { return by_text_.size(); }
  int32_t max_id() const { return max_id_; }  // -1 when empty

 private:
  std::unordered_map<std::string, int32_t> by_text_;
  std::unordered_map<int32_t, std::string> by_id_;
  std::array<std::vector<std::pair<std::string, int32_t>>, 256> by_first_byte_;
  int32_t max_id_ = -1;
};

// tiktoken's encode loop. `specials` null: special-token texts are plain text. Throws
// kda::Error when `text` is not valid UTF-8.
void encode_with_specials(std::string_view text, const SpecialTokens* specials,
                          const Pretokenizer& pretokenizer,
                          const std::function<void(std::string_view)>& encode_piece,
                          std::vector<int32_t>& out);

}  // namespace kda::tokenizer
