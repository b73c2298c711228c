// The NoPE MLA token mixer of a Kimi Linear layer (transformers' KimiLinearAttention):
//   q = q_proj x  (or q_b(RMSNorm(q_a x)) with q_lora_rank)      [T, H, nope + rope]
//   [c ; k_rope] = kv_a_proj_with_mqa x;  c = kv_a_layernorm(c)   one latent row per token
//   o = MLA(q, rows; kv_b)  (no rotary embedding anywhere), y = o_proj o
// Only the latent rows are cached; see ops/mla/mla.h for the expanded and absorbed forms.
#include <algorithm>

#include "core/error.h"
#include "model/kimi_linear_blocks.h"
#include "ops/nn/nn.h"

namespace kda::model::kimi {

ops::MlaShape mla_shape(const KimiLinearConfig& c) {
  ops::MlaShape s;
  s.H = c.mla_heads;
  s.nope = c.qk_nope_head_dim;
  s.rope = c.qk_rope_head_dim;
  s.v = c.v_head_dim;
  s.latent = c.kv_lora_rank;
  return s;
}

void expect_mla(const KimiLinearConfig& c, const std::string& p, TensorMap& e) {
  const int64_t D = c.hidden_size, H = c.mla_heads;
  if (c.q_lora_rank > 0) {
    e[p + "q_a_proj.weight"] = {c.q_lora_rank, D};
    e[p + "q_a_layernorm.weight"] = {c.q_lora_rank};
    e[p + "q_b_proj.weight"] = {H * c.mla_qk_dim(), c.q_lora_rank};
  } else {
    e[p + "q_proj.weight"] = {H * c.mla_qk_dim(), D};
  }
  e[p + "kv_a_proj_with_mqa.weight"] = {c.mla_row_width(), D};
  e[p + "kv_a_layernorm.weight"] = {c.kv_lora_rank};
  e[p + "kv_b_proj.weight"] = {H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank};
  e[p + "o_proj.weight"] = {D, H * c.v_head_dim};
}

MlaWeights load_mla(const KimiLinearConfig& c, const std::string& p, const ModelFolder& folder) {
  TensorMap e;
  expect_mla(c, p, e);
  auto load = [&](const std::string& name) { return folder.load(p + name, e.at(p + name)); };
  MlaWeights w;
  if (c.q_lora_rank > 0) {
    w.q_a_proj = load("q_a_proj.weight");
    w.q_a_layernorm = load("q_a_layernorm.weight");
    w.q_proj = load("q_b_proj.weight");
  } else {
    w.q_proj = load("q_proj.weight");
  }
  w.kv_a = load("kv_a_proj_with_mqa.weight");
  w.kv_a_layernorm = load("kv_a_layernorm.weight");
  w.kv_b = load("kv_b_proj.weight");
  w.o_proj = load("o_proj.weight");
  return w;
}

namespace {

// The queries [T, H (nope + rope)] (s.q) and the latent rows [T, latent + rope] (s.k) of T
// tokens; every row independent of the others.
void mla_project(const KimiLinearConfig& c, const MlaWeights& w, const float* x, int64_t T,
                 Scratch& s) {
  const int64_t D = c.hidden_size, L = c.kv_lora_rank;
  const int64_t row = c.mla_row_width(), q_width = c.mla_heads * c.mla_qk_dim();
  float* q = grow(s.q, T * q_width);
  if (c.q_lora_rank > 0) {
    float* qa = grow(s.proj, T * c.q_lora_rank);
    ops::linear(x, T, D, w.q_a_proj.f32(), c.q_lora_rank, nullptr, qa);
    ops::rms_norm(qa, T, c.q_lora_rank, w.q_a_layernorm.f32(), kKimiLatentNormEps, qa);
    ops::linear(qa, T, c.q_lora_rank, w.q_proj.f32(), q_width, nullptr, q);
  } else {
    ops::linear(x, T, D, w.q_proj.f32(), q_width, nullptr, q);
  }
  // Latent rows [c_norm ; k_rope]: normalise the first L values of each row in place.
  float* rows = grow(s.k, T * row);
  ops::linear(x, T, D, w.kv_a.f32(), row, nullptr, rows);
  for (int64_t t = 0; t < T; ++t) {
    ops::rms_norm(rows + t * row, 1, L, w.kv_a_layernorm.f32(), kKimiLatentNormEps, rows + t * row);
  }
}

}  // namespace

void mla_decode_batch(const KimiLinearConfig& c, const MlaWeights& w, const float* x, int64_t N,
                      std::span<runtime::LatentCache* const> caches, float* y, Scratch& s) {
  require(N >= 1 && int64_t(caches.size()) == N, "mla_decode_batch: one cache per row");
  for (const runtime::LatentCache* cache : caches) cache->check_room(1);
  const ops::MlaShape shape = mla_shape(c);
  const int64_t H = c.mla_heads, row = c.mla_row_width(), q_width = H * c.mla_qk_dim();
  const int64_t o_width = H * c.v_head_dim;
  mla_project(c, w, x, N, s);
  float* o = grow(s.attn, N * o_width);
  for (int64_t n = 0; n < N; ++n) {
    runtime::LatentCache& cache = *caches[n];
    cache.append(s.k.data() + n * row, 1);
    const ops::LatentPages pages{cache.pages(), cache.page_tokens(), cache.length()};
    ops::mla_absorbed_forward(shape, s.q.data() + n * q_width, 1, pages, w.kv_b.f32(),
                              o + n * o_width, s.mla);
  }
  ops::linear(o, N, o_width, w.o_proj.f32(), c.hidden_size, nullptr, y);
}

void mla_forward(const KimiLinearConfig& c, const MlaWeights& w, const float* x, int64_t T,
                 runtime::LatentCache& cache, float* y, Scratch& s) {
  if (T == 1) {
    runtime::LatentCache* one[1] = {&cache};
    return mla_decode_batch(c, w, x, 1, one, y, s);
  }
  const ops::MlaShape shape = mla_shape(c);
  const int64_t D = c.hidden_size, H = c.mla_heads;
  const int64_t row = c.mla_row_width();
  cache.check_room(T);
  mla_project(c, w, x, T, s);
  const float* q = s.q.data();
  const float* rows = s.k.data();
  const int64_t past = cache.length();
  cache.append(rows, T);

  float* o = grow(s.attn, T * H * c.v_head_dim);
  if (T >= kMlaExpandFromTokens) {
    const float* all_rows = rows;
    if (past > 0) {  // earlier tokens live in the pages: lay the whole history out contiguously
      float* gathered = grow(s.rows, cache.length() * row);
      cache.gather(gathered);
      all_rows = gathered;
    }
    ops::mla_expanded_forward(shape, q, T, all_rows, past, w.kv_b.f32(), o, s.mla);
  } else {
    const ops::LatentPages pages{cache.pages(), cache.page_tokens(), cache.length()};
    ops::mla_absorbed_forward(shape, q, T, pages, w.kv_b.f32(), o, s.mla);
  }
  ops::linear(o, T, H * c.v_head_dim, w.o_proj.f32(), D, nullptr, y);
}

}  // namespace kda::model::kimi
