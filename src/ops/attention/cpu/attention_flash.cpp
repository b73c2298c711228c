// Flash-attention forward in fp32: for each tile of queries (about query_rows rows: tokens x the
// query heads of one key/value head), walk the key tiles up to the diagonal keeping a running row
// max m and row sum l (online softmax), so the T x T score matrix never exists. Scores live in log2
// units (scale * log2(e) folded into the QK^T product) so every exponential is an exp2.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "core/blas.h"
#include "core/error.h"
#include "ops/attention/attention.h"
#include "ops/common/sequences.h"

namespace kda::ops {
namespace attention_detail {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// 2^x for x in [-126, 126] (clamped): 2^round(x) from the exponent bits times a degree-7
// Taylor polynomial of 2^f on [-1/2, 1/2]. Branch-free so that loops over it vectorise; the
// rounding uses the 1.5 * 2^23 trick because std::floor blocks GCC 12's `omp simd` loops.
inline float exp2_clamped(float x) {
  x = std::min(std::max(x, -126.0f), 126.0f);
  constexpr float kRound = 12582912.0f;  // adding it rounds to the nearest integer
  const float n = (x + kRound) - kRound;
  const float f = x - n;
  float p = 1.5252733804059840e-05f;
  p = p * f + 1.5403530393381608e-04f;
  p = p * f + 1.3333558146428443e-03f;
  p = p * f + 9.6181291076284772e-03f;
  p = p * f + 5.5504108664821580e-02f;
  p = p * f + 2.4022650695910071e-01f;
  p = p * f + 6.9314718055994531e-01f;
  p = p * f + 1.0f;
  return p * std::bit_cast<float>((int32_t(n) + 127) << 23);
}

float row_max(const float* x, int count) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int j = 0; j < count; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

struct QueryTile {
  int64_t seq, kv_head, first, end;  // new-token range [first, end) of sequence seq
  int64_t cost;                      // keys visited by the last row, for scheduling
};

// One query tile through all its key tiles.
void forward_tile(const AttentionShape& s, const SequenceSpan& seq, const QueryTile& tile,
                  const FlashBlocks& blocks, float scale_log2) {
  const int64_t G = s.group_size(), D = s.D, DV = s.DV;
  const int64_t hk = tile.kv_head;
  const int rows = int((tile.end - tile.first) * G);
  const int key_block = blocks.key_block;
  std::vector<float> q_tile(size_t(rows * D)), scores(size_t(rows) * key_block);
  std::vector<float> acc(size_t(rows * DV), 0.0f), row_sum(static_cast<size_t>(rows), 0.0f);
  std::vector<float> row_max_log2(static_cast<size_t>(rows),
                                  -std::numeric_limits<float>::infinity());
  // Row r = (token first + r / G, head hk * G + r % G): the G heads of a token are adjacent.
  for (int64_t t = tile.first; t < tile.end; ++t) {
    std::memcpy(q_tile.data() + (t - tile.first) * G * D, seq.q + (t * s.H + hk * G) * D,
                size_t(G * D) * sizeof(float));
  }
  const int64_t first_pos = seq.past + tile.first, last_pos = seq.past + tile.end - 1;
  const float* k_head = seq.k + hk * D;
  const float* v_head = seq.v + hk * DV;
  for (int64_t k0 = 0; k0 <= last_pos; k0 += key_block) {
    const int keys = int(std::min<int64_t>(key_block, last_pos + 1 - k0));
    gemm_nt(rows, keys, int(D), scale_log2, q_tile.data(), int(D), k_head + k0 * s.HKV * D,
            int(s.HKV * D), 0.0f, scores.data(), key_block);
    const bool below_diagonal = k0 + keys - 1 <= first_pos;  // every row sees every key
    for (int r = 0; r < rows; ++r) {
      float* row = scores.data() + size_t(r) * key_block;
      const int64_t pos = first_pos + r / G;
      const int visible = below_diagonal ? keys : int(std::clamp<int64_t>(pos - k0 + 1, 0, keys));
      if (visible == 0) {
        std::fill(row, row + keys, 0.0f);
        continue;
      }
      const float old_max = row_max_log2[r];
      const float new_max = std::max(old_max, row_max(row, visible));
      const float sum = exp2_shifted_row(row, new_max, visible, keys, row);
      if (new_max > old_max) {
        const float alpha = old_max == -std::numeric_limits<float>::infinity()
                                ? 0.0f
                                : std::exp2(old_max - new_max);
        float* acc_row = acc.data() + size_t(r) * DV;
#pragma omp simd
        for (int64_t e = 0; e < DV; ++e) acc_row[e] *= alpha;
        row_sum[r] = row_sum[r] * alpha + sum;
        row_max_log2[r] = new_max;
      } else {
        row_sum[r] += sum;
      }
    }
    gemm_nn(rows, int(DV), keys, 1.0f, scores.data(), key_block, v_head + k0 * s.HKV * DV,
            int(s.HKV * DV), 1.0f, acc.data(), int(DV));
  }
  for (int r = 0; r < rows; ++r) {
    const int64_t t = tile.first + r / G, h = hk * G + r % G;
    const float inv = 1.0f / row_sum[r];
    const float* acc_row = acc.data() + size_t(r) * DV;
    float* out = seq.o + (t * s.H + h) * DV;
#pragma omp simd
    for (int64_t e = 0; e < DV; ++e) out[e] = acc_row[e] * inv;
    if (seq.lse) seq.lse[t * s.H + h] = (row_max_log2[r] + std::log2(row_sum[r])) * kLn2;
  }
}

}  // namespace

float exp2_shifted_row(const float* x, float shift, int count, int width, float* y) {
  float sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int j = 0; j < count; ++j) {
    const float e = exp2_clamped(x[j] - shift);
    y[j] = e;
    sum += e;
  }
  for (int j = count; j < width; ++j) y[j] = 0.0f;
  return sum;
}

void flash_forward_sequences(const AttentionShape& s, std::span<const SequenceSpan> seqs,
                             FlashBlocks blocks) {
  require(blocks.query_rows >= 1 && blocks.key_block >= 1,
          "attention: flash tile sizes must be positive");
  const int64_t query_tokens = blocks.query_tokens(s.group_size());
  std::vector<QueryTile> tiles;
  double flops = 0;
  for (int64_t n = 0; n < int64_t(seqs.size()); ++n) {
    const double past = double(seqs[n].past), tokens = double(seqs[n].tokens);
    flops += 2.0 * (past + tokens / 2) * tokens * double(s.H * (s.D + s.DV));
    for (int64_t first = 0; first < seqs[n].tokens; first += query_tokens) {
      const int64_t end = std::min(seqs[n].tokens, first + query_tokens);
      for (int64_t hk = 0; hk < s.HKV; ++hk) {
        tiles.push_back({n, hk, first, end, seqs[n].past + end});
      }
    }
  }
  // Longest tiles first so the dynamic schedule ends evenly.
  std::stable_sort(tiles.begin(), tiles.end(),
                   [](const QueryTile& a, const QueryTile& b) { return a.cost > b.cost; });
  const float scale_log2 = float(s.effective_scale()) * kLog2e;
  for_each_item(int64_t(tiles.size()), flops, [&](int64_t i) {
    forward_tile(s, seqs[tiles[i].seq], tiles[i], blocks, scale_log2);
  });
}

}  // namespace attention_detail

void attention_flash_forward(const AttentionInputs<float>& in, float* o, float* lse,
                             FlashBlocks blocks) {
  const AttentionShape& s = in.shape;
  s.validate();
  const SequenceLayout layout(s.B, s.T, in.cu_seqlens);
  require(in.q && in.k && in.v && o, "attention_flash_forward: q, k, v and o must not be null");
  const int64_t tokens = layout.total_tokens();
  require_finite(in.q, tokens * s.H * s.D, "attention_flash_forward: q");
  require_finite(in.k, tokens * s.HKV * s.D, "attention_flash_forward: k");
  require_finite(in.v, tokens * s.HKV * s.DV, "attention_flash_forward: v");

  std::vector<attention_detail::SequenceSpan> seqs;
  for (int64_t n = 0; n < layout.num_sequences(); ++n) {
    const int64_t start = layout.start(n);
    seqs.push_back({in.q + start * s.H * s.D, in.k + start * s.HKV * s.D,
                    in.v + start * s.HKV * s.DV, o + start * s.H * s.DV,
                    lse ? lse + start * s.H : nullptr, 0, layout.length(n)});
  }
  attention_detail::flash_forward_sequences(s, seqs, blocks);
}

}  // namespace kda::ops
