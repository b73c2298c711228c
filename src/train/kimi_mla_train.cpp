// Kimi Linear's NoPE MLA mixer for training, in the expanded form:
//   q = x q_proj^T [N, H, nope + rope]  (or q_b(RMSNorm(x q_a^T)) with q_lora_rank, eps 1e-6)
//   [c ; k_rope] = x kv_a^T;  c <- RMSNorm(c) (eps 1e-6)
//   [k_nope_h ; v_h] = c kv_b_h^T;  k_h = [k_nope_h ; k_rope] (k_rope shared by every head)
//   o = causal softmax attention per document (scale (nope + rope)^-0.5);  y = o_proj o
#include <algorithm>
#include <cmath>

#include "ops/attention/attention.h"
#include "train/kimi_train_layers.h"
#include "train/layers.h"

namespace kda::train {
namespace {

template <class V>
float* sized(V& v, int64_t n) {
  v.assign(size_t(n), 0.0f);
  return v.data();
}

}  // namespace

void KimiMlaTrainLayer::forward(const float* x, int64_t N, std::span<const int64_t> segments,
                                float* y) {
  const int64_t D = c_.hidden_size, H = c_.mla_heads, L = c_.kv_lora_rank;
  const int64_t nope = c_.qk_nope_head_dim, rope = c_.qk_rope_head_dim, V = c_.v_head_dim;
  const int64_t qk = nope + rope, row = L + rope;
  N_ = N;
  segments_.assign(segments.begin(), segments.end());
  x_.assign(x, x + N * D);
  if (p_.q_a) {
    const int64_t R = c_.q_lora_rank;
    linear_forward(x, N, D, p_.q_a->value.f32(), R, sized(q_rows_, N * R));
    rms_norm_forward(q_rows_.data(), N, R, p_.q_a_layernorm->value.f32(), model::kKimiLatentNormEps,
                     sized(q_latent_, N * R), sized(q_inv_rms_, N));
    linear_forward(q_latent_.data(), N, R, p_.q_proj->value.f32(), H * qk, sized(q_, N * H * qk));
  } else {
    linear_forward(x, N, D, p_.q_proj->value.f32(), H * qk, sized(q_, N * H * qk));
  }
  linear_forward(x, N, D, p_.kv_a->value.f32(), row, sized(rows_, N * row));
  float* latent = sized(latent_, N * L);
  float* inv = sized(inv_rms_, N);
  for (int64_t t = 0; t < N; ++t) {
    rms_norm_forward(rows_.data() + t * row, 1, L, p_.kv_a_layernorm->value.f32(),
                     model::kKimiLatentNormEps, latent + t * L, inv + t);
  }
  linear_forward(latent, N, L, p_.kv_b->value.f32(), H * (nope + V),
                 sized(kvb_, N * H * (nope + V)));
  float* keys = sized(keys_, N * H * qk);
  float* values = sized(values_, N * H * V);
  for (int64_t t = 0; t < N; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      const float* src = kvb_.data() + (t * H + h) * (nope + V);
      float* key = keys + (t * H + h) * qk;
      std::copy_n(src, nope, key);
      std::copy_n(rows_.data() + t * row + L, rope, key + nope);
      std::copy_n(src + nope, V, values + (t * H + h) * V);
    }
  }
  ops::AttentionInputs<float> in;
  in.shape = {.B = 1, .T = N, .H = H, .HKV = H, .D = qk, .DV = V};
  in.q = q_.data();
  in.k = keys;
  in.v = values;
  in.cu_seqlens = segments_;
  ops::attention_flash_forward(in, sized(o_, N * H * V), sized(lse_, N * H));
  linear_forward(o_.data(), N, H * V, p_.o_proj->value.f32(), D, y);
}

void KimiMlaTrainLayer::backward(const float* dy, float* dx) {
  const int64_t N = N_, D = c_.hidden_size, H = c_.mla_heads, L = c_.kv_lora_rank;
  const int64_t nope = c_.qk_nope_head_dim, rope = c_.qk_rope_head_dim, V = c_.v_head_dim;
  const int64_t qk = nope + rope, row = L + rope;
  std::vector<float> d_o(size_t(N * H * V));
  linear_backward(o_.data(), dy, N, H * V, p_.o_proj->value.f32(), D, d_o.data(),
                  p_.o_proj->grad.f32());
  std::vector<float> dq(size_t(N * H * qk)), dkeys(size_t(N * H * qk)), dvalues(size_t(N * H * V));
  ops::AttentionInputs<float> in;
  in.shape = {.B = 1, .T = N, .H = H, .HKV = H, .D = qk, .DV = V};
  in.q = q_.data();
  in.k = keys_.data();
  in.v = values_.data();
  in.cu_seqlens = segments_;
  ops::attention_flash_backward(in, o_.data(), lse_.data(), d_o.data(),
                                {dq.data(), dkeys.data(), dvalues.data()});
  // Back through the per-head split: kv_b outputs and the shared rope key.
  std::vector<float> dkvb(size_t(N * H * (nope + V))), drows(size_t(N * row), 0.0f);
  for (int64_t t = 0; t < N; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      float* dst = dkvb.data() + (t * H + h) * (nope + V);
      const float* dkey = dkeys.data() + (t * H + h) * qk;
      std::copy_n(dkey, nope, dst);
      std::copy_n(dvalues.data() + (t * H + h) * V, V, dst + nope);
      float* drope = drows.data() + t * row + L;
      for (int64_t r = 0; r < rope; ++r) drope[r] += dkey[nope + r];
    }
  }
  std::vector<float> dlatent(size_t(N * L));
  linear_backward(latent_.data(), dkvb.data(), N, L, p_.kv_b->value.f32(), H * (nope + V),
                  dlatent.data(), p_.kv_b->grad.f32());
  for (int64_t t = 0; t < N; ++t) {
    rms_norm_backward(rows_.data() + t * row, dlatent.data() + t * L, 1, L,
                      p_.kv_a_layernorm->value.f32(), inv_rms_.data() + t, drows.data() + t * row,
                      p_.kv_a_layernorm->grad.f32());
  }
  linear_backward(x_.data(), drows.data(), N, D, p_.kv_a->value.f32(), row, dx,
                  p_.kv_a->grad.f32());
  if (p_.q_a) {
    const int64_t R = c_.q_lora_rank;
    std::vector<float> dq_latent(size_t(N * R)), dq_rows(size_t(N * R));
    linear_backward(q_latent_.data(), dq.data(), N, R, p_.q_proj->value.f32(), H * qk,
                    dq_latent.data(), p_.q_proj->grad.f32());
    rms_norm_backward(q_rows_.data(), dq_latent.data(), N, R, p_.q_a_layernorm->value.f32(),
                      q_inv_rms_.data(), dq_rows.data(), p_.q_a_layernorm->grad.f32());
    linear_backward(x_.data(), dq_rows.data(), N, D, p_.q_a->value.f32(), R, dx, p_.q_a->grad.f32(),
                    true);
  } else {
    linear_backward(x_.data(), dq.data(), N, D, p_.q_proj->value.f32(), H * qk, dx,
                    p_.q_proj->grad.f32(), true);
  }
}

}  // namespace kda::train
