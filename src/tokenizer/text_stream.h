// Text of a growing list of generated ids, handed out piece by piece: each add() decodes all ids
// so far and returns what is new, holding back a trailing U+FFFD (a character whose bytes have
// not all arrived yet), so that no piece ever splits a UTF-8 character.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace kda::tokenizer {

class TextStream {
 public:
  explicit TextStream(const Tokenizer& tok) : tok_(tok) {}
  // The text that the id completes (often empty mid-character).
  std::string add(int32_t id);
  // Whatever was held back (an incomplete character is given as U+FFFD).
  std::string finish();

 private:
  std::string take(bool final);
  const Tokenizer& tok_;
  std::vector<int32_t> ids_;
  size_t given_ = 0;  // bytes of the decoded text already handed out
};

}  // namespace kda::tokenizer
