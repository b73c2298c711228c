// Causal softmax attention with grouped-query heads: the lineage's baseline. Per query head h
// (reading key/value head h / (H / HKV)) and query position i of a sequence:
//
//   o_i = sum_{j <= i} softmax_j(scale * q_i . k_j) v_j,      lse_i = log sum_{j <= i} exp(...)
//
// Layouts follow fla (token-major): q [B, T, H, D]; k [B, T, HKV, D]; v [B, T, HKV, DV];
// o [B, T, H, DV]; lse [B, T, H] (natural log, fp32). With cu_seqlens, B = 1 and the sequences
// are packed along T; attention never crosses a sequence boundary.
//
// Three paths: a float64 reference (materialises the scores; ground truth), a tiled fp32
// flash-attention forward/backward that never builds the T x T matrix, and a KV cache for
// decode (prefill fills it, each decode step appends one token per sequence and attends over
// the whole cache).
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/parallel.h"

namespace kda::ops {

struct AttentionShape {
  int64_t B = 1, T = 1, H = 1, HKV = 1, D = 64, DV = 64;
  double scale = 0;  // 0 means D^-0.5

  double effective_scale() const;
  int64_t group_size() const { return H / HKV; }  // query heads per key/value head
  // Throws kda::Error on non-positive sizes, H not a multiple of HKV or a non-finite scale.
  void validate() const;
};

template <class F>
struct AttentionInputs {
  AttentionShape shape;
  const F* q = nullptr;  // [B, T, H, D]
  const F* k = nullptr;  // [B, T, HKV, D]
  const F* v = nullptr;  // [B, T, HKV, DV]
  std::span<const int64_t> cu_seqlens = {};
};

template <class F>
struct AttentionGrads {
  F* dq = nullptr;  // [B, T, H, D]
  F* dk = nullptr;  // [B, T, HKV, D]
  F* dv = nullptr;  // [B, T, HKV, DV]
};

// Tile sizes of the flash paths. A query tile packs the H / HKV query heads that share one
// key/value head, so its rows are (token, head in group): query_rows / (H / HKV) tokens, at
// least one. A key tile holds key_block tokens of one key/value head.
struct FlashBlocks {
  int query_rows = 128;
  int key_block = 256;

  int64_t query_tokens(int64_t group) const { return std::max<int64_t>(1, query_rows / group); }
};

// Ground truth in float64: each row's scores materialised, max-subtracted softmax.
// o [B, T, H, DV]; lse [B, T, H] may be null.
void attention_reference(const AttentionInputs<double>& in, double* o, double* lse = nullptr);

// Fast fp32 forward: online softmax over key tiles, BLAS tile products, parallel over
// (sequence, key/value head, query tile). lse may be null (inference); the backward needs it.
void attention_flash_forward(const AttentionInputs<float>& in, float* o, float* lse,
                             FlashBlocks blocks = {});

// Backward of the forward (flash-attention-2 recompute from o and lse): gradients of
// sum(o * d_o) for q, k and v. Two passes without write conflicts: dk, dv per (sequence,
// key/value head, key tile), then dq per (sequence, key/value head, query tile).
void attention_flash_backward(const AttentionInputs<float>& in, const float* o, const float* lse,
                              const float* d_o, const AttentionGrads<float>& grads,
                              FlashBlocks blocks = {.query_rows = 64, .key_block = 64});

// Floating-point operations of the causal forward: 2 (D + DV) H per (query, visible key) pair,
// i.e. about T^2 H (D + DV) for one sequence of T tokens (QK^T and PV, halved for causality).
double attention_forward_flops(const AttentionShape& shape,
                               std::span<const int64_t> cu_seqlens = {});

// Keys and values of past tokens for `num_slots` sequences, fp32, token-major per slot:
// keys [capacity, HKV, D], values [capacity, HKV, DV]. A slot grows (doubling) as tokens are
// appended; with max_tokens > 0 appending past max_tokens throws kda::Error instead.
class KvCache {
 public:
  KvCache(int64_t num_slots, int64_t HKV, int64_t D, int64_t DV, int64_t max_tokens = 0);

  int64_t num_slots() const { return int64_t(slots_.size()); }
  int64_t heads() const { return HKV_; }
  int64_t key_dim() const { return D_; }
  int64_t value_dim() const { return DV_; }
  int64_t max_tokens() const { return max_tokens_; }
  int64_t length(int64_t slot) const;    // tokens held
  int64_t capacity(int64_t slot) const;  // tokens allocated

  // Makes room for `tokens` tokens in total without changing the contents.
  void reserve(int64_t slot, int64_t tokens);
  // Appends `tokens` tokens: k [tokens, HKV, D], v [tokens, HKV, DV]. Throws (leaving the slot
  // unchanged) on non-finite values or when max_tokens would be passed.
  void append(int64_t slot, const float* k, const float* v, int64_t tokens);
  void clear(int64_t slot);    // forgets the tokens, keeps the memory
  void release(int64_t slot);  // forgets the tokens and frees the memory

  const float* keys(int64_t slot) const;    // [length, HKV, D]
  const float* values(int64_t slot) const;  // [length, HKV, DV]

  int64_t bytes_per_token() const { return (HKV_ * (D_ + DV_)) * int64_t(sizeof(float)); }
  int64_t bytes_used() const;      // tokens held x bytes_per_token
  int64_t bytes_reserved() const;  // tokens allocated x bytes_per_token (what the cache holds)

  // Throws kda::Error unless `slot` exists and can take `tokens` more tokens.
  void check_room(int64_t slot, int64_t tokens) const;

 private:
  struct Slot {
    std::unique_ptr<float[]> keys, values;
    int64_t length = 0, capacity = 0;
  };
  const Slot& slot_at(int64_t slot) const;
  int64_t HKV_, D_, DV_, max_tokens_;
  std::vector<Slot> slots_;
};

// Prefill through the cache: sequence n of `in` (B rows, or packed by cu_seqlens) is appended to
// cache slot slots[n] (slot n when slots is empty) and its queries attend causally over what
// the slot held before plus its own tokens. With empty slots this equals
// attention_flash_forward; on a filled slot it continues the sequence (chunked prefill).
// o [B, T, H, DV]; lse [B, T, H] may be null. Nothing is appended when an argument is bad.
void attention_prefill(const AttentionInputs<float>& in, KvCache& cache, float* o, float* lse,
                       std::span<const int64_t> slots = {}, FlashBlocks blocks = {});

// One decode step for N = shape.B sequences, one new token each: q [N, H, D], k [N, HKV, D],
// v [N, HKV, DV]. Appends k, v to slot slots[n] (slot n when slots is empty), then writes
// o [N, H, DV] attending over the whole slot. shape.T is ignored. Long caches are split into
// pieces of keys_per_split keys (0 picks a size) that run in parallel and are merged.
void attention_decode_step(const AttentionShape& shape, KvCache& cache, const float* q,
                           const float* k, const float* v, float* o,
                           std::span<const int64_t> slots = {}, int64_t keys_per_split = 0);

// Shared by the cpu/ files; not an API for callers.
namespace attention_detail {

// One sequence's new queries against its key/value history: query t sits at position past + t
// and sees keys [0, past + t]. q, o and lse point at the sequence's first new token; k and v at
// its first key (past + tokens keys in all, token-major with HKV heads).
struct SequenceSpan {
  const float* q;
  const float* k;
  const float* v;
  float* o;
  float* lse;  // may be null
  int64_t past, tokens;
};

// The flash forward over many sequences (parallel over sequence, kv head, query tile).
void flash_forward_sequences(const AttentionShape& shape, std::span<const SequenceSpan> seqs,
                             FlashBlocks blocks);

// parallel_for, or a plain loop when the whole job (`flops`) is too small to pay for waking the
// threads (tiny shapes, finite differences, short decode caches, busy machines).
template <class Body>
void for_each_item(int64_t items, double flops, Body&& body) {
  constexpr double kSerialBelowFlops = 2e6;
  if (items <= 1 || flops < kSerialBelowFlops) {
    for (int64_t i = 0; i < items; ++i) body(i);
  } else {
    parallel_for(items, body);
  }
}

// y[j] = 2^(x[j] - shift) for j < count (x[j] <= shift), 0 for count <= j < width. Returns the
// sum of y. Vectorised polynomial exp2, relative error ~2e-7.
float exp2_shifted_row(const float* x, float shift, int count, int width, float* y);

}  // namespace attention_detail

}  // namespace kda::ops
