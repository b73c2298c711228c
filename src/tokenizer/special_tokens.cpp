#include "tokenizer/special_tokens.h"

#include <algorithm>

#include "core/error.h"

namespace kda::tokenizer {

void SpecialTokens::add(const std::string& text, int32_t id) {
  require(!text.empty(), "special token with empty text (id " + std::to_string(id) + ")");
  require(id >= 0, "special token '" + text + "' has a negative id");
  require(by_text_.count(text) == 0, "special token '" + text + "' appears twice");
  if (const auto it = by_id_.find(id); it != by_id_.end())
    throw Error("special tokens '" + it->second + "' and '" + text + "' share id " +
                std::to_string(id));
  by_text_[text] = id;
  by_id_[id] = text;
  auto& bucket = by_first_byte_[uint8_t(text[0])];
  bucket.emplace_back(text, id);
  std::stable_sort(bucket.begin(), bucket.end(),
                   [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  max_id_ = std::max(max_id_, id);
}

SpecialTokens::Match SpecialTokens::find(std::string_view text, size_t from) const {
  if (by_text_.empty()) return {};
  for (size_t i = from; i < text.size(); ++i) {
    for (const auto& [special, id] : by_first_byte_[uint8_t(text[i])])
      if (text.compare(i, special.size(), special) == 0) return {i, special.size(), id};
  }
  return {};
}

int32_t SpecialTokens::id_of(std::string_view text) const {
  const auto it = by_text_.find(std::string(text));
  return it == by_text_.end() ? -1 : it->second;
}

const std::string* SpecialTokens::text_of(int32_t id) const {
  const auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : &it->second;
}

void encode_with_specials(std::string_view text, const SpecialTokens* specials,
                          const Pretokenizer& pretokenizer,
                          const std::function<void(std::string_view)>& encode_piece,
                          std::vector<int32_t>& out) {
  require_utf8(text, "encode");
  size_t start = 0;
  while (true) {
    const SpecialTokens::Match next =
        specials ? specials->find(text, start) : SpecialTokens::Match{};
    const size_t end = next.pos == std::string_view::npos ? text.size() : next.pos;
    pretokenizer.split(text.substr(start, end - start), encode_piece);
    if (next.pos == std::string_view::npos) break;
    out.push_back(next.id);
    start = next.pos + next.length;
  }
}

}  // namespace kda::tokenizer
