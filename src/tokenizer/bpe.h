// Byte-pair encoding over ranked byte strings (tiktoken's algorithm) and the table behind it.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kda::tokenizer {

// Byte string -> rank (token id), and back. Open addressing over one byte arena: the o200k
// table (200k entries) loads in a few tens of milliseconds.
class RankTable {
 public:
  static constexpr int32_t kMaxRank = (1 << 24) - 1;  // far above any real vocabulary

  // Returns false (and changes nothing) when `bytes` is already in the table. Throws
  // kda::Error when rank is outside 0..kMaxRank or already taken.
  bool insert(std::string_view bytes, int32_t rank);
  int32_t find(std::string_view bytes) const;  // -1 when absent
  bool has_rank(int32_t rank) const;
  std::string_view bytes_of(int32_t rank) const;  // requires has_rank(rank)
  size_t size() const { return entries_.size(); }
  int32_t max_rank() const { return max_rank_; }  // -1 when empty
  void reserve(size_t entries);

 private:
  struct Entry {
    uint64_t offset;
    uint32_t length;
    int32_t rank;
  };
  std::string_view key(const Entry& e) const { return {arena_.data() + e.offset, e.length}; }
  size_t slot_of(std::string_view bytes, uint64_t hash) const;
  void grow();

  std::string arena_;
  std::vector<Entry> entries_;
  std::vector<uint32_t> slots_;   // entry index + 1; 0 = empty
  std::vector<int32_t> by_rank_;  // rank -> entry index, -1 = none
  int32_t max_rank_ = -1;
};

// tiktoken.load.load_tiktoken_bpe: lines "<base64 token> <rank>" (blank lines skipped).
// Throws kda::Error naming `path` and the line on a malformed line, bad base64, an empty
// token, a repeated token or a repeated rank.
RankTable load_tiktoken_ranks(const std::string& path);
// Decodes standard base64 with padding; false on anything else.
bool base64_decode(std::string_view text, std::string& out);
std::string base64_encode(std::string_view bytes);

// tiktoken's byte_pair_encode: `piece` (bytes) -> ranks appended to `out`. A piece that is a
// whole token maps to it directly; otherwise adjacent parts are merged, always the pair whose
// concatenation has the lowest rank (the leftmost on ties), until no pair is in the table.
// Throws kda::Error if a byte of the piece has no rank.
void byte_pair_encode(std::string_view piece, const RankTable& ranks, std::vector<int32_t>& out);

}  // namespace kda::tokenizer
