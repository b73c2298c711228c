// MLA prefill in expanded form: every key's latent row goes through kv_b once, then the per-head
// keys [W_UK c ; k_rope] and values W_UV c feed the flash attention forward (D = nope + rope,
// DV = v).
#include <algorithm>

#include "core/blas.h"
#include "core/error.h"
#include "ops/attention/attention.h"
#include "ops/mla/mla.h"

namespace kda::ops {
namespace {

template <class V>
float* grow(V& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

}  // namespace

void mla_expanded_forward(const MlaShape& s, const float* q, int64_t T, const float* rows,
                          int64_t past, const float* kv_b, float* o, MlaWorkspace& ws) {
  s.validate();
  require(T >= 1 && past >= 0, "mla_expanded_forward: T must be positive, past non-negative");
  require(q && rows && kv_b && o, "mla_expanded_forward: null pointer");
  const int64_t keys = past + T, L = s.latent, W = s.row_width(), D = s.qk_dim();
  const int64_t kv_w = s.nope + s.v;
  float* expanded = grow(ws.expanded, size_t(keys * s.H * kv_w));
  float* k = grow(ws.keys, size_t(keys * s.H * D));
  float* v = grow(ws.values, size_t(keys * s.H * s.v));
  // [keys, H (nope + v)] = c [keys, L] kv_b^T
  gemm_nt(int(keys), int(s.H * kv_w), int(L), 1.0f, rows, int(W), kv_b, int(L), 0.0f, expanded,
          int(s.H * kv_w));
  for (int64_t j = 0; j < keys; ++j) {
    const float* k_rope = rows + j * W + L;
    for (int64_t h = 0; h < s.H; ++h) {
      const float* e = expanded + (j * s.H + h) * kv_w;
      float* kh = k + (j * s.H + h) * D;
      std::copy_n(e, s.nope, kh);
      std::copy_n(k_rope, s.rope, kh + s.nope);
      std::copy_n(e + s.nope, s.v, v + (j * s.H + h) * s.v);
    }
  }
  AttentionShape a;
  a.B = 1;
  a.T = T;
  a.H = a.HKV = s.H;
  a.D = D;
  a.DV = s.v;
  a.scale = s.effective_scale();
  if (past == 0) {
    attention_flash_forward({a, q, k, v}, o, nullptr);
  } else {
    // Queries continue a sequence whose first `past` keys came from earlier calls.
    a.validate();
    const attention_detail::SequenceSpan seq{q, k, v, o, nullptr, past, T};
    attention_detail::flash_forward_sequences(a, std::span(&seq, 1), FlashBlocks{});
  }
}

}  // namespace kda::ops
