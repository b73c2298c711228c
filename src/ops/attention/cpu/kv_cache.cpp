// The KV cache of softmax attention and the two ways to use it: prefill (many tokens per
// sequence, the flash forward over the cached history) and decode (one token per sequence).
// Decode is bound by reading the cache, so it streams keys and values once with plain
// vectorised loops (a 1-row BLAS product would add a packing copy) and splits long caches into
// pieces that run in parallel and merge by their softmax statistics (flash-decoding).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "ops/attention/attention.h"
#include "ops/common/sequences.h"

namespace kda::ops {

KvCache::KvCache(int64_t num_slots, int64_t HKV, int64_t D, int64_t DV, int64_t max_tokens)
    : HKV_(HKV), D_(D), DV_(DV), max_tokens_(max_tokens) {
  require(num_slots >= 1 && HKV >= 1 && D >= 1 && DV >= 1 && max_tokens >= 0,
          "KvCache: slots, heads and sizes must be positive and max_tokens >= 0 (slots=" +
              std::to_string(num_slots) + " HKV=" + std::to_string(HKV) +
              " D=" + std::to_string(D) + " DV=" + std::to_string(DV) +
              " max_tokens=" + std::to_string(max_tokens) + ")");
  slots_.resize(size_t(num_slots));
}

const KvCache::Slot& KvCache::slot_at(int64_t slot) const {
  require(slot >= 0 && slot < num_slots(), "KvCache: slot " + std::to_string(slot) +
                                               " is out of range [0, " +
                                               std::to_string(num_slots()) + ")");
  return slots_[size_t(slot)];
}

int64_t KvCache::length(int64_t slot) const {
  return slot_at(slot).length;
}
int64_t KvCache::capacity(int64_t slot) const {
  return slot_at(slot).capacity;
}
const float* KvCache::keys(int64_t slot) const {
  return slot_at(slot).keys.get();
}
const float* KvCache::values(int64_t slot) const {
  return slot_at(slot).values.get();
}

void KvCache::check_room(int64_t slot, int64_t tokens) const {
  const Slot& held = slot_at(slot);
  require(tokens >= 0, "KvCache: cannot append a negative number of tokens");
  require(max_tokens_ == 0 || held.length + tokens <= max_tokens_,
          "KvCache: slot " + std::to_string(slot) + " holds " + std::to_string(held.length) +
              " tokens; " + std::to_string(tokens) +
              " more exceed max_tokens = " + std::to_string(max_tokens_));
}

void KvCache::reserve(int64_t slot, int64_t tokens) {
  slot_at(slot);
  require(max_tokens_ == 0 || tokens <= max_tokens_,
          "KvCache: cannot reserve " + std::to_string(tokens) +
              " tokens, more than max_tokens = " + std::to_string(max_tokens_));
  Slot& held = slots_[size_t(slot)];
  if (tokens <= held.capacity) return;
  auto keys = std::make_unique_for_overwrite<float[]>(size_t(tokens * HKV_ * D_));
  auto values = std::make_unique_for_overwrite<float[]>(size_t(tokens * HKV_ * DV_));
  if (held.length > 0) {
    std::memcpy(keys.get(), held.keys.get(), size_t(held.length * HKV_ * D_) * sizeof(float));
    std::memcpy(values.get(), held.values.get(), size_t(held.length * HKV_ * DV_) * sizeof(float));
  }
  held.keys = std::move(keys);
  held.values = std::move(values);
  held.capacity = tokens;
}

void KvCache::append(int64_t slot, const float* k, const float* v, int64_t tokens) {
  check_room(slot, tokens);
  if (tokens == 0) return;
  require(k && v, "KvCache::append: k and v must not be null");
  require_finite(k, tokens * HKV_ * D_, "KvCache::append: k");
  require_finite(v, tokens * HKV_ * DV_, "KvCache::append: v");
  Slot& held = slots_[size_t(slot)];
  const int64_t needed = held.length + tokens;
  if (needed > held.capacity) {
    int64_t grown = std::max({needed, 2 * held.capacity, int64_t(16)});
    if (max_tokens_ > 0) grown = std::min(grown, max_tokens_);
    reserve(slot, grown);
  }
  std::memcpy(held.keys.get() + held.length * HKV_ * D_, k,
              size_t(tokens * HKV_ * D_) * sizeof(float));
  std::memcpy(held.values.get() + held.length * HKV_ * DV_, v,
              size_t(tokens * HKV_ * DV_) * sizeof(float));
  held.length = needed;
}

void KvCache::clear(int64_t slot) {
  slot_at(slot);
  slots_[size_t(slot)].length = 0;
}

void KvCache::release(int64_t slot) {
  slot_at(slot);
  slots_[size_t(slot)] = Slot{};
}

int64_t KvCache::bytes_used() const {
  int64_t tokens = 0;
  for (const Slot& held : slots_) tokens += held.length;
  return tokens * bytes_per_token();
}

int64_t KvCache::bytes_reserved() const {
  int64_t tokens = 0;
  for (const Slot& held : slots_) tokens += held.capacity;
  return tokens * bytes_per_token();
}

namespace {

// Checks that the cache's heads and sizes match `s` and that sequence n maps to a distinct slot;
// returns the slot of each of the `sequences` sequences.
std::vector<int64_t> resolve_slots(const AttentionShape& s, const KvCache& cache,
                                   std::span<const int64_t> slots, int64_t sequences,
                                   const char* who) {
  require(cache.heads() == s.HKV && cache.key_dim() == s.D && cache.value_dim() == s.DV,
          std::string(who) + ": the cache holds HKV=" + std::to_string(cache.heads()) +
              " D=" + std::to_string(cache.key_dim()) + " DV=" + std::to_string(cache.value_dim()) +
              " but the inputs have HKV=" + std::to_string(s.HKV) + " D=" + std::to_string(s.D) +
              " DV=" + std::to_string(s.DV));
  require(slots.empty() || int64_t(slots.size()) == sequences,
          std::string(who) + ": " + std::to_string(slots.size()) + " slots given for " +
              std::to_string(sequences) + " sequences");
  std::vector<int64_t> resolved(static_cast<size_t>(sequences));
  std::vector<bool> taken(size_t(cache.num_slots()), false);
  for (int64_t n = 0; n < sequences; ++n) {
    const int64_t slot = slots.empty() ? n : slots[size_t(n)];
    require(slot >= 0 && slot < cache.num_slots(),
            std::string(who) + ": slot " + std::to_string(slot) + " is out of range [0, " +
                std::to_string(cache.num_slots()) + ")");
    require(!taken[size_t(slot)],
            std::string(who) + ": slot " + std::to_string(slot) + " is used twice");
    taken[size_t(slot)] = true;
    resolved[size_t(n)] = slot;
  }
  return resolved;
}

constexpr float kLog2e = 1.4426950408889634f;

// Softmax statistics of one sequence's H query rows over one piece [first, end) of its slot.
// All heads at once, so the piece's keys and values stream through memory contiguously.
struct DecodePiece {
  int64_t seq, first, end;
};

void decode_piece(const AttentionShape& s, const float* q, const float* keys, const float* values,
                  const DecodePiece& piece, float scale_log2, float* row_max_log2, float* row_sum,
                  float* acc) {
  const int64_t G = s.group_size(), H = s.H, D = s.D, DV = s.DV;
  const int count = int(piece.end - piece.first);
  std::vector<float> scores(size_t(H * count));
  for (int j = 0; j < count; ++j) {
    const float* token_keys = keys + (piece.first + j) * s.HKV * D;
    for (int64_t h = 0; h < H; ++h) {
      const float* query = q + h * D;
      const float* key = token_keys + (h / G) * D;
      float dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += query[d] * key[d];
      scores[size_t(h * count + j)] = dot * scale_log2;
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    float* row = scores.data() + h * count;
    float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
    for (int j = 0; j < count; ++j) m = row[j] > m ? row[j] : m;
    row_max_log2[h] = m;
    row_sum[h] = attention_detail::exp2_shifted_row(row, m, count, count, row);
  }
  std::fill(acc, acc + H * DV, 0.0f);
  for (int j = 0; j < count; ++j) {
    const float* token_values = values + (piece.first + j) * s.HKV * DV;
    for (int64_t h = 0; h < H; ++h) {
      const float p = scores[size_t(h * count + j)];
      const float* value = token_values + (h / G) * DV;
      float* acc_row = acc + h * DV;
#pragma omp simd
      for (int64_t e = 0; e < DV; ++e) acc_row[e] += p * value[e];
    }
  }
}

}  // namespace

void attention_prefill(const AttentionInputs<float>& in, KvCache& cache, float* o, float* lse,
                       std::span<const int64_t> slots, FlashBlocks blocks) {
  const AttentionShape& s = in.shape;
  s.validate();
  const SequenceLayout layout(s.B, s.T, in.cu_seqlens);
  require(in.q && in.k && in.v && o, "attention_prefill: q, k, v and o must not be null");
  require(blocks.query_rows >= 1 && blocks.key_block >= 1,
          "attention_prefill: tile sizes must be positive");
  const int64_t sequences = layout.num_sequences(), tokens = layout.total_tokens();
  const std::vector<int64_t> slot_of =
      resolve_slots(s, cache, slots, sequences, "attention_prefill");
  for (int64_t n = 0; n < sequences; ++n) cache.check_room(slot_of[n], layout.length(n));
  require_finite(in.q, tokens * s.H * s.D, "attention_prefill: q");
  require_finite(in.k, tokens * s.HKV * s.D, "attention_prefill: k");
  require_finite(in.v, tokens * s.HKV * s.DV, "attention_prefill: v");

  std::vector<int64_t> past(static_cast<size_t>(sequences));
  for (int64_t n = 0; n < sequences; ++n) {
    const int64_t start = layout.start(n);
    past[n] = cache.length(slot_of[n]);
    cache.append(slot_of[n], in.k + start * s.HKV * s.D, in.v + start * s.HKV * s.DV,
                 layout.length(n));
  }
  // Pointers into the cache are taken after every append (appending may move a slot).
  std::vector<attention_detail::SequenceSpan> seqs;
  for (int64_t n = 0; n < sequences; ++n) {
    const int64_t start = layout.start(n);
    seqs.push_back({in.q + start * s.H * s.D, cache.keys(slot_of[n]), cache.values(slot_of[n]),
                    o + start * s.H * s.DV, lse ? lse + start * s.H : nullptr, past[n],
                    layout.length(n)});
  }
  attention_detail::flash_forward_sequences(s, seqs, blocks);
}

void attention_decode_step(const AttentionShape& shape, KvCache& cache, const float* q,
                           const float* k, const float* v, float* o, std::span<const int64_t> slots,
                           int64_t keys_per_split) {
  AttentionShape s = shape;
  s.T = 1;
  s.validate();
  require(q && k && v && o, "attention_decode_step: q, k, v and o must not be null");
  require(keys_per_split >= 0, "attention_decode_step: keys_per_split must be >= 0");
  const int64_t N = s.B;
  const std::vector<int64_t> slot_of = resolve_slots(s, cache, slots, N, "attention_decode_step");
  for (int64_t n = 0; n < N; ++n) cache.check_room(slot_of[n], 1);
  require_finite(q, N * s.H * s.D, "attention_decode_step: q");
  require_finite(k, N * s.HKV * s.D, "attention_decode_step: k");
  require_finite(v, N * s.HKV * s.DV, "attention_decode_step: v");
  for (int64_t n = 0; n < N; ++n) {
    cache.append(slot_of[n], k + n * s.HKV * s.D, v + n * s.HKV * s.DV, 1);
  }

  // Pieces: enough to keep every thread busy, none shorter than kMinKeys unless the cache is,
  // none longer than kMaxKeys (so a piece's scores stay in cache).
  constexpr int64_t kMinKeys = 512, kMaxKeys = 4096;
  const int64_t wanted_pieces = std::max<int64_t>(1, (4 * hardware_threads() + N - 1) / N);
  std::vector<DecodePiece> pieces;
  std::vector<int64_t> first_piece(static_cast<size_t>(N + 1));
  double flops = 0;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t length = cache.length(slot_of[n]);
    flops += 2.0 * double(length) * double(s.H * (s.D + s.DV));
    int64_t per = keys_per_split;
    if (per == 0) {
      const int64_t count = std::clamp<int64_t>(length / kMinKeys, 1, wanted_pieces);
      per = std::min((length + count - 1) / count, kMaxKeys);
    }
    first_piece[size_t(n)] = int64_t(pieces.size());
    for (int64_t first = 0; first < length; first += per) {
      pieces.push_back({n, first, std::min(length, first + per)});
    }
  }
  first_piece.back() = int64_t(pieces.size());

  const int64_t H = s.H, DV = s.DV;
  const float scale_log2 = float(s.effective_scale()) * kLog2e;
  std::vector<float> piece_max(pieces.size() * H), piece_sum(pieces.size() * H),
      piece_acc(pieces.size() * H * DV);
  using attention_detail::for_each_item;
  for_each_item(int64_t(pieces.size()), flops, [&](int64_t i) {
    const DecodePiece& piece = pieces[size_t(i)];
    const int64_t slot = slot_of[piece.seq];
    decode_piece(s, q + piece.seq * H * s.D, cache.keys(slot), cache.values(slot), piece,
                 scale_log2, piece_max.data() + i * H, piece_sum.data() + i * H,
                 piece_acc.data() + i * H * DV);
  });

  // Merge the pieces of each (sequence, head): rescale to the common max, then normalise.
  for_each_item(N * H, flops, [&](int64_t row) {
    const int64_t n = row / H, h = row % H;
    const int64_t begin = first_piece[size_t(n)], end = first_piece[size_t(n + 1)];
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t i = begin; i < end; ++i) m = std::max(m, piece_max[i * H + h]);
    float* out = o + row * DV;
    std::fill(out, out + DV, 0.0f);
    float sum = 0;
    for (int64_t i = begin; i < end; ++i) {
      const float weight = std::exp2(piece_max[i * H + h] - m);
      sum += weight * piece_sum[i * H + h];
      const float* acc = piece_acc.data() + (i * H + h) * DV;
#pragma omp simd
      for (int64_t e = 0; e < DV; ++e) out[e] += weight * acc[e];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t e = 0; e < DV; ++e) out[e] *= inv;
  });
}

}  // namespace kda::ops
