// Multi-head Latent Attention (DeepSeek-V2 style) without rotary embedding (Kimi Linear's NoPE
// MLA): the attention core after the projections. Per token the layer keeps one latent row
// [c ; k_rope] of width latent + rope (c = kv_a_layernorm(compressed kv), k_rope the shared
// "rope" key part, never rotated). kv_b [H (nope + v), latent] (kv_b_proj.weight) expands it:
//
//   k_h = [W_UK_h c ; k_rope],  v_h = W_UV_h c,   W_UK_h = kv_b rows h (nope+v) .. + nope,
//                                                  W_UV_h = kv_b rows h (nope+v) + nope .. + v
//   o_h = softmax_causal(scale * q_h . k_h) v_h,   q_h = [q_nope_h ; q_rope_h], scale 0:
//   (nope+rope)^-0.5
//
// Two exact forms: expanded (every key and value materialised per head, then flash attention;
// cheap per query for long prefills) and absorbed (W_UK folded into the query, W_UV applied
// after attending over the latent rows: one shared 'KV head' of width latent + rope, MQA-style,
// reading only the cache; what decode uses).
// Queries q [T, H, nope + rope]; outputs o [T, H, v]. Query t sits at position past + t and sees
// keys 0 .. past + t.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

namespace kda::ops {

struct MlaShape {
  int64_t H = 1;
  int64_t nope = 128;    // qk_nope_head_dim
  int64_t rope = 64;     // qk_rope_head_dim (no rotation is applied)
  int64_t v = 128;       // v_head_dim
  int64_t latent = 512;  // kv_lora_rank
  double scale = 0;      // 0: (nope + rope)^-0.5

  int64_t qk_dim() const { return nope + rope; }
  int64_t row_width() const { return latent + rope; }  // one cached latent row
  double effective_scale() const;
  void validate() const;  // throws kda::Error on non-positive sizes
};

// The latent rows of one sequence as fixed-size pages: page i holds rows
// i * page_tokens .. (page_tokens each, row_width floats per row); `length` rows in all.
struct LatentPages {
  std::span<const float* const> pages;
  int64_t page_tokens = 0;
  int64_t length = 0;
};

// Reusable buffers (grown, never shrunk) so decode steps do not allocate.
struct MlaWorkspace {
  std::vector<float> keys, values, expanded, q_latent, scores, o_latent;
};

// Expanded form. rows [past + T, row_width] holds every key's latent row, the T new ones last.
void mla_expanded_forward(const MlaShape& shape, const float* q, int64_t T, const float* rows,
                          int64_t past, const float* kv_b, float* o, MlaWorkspace& ws);

// Absorbed form over a paged latent cache that already holds the T new rows (past = length - T).
void mla_absorbed_forward(const MlaShape& shape, const float* q, int64_t T,
                          const LatentPages& cache, const float* kv_b, float* o, MlaWorkspace& ws);

// float64 ground truth: keys and values expanded, scores materialised.
void mla_reference(const MlaShape& shape, const double* q, int64_t T, const double* rows,
                   int64_t past, const double* kv_b, double* o);

}  // namespace kda::ops
