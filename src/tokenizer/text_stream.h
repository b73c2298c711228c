// Text of a growing list of generated ids, handed out piece by piece as valid UTF-8: the bytes
// of each new id are appended (both tokenizers are byte-level: a list decodes to its ids' bytes
// in order), a trailing incomplete UTF-8 sequence is held back until its last byte arrives, and
// bytes that can never form a character are given as U+FFFD. So no piece splits a character and
// every piece can go into JSON as it is.
#pragma once
#include <cstdint>
#include <string>

#include "tokenizer/tokenizer.h"

namespace kda::tokenizer {

class TextStream {
 public:
  explicit TextStream(const Tokenizer& tok) : tok_(tok) {}
  // The text that the id completes (empty mid-character).
  std::string add(int32_t id);
  // Whatever was held back (an incomplete character is given as U+FFFD).
  std::string finish();

 private:
  const Tokenizer& tok_;
  std::string pending_;  // bytes not handed out yet: an incomplete trailing sequence
};

// `bytes` as valid UTF-8: each byte that does not start or continue a well-formed character
// (overlong forms, surrogates and code points past U+10FFFF included) becomes U+FFFD.
std::string valid_utf8(const std::string& bytes);
// How many bytes at the end of `bytes` are the start of a well-formed character still missing
// its last bytes (0 to 3).
size_t incomplete_utf8_tail(const std::string& bytes);

}  // namespace kda::tokenizer
