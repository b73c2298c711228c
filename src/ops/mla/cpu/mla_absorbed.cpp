// MLA in absorbed form over a paged latent cache: q_latent_h = [W_UK_h^T q_nope_h ; q_rope_h]
// scores every cached row [c ; k_rope] (one shared key head of width latent + rope), the
// softmax-weighted latent rows sum to o_latent_h, and o_h = W_UV_h o_latent_h. The per-head
// weights are read in place from kv_b; nothing per key is expanded.
#include <algorithm>
#include <cmath>

#include "core/blas.h"
#include "core/error.h"
#include "ops/mla/mla.h"

namespace kda::ops {
namespace {

template <class V>
float* grow(V& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

}  // namespace

void mla_absorbed_forward(const MlaShape& s, const float* q, int64_t T, const LatentPages& cache,
                          const float* kv_b, float* o, MlaWorkspace& ws) {
  s.validate();
  const int64_t length = cache.length, pt = cache.page_tokens;
  require(T >= 1 && T <= length, "mla_absorbed_forward: the cache must hold the T new tokens");
  require(pt >= 1 && int64_t(cache.pages.size()) * pt >= length,
          "mla_absorbed_forward: the pages do not hold `length` rows");
  require(q && kv_b && o, "mla_absorbed_forward: null pointer");
  const int64_t L = s.latent, W = s.row_width(), D = s.qk_dim(), kv_w = s.nope + s.v;
  const int64_t rows = T * s.H, past = length - T;
  const int64_t num_pages = (length + pt - 1) / pt;
  float* q_latent = grow(ws.q_latent, size_t(rows * W));
  float* scores = grow(ws.scores, size_t(rows * length));
  float* o_latent = grow(ws.o_latent, size_t(rows * L));

  // q_latent [T, H, W]: the nope part through W_UK_h ([nope, L] rows of kv_b), rope part as is.
  for (int64_t h = 0; h < s.H; ++h) {
    gemm_nn(int(T), int(L), int(s.nope), 1.0f, q + h * D, int(s.H * D), kv_b + h * kv_w * L, int(L),
            0.0f, q_latent + h * W, int(s.H * W));
    for (int64_t t = 0; t < T; ++t) {
      std::copy_n(q + (t * s.H + h) * D + s.nope, s.rope, q_latent + (t * s.H + h) * W + L);
    }
  }
  // scores [T H, length] = scale q_latent rows . cached rows
  const float scale = float(s.effective_scale());
  for (int64_t p = 0; p < num_pages; ++p) {
    const int64_t n = std::min(pt, length - p * pt);
    gemm_nt(int(rows), int(n), int(W), scale, q_latent, int(W), cache.pages[p], int(W), 0.0f,
            scores + p * pt, int(length));
  }
  // Causal softmax per (token, head) row; keys past a query's position get weight 0.
  for (int64_t t = 0; t < T; ++t) {
    const int64_t visible = past + t + 1;
    for (int64_t h = 0; h < s.H; ++h) {
      float* row = scores + (t * s.H + h) * length;
      float mx = row[0];
      for (int64_t j = 1; j < visible; ++j) mx = std::max(mx, row[j]);
      require(std::isfinite(mx), "mla_absorbed_forward: non-finite attention score");
      double sum = 0;
      for (int64_t j = 0; j < visible; ++j) sum += (row[j] = std::exp(row[j] - mx));
      const float inv = float(1.0 / sum);
      for (int64_t j = 0; j < visible; ++j) row[j] *= inv;
      std::fill(row + visible, row + length, 0.0f);
    }
  }
  // o_latent [T H, L] = probabilities x cached latents c (the first L columns of each row)
  for (int64_t p = 0; p < num_pages; ++p) {
    const int64_t n = std::min(pt, length - p * pt);
    gemm_nn(int(rows), int(L), int(n), 1.0f, scores + p * pt, int(length), cache.pages[p], int(W),
            p == 0 ? 0.0f : 1.0f, o_latent, int(L));
  }
  // o_h [T, v] = o_latent_h W_UV_h^T  (W_UV_h: [v, L] rows of kv_b)
  for (int64_t h = 0; h < s.H; ++h) {
    gemm_nt(int(T), int(s.v), int(L), 1.0f, o_latent + h * L, int(s.H * L),
            kv_b + (h * kv_w + s.nope) * L, int(L), 0.0f, o + h * s.v, int(s.H * s.v));
  }
}

}  // namespace kda::ops
