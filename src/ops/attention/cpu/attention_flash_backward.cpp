// Flash-attention-2 backward in fp32: probabilities are recomputed tile by tile from the
// forward's log-sum-exp, P = exp(S - lse), and with delta_i = rowsum(dO_i * O_i):
//
//   dV = P^T dO,   dP = dO V^T,   dS = P * (dP - delta),   dQ = scale dS K,   dK = scale dS^T Q
//
// Two passes so that no two threads ever add into the same gradient row (deterministic, no
// atomics): dK and dV per (sequence, kv head, key tile), which owns its rows and sums over the
// group's query heads inside; then dQ per (sequence, kv head, query tile). The price is
// recomputing S and dP once more (7 tile products instead of 5).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/blas.h"
#include "core/error.h"
#include "ops/attention/attention.h"
#include "ops/common/sequences.h"

namespace kda::ops {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

struct Tile {
  int64_t seq, kv_head, first, end;  // token range [first, end) within the sequence
  int64_t cost;
};

// Everything the backward reads, laid out per sequence.
struct BackwardProblem {
  const AttentionShape& s;
  const SequenceLayout& layout;
  const AttentionInputs<float>& in;
  const float* d_o;
  const float* lse;
  const float* delta;  // [tokens, H]: rowsum(dO * O)
  float scale, scale_log2;
  FlashBlocks blocks;
};

// The query rows of tokens [first, end) of one sequence for kv head hk, packed as rows
// (token, head in group): Q [rows, D], dO [rows, DV], lse in log2 units, delta.
struct PackedQueries {
  std::vector<float> q, d_o, lse_log2, delta;

  void pack(const BackwardProblem& p, int64_t start, int64_t hk, int64_t first, int64_t end) {
    const AttentionShape& s = p.s;
    const int64_t G = s.group_size(), rows = (end - first) * G;
    q.resize(size_t(rows * s.D));
    d_o.resize(size_t(rows * s.DV));
    lse_log2.resize(size_t(rows));
    delta.resize(size_t(rows));
    for (int64_t t = first; t < end; ++t) {
      const int64_t token = start + t, r0 = (t - first) * G, h0 = hk * G;
      std::memcpy(q.data() + r0 * s.D, p.in.q + (token * s.H + h0) * s.D,
                  size_t(G * s.D) * sizeof(float));
      std::memcpy(d_o.data() + r0 * s.DV, p.d_o + (token * s.H + h0) * s.DV,
                  size_t(G * s.DV) * sizeof(float));
      for (int64_t g = 0; g < G; ++g) {
        lse_log2[r0 + g] = p.lse[token * s.H + h0 + g] * kLog2e;
        delta[r0 + g] = p.delta[token * s.H + h0 + g];
      }
    }
  }
};

// For packed query rows at positions first.. and keys [k0, k0 + keys): P into `probs` and
// dS into `dscores` (both [rows, ld]).
void probabilities_and_dscores(const BackwardProblem& p, const PackedQueries& pq, int64_t start,
                               int64_t hk, int64_t first, int rows, int64_t k0, int keys,
                               float* probs, float* dscores, int ld) {
  const AttentionShape& s = p.s;
  const int64_t G = s.group_size();
  const float* k_rows = p.in.k + ((start + k0) * s.HKV + hk) * s.D;
  const float* v_rows = p.in.v + ((start + k0) * s.HKV + hk) * s.DV;
  gemm_nt(rows, keys, int(s.D), p.scale_log2, pq.q.data(), int(s.D), k_rows, int(s.HKV * s.D), 0.0f,
          probs, ld);
  gemm_nt(rows, keys, int(s.DV), 1.0f, pq.d_o.data(), int(s.DV), v_rows, int(s.HKV * s.DV), 0.0f,
          dscores, ld);
  for (int r = 0; r < rows; ++r) {
    const int64_t pos = first + r / G;
    const int visible = int(std::clamp<int64_t>(pos - k0 + 1, 0, keys));
    float* prob = probs + size_t(r) * ld;
    float* ds = dscores + size_t(r) * ld;
    attention_detail::exp2_shifted_row(prob, pq.lse_log2[r], visible, keys, prob);
    const float delta = pq.delta[r];
#pragma omp simd
    for (int j = 0; j < keys; ++j) ds[j] = prob[j] * (ds[j] - delta);
  }
}

// dK, dV of keys [tile.first, tile.end): every query tile at or after the key tile.
void key_tile_backward(const BackwardProblem& p, const Tile& tile, const AttentionGrads<float>& g) {
  const AttentionShape& s = p.s;
  const int64_t G = s.group_size(), hk = tile.kv_head;
  const int64_t start = p.layout.start(tile.seq), length = p.layout.length(tile.seq);
  const int keys = int(tile.end - tile.first), ld = keys;
  const int64_t query_block = p.blocks.query_tokens(G);
  std::vector<float> dk(size_t(keys * s.D), 0.0f), dv(size_t(keys * s.DV), 0.0f);
  std::vector<float> probs(size_t(query_block * G * keys)), dscores(probs.size());
  PackedQueries pq;
  for (int64_t first = tile.first; first < length; first += query_block) {
    const int64_t end = std::min(length, first + query_block);
    const int rows = int((end - first) * G);
    pq.pack(p, start, hk, first, end);
    probabilities_and_dscores(p, pq, start, hk, first, rows, tile.first, keys, probs.data(),
                              dscores.data(), ld);
    gemm_tn(keys, int(s.DV), rows, 1.0f, probs.data(), ld, pq.d_o.data(), int(s.DV), 1.0f,
            dv.data(), int(s.DV));
    gemm_tn(keys, int(s.D), rows, p.scale, dscores.data(), ld, pq.q.data(), int(s.D), 1.0f,
            dk.data(), int(s.D));
  }
  for (int j = 0; j < keys; ++j) {
    const int64_t token = start + tile.first + j;
    std::memcpy(g.dk + (token * s.HKV + hk) * s.D, dk.data() + j * s.D,
                size_t(s.D) * sizeof(float));
    std::memcpy(g.dv + (token * s.HKV + hk) * s.DV, dv.data() + j * s.DV,
                size_t(s.DV) * sizeof(float));
  }
}

// dQ of queries [tile.first, tile.end) (all heads of the group): every key up to the diagonal.
void query_tile_backward(const BackwardProblem& p, const Tile& tile, float* dq_out) {
  const AttentionShape& s = p.s;
  const int64_t G = s.group_size(), hk = tile.kv_head;
  const int64_t start = p.layout.start(tile.seq);
  const int rows = int((tile.end - tile.first) * G), ld = p.blocks.key_block;
  std::vector<float> dq(size_t(rows * s.D), 0.0f);
  std::vector<float> probs(size_t(rows) * ld), dscores(probs.size());
  PackedQueries pq;
  pq.pack(p, start, hk, tile.first, tile.end);
  for (int64_t k0 = 0; k0 < tile.end; k0 += ld) {
    const int keys = int(std::min<int64_t>(ld, tile.end - k0));
    probabilities_and_dscores(p, pq, start, hk, tile.first, rows, k0, keys, probs.data(),
                              dscores.data(), ld);
    gemm_nn(rows, int(s.D), keys, p.scale, dscores.data(), ld,
            p.in.k + ((start + k0) * s.HKV + hk) * s.D, int(s.HKV * s.D), 1.0f, dq.data(),
            int(s.D));
  }
  for (int64_t t = tile.first; t < tile.end; ++t) {
    std::memcpy(dq_out + ((start + t) * s.H + hk * G) * s.D, dq.data() + (t - tile.first) * G * s.D,
                size_t(G * s.D) * sizeof(float));
  }
}

std::vector<Tile> make_tiles(const SequenceLayout& layout, int64_t HKV, int64_t block,
                             bool cost_from_end) {
  std::vector<Tile> tiles;
  for (int64_t n = 0; n < layout.num_sequences(); ++n) {
    const int64_t length = layout.length(n);
    for (int64_t first = 0; first < length; first += block) {
      const int64_t end = std::min(length, first + block);
      const int64_t cost = cost_from_end ? end : length - first;
      for (int64_t hk = 0; hk < HKV; ++hk) tiles.push_back({n, hk, first, end, cost});
    }
  }
  std::stable_sort(tiles.begin(), tiles.end(),
                   [](const Tile& a, const Tile& b) { return a.cost > b.cost; });
  return tiles;
}

}  // namespace

void attention_flash_backward(const AttentionInputs<float>& in, const float* o, const float* lse,
                              const float* d_o, const AttentionGrads<float>& grads,
                              FlashBlocks blocks) {
  const AttentionShape& s = in.shape;
  s.validate();
  const SequenceLayout layout(s.B, s.T, in.cu_seqlens);
  require(in.q && in.k && in.v && o && lse && d_o,
          "attention_flash_backward: q, k, v, o, lse and d_o must not be null");
  require(grads.dq && grads.dk && grads.dv,
          "attention_flash_backward: dq, dk and dv must not be null");
  require(blocks.query_rows >= 1 && blocks.key_block >= 1,
          "attention_flash_backward: tile sizes must be positive");
  const int64_t tokens = layout.total_tokens();
  require_finite(in.q, tokens * s.H * s.D, "attention_flash_backward: q");
  require_finite(in.k, tokens * s.HKV * s.D, "attention_flash_backward: k");
  require_finite(in.v, tokens * s.HKV * s.DV, "attention_flash_backward: v");
  require_finite(o, tokens * s.H * s.DV, "attention_flash_backward: o");
  require_finite(lse, tokens * s.H, "attention_flash_backward: lse");
  require_finite(d_o, tokens * s.H * s.DV, "attention_flash_backward: d_o");

  std::vector<float> delta(size_t(tokens * s.H));
  constexpr int64_t kTokensPerItem = 256;
  // The backward does about 3.5 times the forward's products (S and dP twice, dV, dK, dQ).
  const double flops = 3.5 * attention_forward_flops(s, in.cu_seqlens);
  using attention_detail::for_each_item;
  for_each_item((tokens + kTokensPerItem - 1) / kTokensPerItem, flops, [&](int64_t item) {
    const int64_t end = std::min(tokens, (item + 1) * kTokensPerItem);
    for (int64_t row = item * kTokensPerItem * s.H; row < end * s.H; ++row) {
      const float* a = o + row * s.DV;
      const float* b = d_o + row * s.DV;
      float dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int64_t e = 0; e < s.DV; ++e) dot += a[e] * b[e];
      delta[row] = dot;
    }
  });

  const float scale = float(s.effective_scale());
  const BackwardProblem problem{s,     layout,         in,    d_o, lse, delta.data(),
                                scale, scale * kLog2e, blocks};
  const std::vector<Tile> key_tiles = make_tiles(layout, s.HKV, blocks.key_block, false);
  for_each_item(int64_t(key_tiles.size()), flops,
                [&](int64_t i) { key_tile_backward(problem, key_tiles[i], grads); });
  const std::vector<Tile> query_tiles =
      make_tiles(layout, s.HKV, blocks.query_tokens(s.group_size()), true);
  for_each_item(int64_t(query_tiles.size()), flops,
                [&](int64_t i) { query_tile_backward(problem, query_tiles[i], grads.dq); });
}

}  // namespace kda::ops
