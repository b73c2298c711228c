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

float dot(const float* a, const float* b, int64_t n) {
  float sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// y[n] += a * x[n]
void axpy(float a, const float* x, int64_t n, float* y) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// One query token (decode), with plain loops on this thread: each cached row and each kv_b
// row is read once, and no BLAS call opens a parallel region (a decode step is too small to
// share, and on a loaded machine waiting for a thread team costs more than the work).
void decode_one(const MlaShape& s, const float* q, const LatentPages& cache, const float* kv_b,
                float* o, float* q_latent, float* scores, float* o_latent) {
  const int64_t L = s.latent, W = s.row_width(), D = s.qk_dim(), kv_w = s.nope + s.v;
  const int64_t length = cache.length, pt = cache.page_tokens;
  // q_latent_h = [W_UK_h^T q_nope_h ; q_rope_h]
  for (int64_t h = 0; h < s.H; ++h) {
    float* ql = q_latent + h * W;
    std::fill_n(ql, L, 0.0f);
    const float* qh = q + h * D;
    for (int64_t n = 0; n < s.nope; ++n) axpy(qh[n], kv_b + (h * kv_w + n) * L, L, ql);
    std::copy_n(qh + s.nope, s.rope, ql + L);
  }
  // scores [H, length]: every head against each cached row while the row is in cache
  const float scale = float(s.effective_scale());
  for (int64_t j = 0; j < length; ++j) {
    const float* row = cache.pages[j / pt] + (j % pt) * W;
    for (int64_t h = 0; h < s.H; ++h)
      scores[h * length + j] = scale * dot(q_latent + h * W, row, W);
  }
  for (int64_t h = 0; h < s.H; ++h) {
    float* row = scores + h * length;
    float mx = row[0];
    for (int64_t j = 1; j < length; ++j) mx = std::max(mx, row[j]);
    require(std::isfinite(mx), "mla_absorbed_forward: non-finite attention score");
    double sum = 0;
    for (int64_t j = 0; j < length; ++j) sum += (row[j] = std::exp(row[j] - mx));
    const float inv = float(1.0 / sum);
    for (int64_t j = 0; j < length; ++j) row[j] *= inv;
  }
  // o_latent_h = sum_j p_hj c_j, then o_h = W_UV_h o_latent_h
  std::fill_n(o_latent, s.H * L, 0.0f);
  for (int64_t j = 0; j < length; ++j) {
    const float* row = cache.pages[j / pt] + (j % pt) * W;
    for (int64_t h = 0; h < s.H; ++h) axpy(scores[h * length + j], row, L, o_latent + h * L);
  }
  for (int64_t h = 0; h < s.H; ++h) {
    const float* w_uv = kv_b + (h * kv_w + s.nope) * L;
    for (int64_t i = 0; i < s.v; ++i) o[h * s.v + i] = dot(w_uv + i * L, o_latent + h * L, L);
  }
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
  if (T == 1) return decode_one(s, q, cache, kv_b, o, q_latent, scores, o_latent);

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
