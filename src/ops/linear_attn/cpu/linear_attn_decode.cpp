// One decode step of linear attention: per (sequence, head), S += phi(k) v^T and o = scale S^T
// phi(q) in a single pass over the state rows (each row is updated, then read while in cache).
#include <string>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "ops/linear_attn/linear_attn.h"

namespace kda::ops {
namespace {

// `features` is scratch for 2 * K floats: phi(q) then phi(k), computed in vector loops first so
// the row loop below is pure multiply-adds.
void decode_one_head(const LinearAttnShape& s, const float* __restrict q, const float* __restrict k,
                     const float* __restrict v, float* __restrict S, float* __restrict z,
                     float* __restrict o, float* __restrict features, float scale) {
  const int64_t K = s.K, V = s.V;
  float* q_features = features;
  float* k_features = features + K;
  for (int64_t r = 0; r < K; ++r) q_features[r] = linear_attn_feature_map(q[r]);
  for (int64_t r = 0; r < K; ++r) k_features[r] = linear_attn_feature_map(k[r]);
  for (int64_t c = 0; c < V; ++c) o[c] = 0.0f;
  for (int64_t r = 0; r < K; ++r) {  // row by row: streams the state once, o stays in L1
    const float q_feature = q_features[r], k_feature = k_features[r];
    float* S_row = S + r * V;
    for (int64_t c = 0; c < V; ++c) {
      S_row[c] += k_feature * v[c];
      o[c] += q_feature * S_row[c];
    }
  }
  float factor = scale;
  if (z) {
    float qz = 0.0f;
    for (int64_t r = 0; r < K; ++r) {
      z[r] += k_features[r];
      qz += q_features[r] * z[r];
    }
    factor = scale / (scale * qz + 1e-10f);
  }
  for (int64_t c = 0; c < V; ++c) o[c] *= factor;
}

}  // namespace

void linear_attn_decode_step(const LinearAttnShape& step_shape, const float* q, const float* k,
                             const float* v, float* state, float* z, float* o) {
  LinearAttnShape shape = step_shape;
  shape.T = 1;  // one token per sequence, whatever T says
  shape.validate();
  require(q && k && v && state && o, "linear_attn_decode_step: q, k, v, state and o are required");
  require(!shape.normalize || z, "linear_attn_decode_step: the normalised form needs z");
  require(shape.normalize || !z, "linear_attn_decode_step: z is only used by the normalised form");
  const int64_t N = shape.B, H = shape.H, K = shape.K, V = shape.V;
  require_finite(q, N * H * K, "linear_attn_decode_step: q");
  require_finite(k, N * H * K, "linear_attn_decode_step: k");
  require_finite(v, N * H * V, "linear_attn_decode_step: v");
  const float scale = float(shape.effective_scale());
  auto step = [&](int64_t item, float* features) {
    decode_one_head(shape, q + item * K, k + item * K, v + item * V, state + item * K * V,
                    z ? z + item * K : nullptr, o + item * V, features, scale);
  };
  // A head's step is ~K * V multiply-adds on a state in cache: below ~1M of them in all, waking
  // the thread team costs more than it saves.
  if (N * H * K * V < (int64_t(1) << 20)) {
    std::vector<float> features(2 * K);
    for (int64_t item = 0; item < N * H; ++item) step(item, features.data());
  } else {
    parallel_for(N * H, [&](int64_t item) {
      std::vector<float> features(2 * K);
      step(item, features.data());
    });
  }
}

}  // namespace kda::ops
