// Float64 ground truth for linear attention, plus the argument checks every backend shares.
#include <cmath>
#include <string>
#include <vector>

#include "core/error.h"
#include "ops/linear_attn/linear_attn.h"

namespace kda::ops {

double LinearAttnShape::effective_scale() const {
  return scale == 0 ? 1.0 / std::sqrt(double(K)) : scale;
}

void LinearAttnShape::validate() const {
  require(B >= 1 && T >= 1 && H >= 1 && K >= 1 && V >= 1,
          "linear_attn: sizes must be positive (B = " + std::to_string(B) +
              ", T = " + std::to_string(T) + ", H = " + std::to_string(H) +
              ", K = " + std::to_string(K) + ", V = " + std::to_string(V) + ")");
  require(
      std::isfinite(scale) && scale >= 0,
      "linear_attn: scale must be finite and >= 0 (0 means K^-0.5), got " + std::to_string(scale));
}

LinearAttnShape linear_attn_shape_of(const Shape& q, const Shape& k, const Shape& v,
                                     std::span<const int64_t> cu_seqlens, const Shape& h0,
                                     const Shape& z0) {
  require(q.size() == 4, "linear_attn: q must be [B, T, H, K], got " + shape_string(q));
  require(k == q,
          "linear_attn: k must have q's shape " + shape_string(q) + ", got " + shape_string(k));
  require(v.size() == 4 && v[0] == q[0] && v[1] == q[1] && v[2] == q[2],
          "linear_attn: v must be [B, T, H, V] = [" + std::to_string(q[0]) + ", " +
              std::to_string(q[1]) + ", " + std::to_string(q[2]) + ", V], got " + shape_string(v));
  LinearAttnShape shape;
  shape.B = q[0];
  shape.T = q[1];
  shape.H = q[2];
  shape.K = q[3];
  shape.V = v[3];
  shape.validate();
  const int64_t N = cu_seqlens.empty() ? shape.B : int64_t(cu_seqlens.size()) - 1;
  if (!h0.empty()) {
    const Shape want = {N, shape.H, shape.K, shape.V};
    require(h0 == want, "linear_attn: h0 must be [N, H, K, V] = " + shape_string(want) + ", got " +
                            shape_string(h0));
  }
  if (!z0.empty()) {
    const Shape want = {N, shape.H, shape.K};
    require(z0 == want, "linear_attn: z0 must be [N, H, K] = " + shape_string(want) + ", got " +
                            shape_string(z0));
  }
  return shape;
}

template <class F>
SequenceLayout validate_linear_attn_inputs(const LinearAttnInputs<F>& in, bool check_values) {
  const LinearAttnShape& s = in.shape;
  s.validate();
  require(in.q && in.k && in.v, "linear_attn: q, k and v are required");
  require(!in.z0 || s.normalize, "linear_attn: z0 is only used by the normalised form");
  SequenceLayout layout(s.B, s.T, in.cu_seqlens);
  if (check_values) {
    const int64_t tokens = s.B * s.T, N = layout.num_sequences();
    require_finite(in.q, tokens * s.H * s.K, "linear_attn: q");
    require_finite(in.k, tokens * s.H * s.K, "linear_attn: k");
    require_finite(in.v, tokens * s.H * s.V, "linear_attn: v");
    require_finite(in.h0, N * s.H * s.K * s.V, "linear_attn: h0");
    require_finite(in.z0, N * s.H * s.K, "linear_attn: z0");
  }
  return layout;
}

template SequenceLayout validate_linear_attn_inputs(const LinearAttnInputs<float>&, bool);
template SequenceLayout validate_linear_attn_inputs(const LinearAttnInputs<double>&, bool);

void linear_attn_reference(const LinearAttnInputs<double>& in,
                           const LinearAttnOutputs<double>& out) {
  const SequenceLayout layout = validate_linear_attn_inputs(in);
  require(out.o != nullptr, "linear_attn_reference: o is required");
  require(!out.zt || in.shape.normalize, "linear_attn_reference: zt needs the normalised form");
  const int64_t H = in.shape.H, K = in.shape.K, V = in.shape.V;
  const double scale = in.shape.effective_scale();
  std::vector<double> S(K * V), z(K), qp(K), kp(K);
  for (int64_t n = 0; n < layout.num_sequences(); ++n) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t state_row = n * H + h;
      for (int64_t i = 0; i < K * V; ++i) S[i] = in.h0 ? in.h0[state_row * K * V + i] : 0.0;
      for (int64_t i = 0; i < K; ++i) z[i] = in.z0 ? in.z0[state_row * K + i] : 0.0;
      for (int64_t t = layout.start(n); t < layout.start(n) + layout.length(n); ++t) {
        const double* q = in.q + (t * H + h) * K;
        const double* k = in.k + (t * H + h) * K;
        const double* v = in.v + (t * H + h) * V;
        double* o = out.o + (t * H + h) * V;
        for (int64_t i = 0; i < K; ++i) {
          qp[i] = linear_attn_feature_map(q[i]);
          kp[i] = linear_attn_feature_map(k[i]);
        }
        for (int64_t i = 0; i < K; ++i) {
          for (int64_t j = 0; j < V; ++j) S[i * V + j] += kp[i] * v[j];
          z[i] += kp[i];
        }
        for (int64_t j = 0; j < V; ++j) {
          double acc = 0;
          for (int64_t i = 0; i < K; ++i) acc += qp[i] * S[i * V + j];
          o[j] = scale * acc;
        }
        if (in.shape.normalize) {
          double qz = 0;
          for (int64_t i = 0; i < K; ++i) qz += qp[i] * z[i];
          const double denominator = scale * qz + 1e-10;
          for (int64_t j = 0; j < V; ++j) o[j] /= denominator;
        }
      }
      if (out.ht) {
        for (int64_t i = 0; i < K * V; ++i) out.ht[state_row * K * V + i] = S[i];
      }
      if (out.zt) {
        for (int64_t i = 0; i < K; ++i) out.zt[state_row * K + i] = z[i];
      }
    }
  }
}

}  // namespace kda::ops
