#include "tokenizer/text_stream.h"

namespace kda::tokenizer {

std::string TextStream::add(int32_t id) {
  ids_.push_back(id);
  return take(false);
}

std::string TextStream::finish() {
  return take(true);
}

std::string TextStream::take(bool final) {
  static const std::string kReplacement = "\xEF\xBF\xBD";
  const std::string text = tok_.decode(ids_);
  size_t end = text.size();
  if (!final && end >= kReplacement.size() &&
      text.compare(end - kReplacement.size(), kReplacement.size(), kReplacement) == 0)
    end -= kReplacement.size();
  if (end <= given_) return {};
  std::string piece = text.substr(given_, end - given_);
  given_ = end;
  return piece;
}

}  // namespace kda::tokenizer
