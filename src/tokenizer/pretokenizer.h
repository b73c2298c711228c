// The pre-tokenizer: a regex (tiktoken's `pat_str`, written for Rust's regex crate) that cuts
// text into pieces before BPE. Runs on PCRE2 (UTF + UCP, JIT where available) after
// translating the few places where the two dialects differ.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace kda::tokenizer {

// Rust-regex pattern -> PCRE2 pattern with the same meaning:
//   \s, \S         -> \p{White_Space}, \P{White_Space} (PCRE2's \s also takes U+180E)
//   \p{Han}        -> \p{sc:Han}: a bare script name is Script in Rust, Script_Extensions in
//                     PCRE2 (which would pull CJK punctuation such as U+3002 into Han)
//   [A&&B], [A--B] -> (?:(?=B)A), (?:(?!B)A): PCRE2 has no class set operations
//   [a[bc]]        -> (?:[a]|[bc]): nested classes are unions
// Throws kda::Error on a class that is not closed or an operator it does not know (~~).
std::string translate_rust_pattern(std::string_view pattern);

// True when `text` is well-formed UTF-8; `bad_offset` gets the first bad byte otherwise.
bool valid_utf8(std::string_view text, size_t* bad_offset = nullptr);
// Throws kda::Error "WHAT: the text is not valid UTF-8 (byte N)".
void require_utf8(std::string_view text, const std::string& what);

class Pretokenizer {
 public:
  // `pattern` in Rust-regex syntax; throws kda::Error with PCRE2's message and offset.
  explicit Pretokenizer(const std::string& pattern);
  ~Pretokenizer();
  Pretokenizer(const Pretokenizer&) = delete;
  Pretokenizer& operator=(const Pretokenizer&) = delete;

  // Calls `piece` for every match of the pattern in `text`, left to right (text between
  // matches, which these patterns never leave, is dropped as tiktoken drops it). `text` must
  // be valid UTF-8 (checked by the caller once; see valid_utf8). The pattern sees `text` as
  // the whole subject: lookaheads stop at its end.
  void split(std::string_view text, const std::function<void(std::string_view)>& piece) const;
  std::vector<std::string> split(std::string_view text) const;

  const std::string& source_pattern() const { return source_; }
  const std::string& pcre2_pattern() const { return translated_; }

 private:
  struct Compiled;
  std::string source_, translated_;
  std::unique_ptr<Compiled> compiled_;
};

}  // namespace kda::tokenizer
