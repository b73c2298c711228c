#include "tokenizer/gpt2_tokenizer.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "tokenizer/bpe.h"
#include "tokenizer/text_file.h"

namespace kda::tokenizer {
namespace {

void append_utf8(std::string& out, uint32_t c) {
  if (c < 0x80) {
    out += char(c);
  } else if (c < 0x800) {
    out += char(0xC0 | (c >> 6));
    out += char(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += char(0xE0 | (c >> 12));
    out += char(0x80 | ((c >> 6) & 0x3F));
    out += char(0x80 | (c & 0x3F));
  } else {
    out += char(0xF0 | (c >> 18));
    out += char(0x80 | ((c >> 12) & 0x3F));
    out += char(0x80 | ((c >> 6) & 0x3F));
    out += char(0x80 | (c & 0x3F));
  }
}

uint64_t pair_key(int32_t left, int32_t right) {
  return (uint64_t(uint32_t(left)) << 32) | uint32_t(right);
}

}  // namespace

const std::string& gpt2_pattern() {
  static const std::string pattern =
      R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
  return pattern;
}

const std::array<uint32_t, 256>& gpt2_byte_to_unicode() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    uint32_t n = 0;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      t[b] = printable ? b : 256 + n++;
    }
    return t;
  }();
  return table;
}

Gpt2Tokenizer::Gpt2Tokenizer() : pretokenizer_(gpt2_pattern()) {
  byte_id_.fill(-1);
}

std::unique_ptr<Gpt2Tokenizer> Gpt2Tokenizer::open(const std::string& vocab_path,
                                                   const std::string& merges_path) {
  std::unique_ptr<Gpt2Tokenizer> tok(new Gpt2Tokenizer());
  tok->name_ = vocab_path;
  nlohmann::json vocab;
  try {
    vocab = nlohmann::json::parse(read_text_file(vocab_path));
  } catch (const nlohmann::json::exception& e) {
    throw Error(vocab_path + ": not valid JSON (" + e.what() + ")");
  }
  require(vocab.is_object() && !vocab.empty(),
          vocab_path + ": expected a JSON object of token -> id");

  // Token string -> id, and what each id decodes to (bytes through the inverse mapping).
  std::unordered_map<std::string, int32_t> id_of;
  std::unordered_map<uint32_t, uint8_t> byte_of_code_point;
  const auto& to_unicode = gpt2_byte_to_unicode();
  for (int b = 0; b < 256; ++b) byte_of_code_point[to_unicode[b]] = uint8_t(b);
  for (const auto& [token, value] : vocab.items()) {
    require(value.is_number_integer() && value.get<int64_t>() >= 0 &&
                value.get<int64_t>() <= RankTable::kMaxRank,
            vocab_path + ": token '" + token + "' has no valid id");
    const auto id = int32_t(value.get<int64_t>());
    id_of[token] = id;
    if (size_t(id) >= tok->bytes_of_id_.size()) {
      tok->bytes_of_id_.resize(size_t(id) + 1);
      tok->has_id_.resize(size_t(id) + 1, 0);
    }
    require(!tok->has_id_[id], vocab_path + ": id " + std::to_string(id) + " appears twice");
    tok->has_id_[id] = 1;
    require(valid_utf8(token), vocab_path + ": a token is not valid UTF-8");
    std::string bytes;
    for (size_t i = 0; i < token.size();) {
      const size_t start = i;
      const auto lead = uint8_t(token[i]);
      const size_t len = lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
      uint32_t c = len == 1 ? lead : lead & (0x7F >> len);
      for (size_t k = 1; k < len; ++k) c = (c << 6) | (uint8_t(token[i + k]) & 0x3F);
      i += len;
      const auto it = byte_of_code_point.find(c);
      if (it != byte_of_code_point.end())
        bytes += char(it->second);
      else  // not from the byte alphabet (an added token): its own text
        bytes.append(token, start, len);
    }
    tok->bytes_of_id_[id] = std::move(bytes);
  }
  for (int b = 0; b < 256; ++b) {
    std::string symbol;
    append_utf8(symbol, to_unicode[b]);
    const auto it = id_of.find(symbol);
    tok->byte_id_[b] = it == id_of.end() ? -1 : it->second;
  }

  const std::string merges = read_text_file(merges_path);
  int32_t rank = 0;
  for_each_line(merges, [&](std::string_view line, size_t number) {
    const auto where = [&] { return merges_path + ":" + std::to_string(number) + ": "; };
    if (number == 1 && line.rfind("#version", 0) == 0) return;
    const std::vector<std::string_view> fields = split_fields(line);
    if (fields.empty()) return;
    if (fields.size() != 2) throw Error(where() + "malformed merge line (expected 'LEFT RIGHT')");
    int32_t ids[3];
    const std::string parts[3] = {std::string(fields[0]), std::string(fields[1]),
                                  std::string(fields[0]) + std::string(fields[1])};
    for (int k = 0; k < 3; ++k) {
      const auto it = id_of.find(parts[k]);
      if (it == id_of.end()) throw Error(where() + "'" + parts[k] + "' is not in " + vocab_path);
      ids[k] = it->second;
    }
    tok->merges_[pair_key(ids[0], ids[1])] = {rank++, ids[2]};  // a repeat: the later rank
  });
  require(rank > 0, merges_path + ": no merges in the file");

  if (const auto it = id_of.find("<|endoftext|>"); it != id_of.end())
    tok->specials_.add(it->first, it->second);
  return tok;
}

// encoder.py's bpe(): while some adjacent pair has a merge, take the pair of lowest rank and
// merge every occurrence of it, left to right. Done with a heap in rounds (all candidates of
// one rank per round) so that long pieces stay O(n log n); a candidate is stale once either
// side changed, which shows as different ids.
void Gpt2Tokenizer::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  struct Candidate {
    int32_t rank;
    uint32_t start;
    int32_t left, right, merged;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : start > o.start;
    }
  };
  require(piece.size() < UINT32_MAX, "encode: piece too long");
  const auto n = uint32_t(piece.size());
  thread_local std::vector<int32_t> id;
  thread_local std::vector<uint32_t> next, prev;
  thread_local std::vector<uint8_t> alive;
  thread_local std::vector<Candidate> heap, round;
  id.resize(n);
  next.resize(n);
  prev.resize(n);
  alive.assign(n, 1);
  heap.clear();
  const auto later = std::greater<Candidate>();
  for (uint32_t i = 0; i < n; ++i) {
    id[i] = byte_id_[uint8_t(piece[i])];
    if (id[i] < 0) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "0x%02X", unsigned(uint8_t(piece[i])));
      throw Error(name_ + ": byte " + hex + " has no symbol in the vocabulary");
    }
    next[i] = i + 1;
    prev[i] = i == 0 ? n : i - 1;
  }
  auto consider = [&](uint32_t s) {
    if (s >= n || next[s] >= n) return;
    const auto it = merges_.find(pair_key(id[s], id[next[s]]));
    if (it == merges_.end()) return;
    heap.push_back({it->second.rank, s, id[s], id[next[s]], it->second.merged});
    std::push_heap(heap.begin(), heap.end(), later);
  };
  auto valid = [&](const Candidate& c) {
    return alive[c.start] && id[c.start] == c.left && next[c.start] < n &&
           id[next[c.start]] == c.right;
  };
  for (uint32_t i = 0; i + 1 < n; ++i) consider(i);
  while (!heap.empty()) {
    round.clear();
    const int32_t rank = heap.front().rank;
    while (!heap.empty() && heap.front().rank == rank) {
      std::pop_heap(heap.begin(), heap.end(), later);
      round.push_back(heap.back());
      heap.pop_back();
    }
    std::sort(round.begin(), round.end(),
              [](const Candidate& a, const Candidate& b) { return a.start < b.start; });
    for (const Candidate& c : round) {
      if (!valid(c)) continue;
      const uint32_t right = next[c.start];
      alive[right] = 0;
      id[c.start] = c.merged;
      next[c.start] = next[right];
      if (next[c.start] < n) prev[next[c.start]] = c.start;
      consider(prev[c.start]);
      consider(c.start);
    }
  }
  for (uint32_t i = 0; i < n; i = next[i]) out.push_back(id[i]);
}

std::vector<int32_t> Gpt2Tokenizer::encode(const std::string& text, bool allow_special) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 1);
  encode_with_specials(
      text, allow_special ? &specials_ : nullptr, pretokenizer_,
      [&](std::string_view piece) { encode_piece(piece, out); }, out);
  return out;
}

std::string Gpt2Tokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (const int32_t id : ids) {
    require(id >= 0 && size_t(id) < has_id_.size() && has_id_[id],
            "decode: id " + std::to_string(id) + " is not in the vocabulary of " + name_ +
                " (size " + std::to_string(vocab_size()) + ")");
    out += bytes_of_id_[id];
  }
  return out;
}

std::string Gpt2Tokenizer::apply_chat_template(const std::vector<ChatMessage>&) const {
  throw Error(name_ + ": GPT-2 BPE has no chat template");
}

std::vector<int32_t> Gpt2Tokenizer::stop_ids() const {
  const int32_t eot = specials_.id_of("<|endoftext|>");
  return eot >= 0 ? std::vector<int32_t>{eot} : std::vector<int32_t>{};
}

}  // namespace kda::tokenizer
