#include "tokenizer/bpe.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>

#include "core/error.h"
#include "tokenizer/text_file.h"

namespace kda::tokenizer {
namespace {

uint64_t hash_bytes(std::string_view s) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ s.size();
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    h = (h ^ w) * 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
  }
  uint64_t w = 0;
  std::memcpy(&w, s.data() + i, s.size() - i);
  h = (h ^ w) * 0x94D049BB133111EBull;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  return h ^ (h >> 32);
}

}  // namespace

void RankTable::reserve(size_t entries) {
  entries_.reserve(entries);
  size_t capacity = 16;
  while (capacity < 2 * entries) capacity *= 2;
  if (capacity > slots_.size()) {
    slots_.assign(capacity, 0);
    for (size_t k = 0; k < entries_.size(); ++k) {
      const std::string_view bytes = key(entries_[k]);
      slots_[slot_of(bytes, hash_bytes(bytes))] = uint32_t(k + 1);
    }
  }
}

void RankTable::grow() {
  reserve(std::max<size_t>(16, entries_.size() * 2));
}

// The slot holding `bytes`, or the empty slot where it would go.
size_t RankTable::slot_of(std::string_view bytes, uint64_t hash) const {
  const size_t mask = slots_.size() - 1;
  for (size_t s = hash & mask;; s = (s + 1) & mask) {
    const uint32_t at = slots_[s];
    if (at == 0) return s;
    const Entry& e = entries_[at - 1];
    if (e.length == bytes.size() &&
        std::memcmp(arena_.data() + e.offset, bytes.data(), e.length) == 0)
      return s;
  }
}

bool RankTable::insert(std::string_view bytes, int32_t rank) {
  require(rank >= 0 && rank <= kMaxRank,
          "rank " + std::to_string(rank) + " is outside 0.." + std::to_string(kMaxRank));
  if (has_rank(rank)) throw Error("rank " + std::to_string(rank) + " appears twice");
  if (2 * (entries_.size() + 1) > slots_.size()) grow();
  const size_t s = slot_of(bytes, hash_bytes(bytes));
  if (slots_[s] != 0) return false;
  entries_.push_back({arena_.size(), uint32_t(bytes.size()), rank});
  arena_.append(bytes);
  slots_[s] = uint32_t(entries_.size());
  if (size_t(rank) >= by_rank_.size())
    by_rank_.resize(std::max(size_t(rank) + 1, by_rank_.size() * 2), -1);
  by_rank_[rank] = int32_t(entries_.size() - 1);
  max_rank_ = std::max(max_rank_, rank);
  return true;
}

int32_t RankTable::find(std::string_view bytes) const {
  if (slots_.empty()) return -1;
  const uint32_t at = slots_[slot_of(bytes, hash_bytes(bytes))];
  return at == 0 ? -1 : entries_[at - 1].rank;
}

bool RankTable::has_rank(int32_t rank) const {
  return rank >= 0 && size_t(rank) < by_rank_.size() && by_rank_[rank] >= 0;
}

std::string_view RankTable::bytes_of(int32_t rank) const {
  return key(entries_[by_rank_[rank]]);
}

bool base64_decode(std::string_view text, std::string& out) {
  out.clear();
  if (text.size() % 4 != 0) return false;
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  for (size_t i = 0; i < text.size(); i += 4) {
    const bool last = i + 4 == text.size();
    const int pad = last ? (text[i + 3] == '=') + (text[i + 2] == '=' && text[i + 3] == '=') : 0;
    uint32_t bits = 0;
    for (int k = 0; k < 4 - pad; ++k) {
      const int v = value(text[i + k]);
      if (v < 0) return false;
      bits |= uint32_t(v) << (18 - 6 * k);
    }
    out += char(bits >> 16);
    if (pad < 2) out += char((bits >> 8) & 0xFF);
    if (pad < 1) out += char(bits & 0xFF);
  }
  return true;
}

std::string base64_encode(std::string_view bytes) {
  static const char kAlphabet[] =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  for (size_t i = 0; i < bytes.size(); i += 3) {
    const size_t n = std::min<size_t>(3, bytes.size() - i);
    uint32_t bits = 0;
    for (size_t k = 0; k < n; ++k) bits |= uint32_t(uint8_t(bytes[i + k])) << (16 - 8 * k);
    for (size_t k = 0; k < 4; ++k) out += k <= n ? kAlphabet[(bits >> (18 - 6 * k)) & 63] : '=';
  }
  return out;
}

RankTable load_tiktoken_ranks(const std::string& path) {
  const std::string text = read_text_file(path);
  RankTable table;
  table.reserve(size_t(std::count(text.begin(), text.end(), '\n')) + 1);
  std::vector<int64_t> line_of_rank;  // for the message on a repeated rank
  std::string token;
  for_each_line(text, [&](std::string_view line, size_t number) {
    const auto where = [&] { return path + ":" + std::to_string(number) + ": "; };
    const std::vector<std::string_view> fields = split_fields(line);
    if (fields.empty()) return;
    if (fields.size() != 2)
      throw Error(where() + "malformed rank line (expected '<base64 token> <rank>')");
    if (!base64_decode(fields[0], token))
      throw Error(where() + "bad base64 token '" + std::string(fields[0]) + "'");
    if (token.empty()) throw Error(where() + "empty token");
    const int64_t rank = parse_decimal(fields[1], RankTable::kMaxRank);
    if (rank < 0)
      throw Error(where() + "bad rank '" + std::string(fields[1]) + "' (expected 0.." +
                  std::to_string(RankTable::kMaxRank) + ")");
    if (size_t(rank) < line_of_rank.size() && line_of_rank[rank] > 0)
      throw Error(where() + "duplicate rank " + std::to_string(rank) + " (first on line " +
                  std::to_string(line_of_rank[rank]) + ")");
    if (!table.insert(token, int32_t(rank)))
      throw Error(where() + "duplicate token '" + std::string(fields[0]) + "' (rank " +
                  std::to_string(table.find(token)) + " already has it)");
    if (size_t(rank) >= line_of_rank.size()) line_of_rank.resize(size_t(rank) + 1, 0);
    line_of_rank[rank] = int64_t(number);
  });
  require(table.size() > 0, path + ": no ranks in the file");
  return table;
}

void byte_pair_encode(std::string_view piece, const RankTable& ranks, std::vector<int32_t>& out) {
  if (piece.empty()) return;
  if (const int32_t whole = ranks.find(piece); whole >= 0) {
    out.push_back(whole);
    return;
  }
  // Parts are byte ranges [start, next[start]); a candidate merge joins the part at `start`
  // with the one after it, spanning [start, end). The heap's order (rank, then start) is
  // tiktoken's choice: the lowest rank, the leftmost on ties. An entry is stale once either
  // part changed, which shows as a different end.
  struct Candidate {
    int32_t rank;
    uint32_t start, end;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : start > o.start;
    }
  };
  require(piece.size() < UINT32_MAX, "byte-pair encoding: piece too long");
  const auto n = uint32_t(piece.size());
  thread_local std::vector<uint32_t> next, prev;
  thread_local std::vector<uint8_t> alive;
  thread_local std::vector<Candidate> heap;
  next.resize(n);
  prev.resize(n);
  alive.assign(n, 1);
  for (uint32_t i = 0; i < n; ++i) next[i] = i + 1, prev[i] = i - 1;
  heap.clear();
  const auto later = std::greater<Candidate>();
  auto consider = [&](uint32_t start) {
    const uint32_t mid = next[start];
    if (mid >= n) return;
    const uint32_t end = next[mid];
    const int32_t rank = ranks.find(piece.substr(start, end - start));
    if (rank < 0) return;
    heap.push_back({rank, start, end});
    std::push_heap(heap.begin(), heap.end(), later);
  };
  for (uint32_t i = 0; i + 1 < n; ++i) consider(i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    const Candidate c = heap.back();
    heap.pop_back();
    if (!alive[c.start] || next[c.start] >= n || next[next[c.start]] != c.end) continue;
    const uint32_t mid = next[c.start];
    alive[mid] = 0;
    next[c.start] = c.end;
    if (c.end < n) prev[c.end] = c.start;
    if (c.start > 0) consider(prev[c.start]);
    consider(c.start);
  }
  for (uint32_t i = 0; i < n; i = next[i]) {
    const int32_t rank = ranks.find(piece.substr(i, next[i] - i));
    if (rank < 0) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "0x%02X", unsigned(uint8_t(piece[i])));
      throw Error(std::string("byte-pair encoding: byte ") + hex +
                  " has no rank (the rank file lacks single bytes)");
    }
    out.push_back(rank);
  }
}

}  // namespace kda::tokenizer
