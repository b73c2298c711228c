#include "tokenizer/pretokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <utility>

#include "core/error.h"

namespace kda::tokenizer {
namespace {

std::string pcre2_message(int code) {
  PCRE2_UCHAR buffer[256];
  if (pcre2_get_error_message(code, buffer, sizeof buffer) < 0)
    return "error " + std::to_string(code);
  return reinterpret_cast<const char*>(buffer);
}

// General categories (one or two letters, and PCRE2's L&) and the names PCRE2 and Rust share.
bool keeps_its_name(std::string_view name) {
  if (name.size() <= 2) return true;
  if (name.find(':') != std::string_view::npos || name.find('=') != std::string_view::npos)
    return true;
  static const char* const kShared[] = {"Any",       "White_Space", "Alphabetic", "Lowercase",
                                        "Uppercase", "Math",        "Dash",       "Emoji"};
  for (const char* shared : kShared)
    if (name == shared) return true;
  return false;
}

// pattern[i] is a backslash: returns the escape in PCRE2 syntax and moves i past it.
std::string translate_escape(std::string_view p, size_t& i) {
  require(i + 1 < p.size(), "pattern ends with a lone backslash");
  const char c = p[i + 1];
  if (c == 's' || c == 'S') {
    i += 2;
    return c == 's' ? "\\p{White_Space}" : "\\P{White_Space}";
  }
  if ((c == 'p' || c == 'P') && i + 2 < p.size() && p[i + 2] == '{') {
    const size_t close = p.find('}', i + 3);
    require(close != std::string_view::npos, "pattern has an unclosed \\p{...}");
    const std::string_view name = p.substr(i + 3, close - (i + 3));
    i = close + 1;
    return std::string("\\") + c + "{" + (keeps_its_name(name) ? "" : "sc:") + std::string(name) +
           "}";
  }
  if (c == 'x' && i + 2 < p.size() && p[i + 2] == '{') {
    const size_t close = p.find('}', i + 3);
    require(close != std::string_view::npos, "pattern has an unclosed \\x{...}");
    std::string out(p.substr(i, close + 1 - i));
    i = close + 1;
    return out;
  }
  i += 2;
  return std::string("\\") + c;
}

// pattern[i] is '[': returns a PCRE2 expression that matches one character of the class and
// moves i past its closing ']'.
std::string translate_class(std::string_view p, size_t& i) {
  ++i;
  bool negated = false;
  if (i < p.size() && p[i] == '^') {
    negated = true;
    ++i;
  }
  struct Operand {
    std::string op;      // "", "&&" or "--": how it combines with what is before it
    std::string simple;  // items of a plain PCRE2 class
    std::vector<std::string> nested;
  };
  std::vector<Operand> operands(1);
  bool first = true;
  while (true) {
    require(i < p.size(), "pattern has an unclosed character class");
    const char c = p[i];
    Operand& cur = operands.back();
    if (c == ']' && !first) {
      ++i;
      break;
    }
    first = false;
    if (c == '[' && i + 1 < p.size() && p[i + 1] == ':') {  // POSIX class [:alpha:]
      const size_t end = p.find(":]", i + 2);
      require(end != std::string_view::npos, "pattern has an unclosed [:class:]");
      cur.simple += p.substr(i, end + 2 - i);
      i = end + 2;
    } else if (c == '[') {
      cur.nested.push_back(translate_class(p, i));
    } else if (c == '\\') {
      cur.simple += translate_escape(p, i);
    } else if ((c == '&' || c == '-' || c == '~') && i + 1 < p.size() && p[i + 1] == c) {
      require(c != '~', "pattern uses the class operator ~~, which is not supported");
      operands.push_back({std::string(2, c), "", {}});
      first = true;
      i += 2;
    } else {
      cur.simple += c;
      ++i;
    }
  }
  auto union_of = [](const Operand& o) {
    require(!o.simple.empty() || !o.nested.empty(), "pattern has an empty class operand");
    std::vector<std::string> parts;
    if (!o.simple.empty()) parts.push_back("[" + o.simple + "]");
    parts.insert(parts.end(), o.nested.begin(), o.nested.end());
    if (parts.size() == 1) return parts[0];
    std::string out = "(?:";
    for (size_t k = 0; k < parts.size(); ++k) out += (k ? "|" : "") + parts[k];
    return out + ")";
  };
  if (operands.size() == 1 && operands[0].nested.empty())
    return (negated ? "[^" : "[") + operands[0].simple + "]";
  std::string expr = union_of(operands[0]);
  for (size_t k = 1; k < operands.size(); ++k) {
    const std::string rhs = union_of(operands[k]);
    expr = (operands[k].op == "&&" ? "(?:(?=" : "(?:(?!") + rhs + ")" + expr + ")";
  }
  return negated ? "(?:(?!" + expr + ")(?s:.))" : expr;
}

}  // namespace

std::string translate_rust_pattern(std::string_view p) {
  std::string out;
  out.reserve(p.size() * 2);
  size_t i = 0;
  while (i < p.size()) {
    if (p[i] == '\\')
      out += translate_escape(p, i);
    else if (p[i] == '[')
      out += translate_class(p, i);
    else
      out += p[i++];
  }
  return out;
}

bool valid_utf8(std::string_view text, size_t* bad_offset) {
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const unsigned c = s[i];
    size_t len = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2, cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3, cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4, cp = c & 0x07;
    } else {
      break;
    }
    if (i + len > n) break;
    bool ok = true;
    for (size_t k = 1; k < len; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) ok = false;
      cp = (cp << 6) | (s[i + k] & 0x3F);
    }
    static const uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    if (!ok || cp < kMin[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp < 0xE000)) break;
    i += len;
  }
  if (i < n && bad_offset) *bad_offset = i;
  return i >= n;
}

void require_utf8(std::string_view text, const std::string& what) {
  size_t bad = 0;
  if (!valid_utf8(text, &bad))
    throw Error(what + ": the text is not valid UTF-8 (byte " + std::to_string(bad) + ")");
}

struct Pretokenizer::Compiled {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Compiled() { pcre2_code_free(code); }
};

Pretokenizer::Pretokenizer(const std::string& pattern)
    : source_(pattern), translated_(translate_rust_pattern(pattern)), compiled_(new Compiled) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  compiled_->code =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated_.data()), translated_.size(),
                    PCRE2_UTF | PCRE2_UCP | PCRE2_DOLLAR_ENDONLY, &error, &offset, nullptr);
  if (!compiled_->code)
    throw Error("pre-tokenizer pattern does not compile (" + pcre2_message(error) + " at offset " +
                std::to_string(offset) + " of the PCRE2 form '" + translated_ + "')");
  // Without JIT (a build or CPU without it) the interpreter gives the same matches, slower.
  compiled_->jit = pcre2_jit_compile(compiled_->code, PCRE2_JIT_COMPLETE) == 0;
}

Pretokenizer::~Pretokenizer() = default;

namespace {

// Per-call match state: match data, and a JIT stack large enough for long words under
// patterns whose repeats are groups (Kimi's class intersections).
class MatchState {
 public:
  MatchState(const pcre2_code* code, bool jit)
      : data_(pcre2_match_data_create_from_pattern(code, nullptr)),
        context_(pcre2_match_context_create(nullptr)) {
    if (jit) {
      stack_ = pcre2_jit_stack_create(64 * 1024, 16 * 1024 * 1024, nullptr);
      if (stack_) pcre2_jit_stack_assign(context_, nullptr, stack_);
    }
    require(data_ && context_, "pre-tokenizer: out of memory");
  }
  ~MatchState() {
    pcre2_jit_stack_free(stack_);
    pcre2_match_context_free(context_);
    pcre2_match_data_free(data_);
  }
  MatchState(const MatchState&) = delete;
  MatchState& operator=(const MatchState&) = delete;
  pcre2_match_data* data() { return data_; }
  pcre2_match_context* context() { return context_; }

 private:
  pcre2_match_data* data_;
  pcre2_match_context* context_;
  pcre2_jit_stack* stack_ = nullptr;
};

}  // namespace

void Pretokenizer::split(std::string_view text,
                         const std::function<void(std::string_view)>& piece) const {
  if (text.empty()) return;
  MatchState state(compiled_->code, compiled_->jit);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t offset = 0;
  while (offset < text.size()) {
    int rc = pcre2_match(compiled_->code, subject, text.size(), offset, PCRE2_NO_UTF_CHECK,
                         state.data(), state.context());
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT)  // a very long match: the interpreter keeps its
      rc = pcre2_match(compiled_->code, subject, text.size(), offset,  // frames on the heap
                       PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, state.data(), state.context());
    if (rc == PCRE2_ERROR_NOMATCH) return;
    if (rc < 0) throw Error("pre-tokenizer: matching failed (" + pcre2_message(rc) + ")");
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(state.data());
    if (ov[1] > ov[0]) {
      piece(text.substr(ov[0], ov[1] - ov[0]));
      offset = ov[1];
    } else {  // an empty match: step over one character
      offset = ov[1] + 1;
      while (offset < text.size() && (static_cast<unsigned char>(text[offset]) & 0xC0) == 0x80)
        ++offset;
    }
  }
}

std::vector<std::string> Pretokenizer::split(std::string_view text) const {
  std::vector<std::string> pieces;
  split(text, [&](std::string_view p) { pieces.emplace_back(p); });
  return pieces;
}

}  // namespace kda::tokenizer
