#include "tokenizer/text_stream.h"

#include <vector>

namespace kda::tokenizer {
namespace {

const char* const kReplacement = "\xEF\xBF\xBD";

// The length of the well-formed character starting at s[i] (1 to 4), 0 when the bytes there
// cannot start one, or -1 when they could but the string ends first.
int character_length(const std::string& s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  if (c < 0x80) return 1;
  int n = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // the allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;  // no overlong forms
    if (c == 0xED) hi = 0x9F;  // no surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;  // nothing past U+10FFFF
  } else {
    return 0;
  }
  for (int k = 1; k < n; ++k) {
    if (i + size_t(k) >= s.size()) return -1;
    const unsigned char x = b(i + size_t(k));
    if (k == 1 ? (x < lo || x > hi) : (x < 0x80 || x > 0xBF)) return 0;
  }
  return n;
}

}  // namespace

std::string valid_utf8(const std::string& bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (size_t i = 0; i < bytes.size();) {
    const int n = character_length(bytes, i);
    if (n > 0) {
      out.append(bytes, i, size_t(n));
      i += size_t(n);
    } else {
      out += kReplacement;
      ++i;
    }
  }
  return out;
}

size_t incomplete_utf8_tail(const std::string& bytes) {
  for (size_t back = 1; back <= 3 && back <= bytes.size(); ++back) {
    const size_t i = bytes.size() - back;
    const unsigned char c = static_cast<unsigned char>(bytes[i]);
    if (c >= 0x80 && c <= 0xBF) continue;  // a continuation byte: look further back
    return character_length(bytes, i) == -1 ? back : 0;
  }
  return 0;
}

std::string TextStream::add(int32_t id) {
  pending_ += tok_.decode(std::vector<int32_t>{id});
  const size_t keep = incomplete_utf8_tail(pending_);
  std::string out = valid_utf8(pending_.substr(0, pending_.size() - keep));
  pending_.erase(0, pending_.size() - keep);
  return out;
}

std::string TextStream::finish() {
  std::string out = valid_utf8(pending_);
  pending_.clear();
  return out;
}

}  // namespace kda::tokenizer
