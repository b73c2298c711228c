// Chunked fp32 backward of linear attention. With Qp = phi(Q), Kp = phi(K), M the causal mask
// (j <= i) and E the output cotangent seen by the numerator (d_o, or d_o / den when normalised),
// per chunk:
//
//   dQp = scale * ((E V^T) .* M) Kp + scale * E S_prev^T           (forward walk: needs S_prev)
//   dKp = scale * ((E V^T) .* M)^T Qp + V G^T                       (backward walk: needs G)
//   dV  = scale * ((Qp Kp^T) .* M)^T E + Kp G
//   G  += scale * Qp^T E        (G: gradient reaching the state after the chunk; ends as dh0)
//
// Normalised form, den_i = scale * Qp_i . z_i + 1e-10 and o_i = num_i / den_i: E_i = d_o_i / den_i
// and w_i = -scale (o_i . d_o_i) / den_i, so dQp_i += w_i z_i and dKp_j += Gz + sum_{i>=j} w_i Qp_i
// (Gz: gradient reaching z, ends as dz0). The forward walk parks E in dv, which the backward walk
// then overwrites chunk by chunk.
#include <algorithm>
#include <string>
#include <vector>

#include "core/blas.h"
#include "core/error.h"
#include "core/parallel.h"
#include "ops/linear_attn/linear_attn.h"

namespace kda::ops {
namespace {

struct BackwardArgs {
  const LinearAttnInputs<float>& in;
  const float* d_o;
  const float* d_ht;
  const float* d_zt;
  const LinearAttnGrads<float>& grads;
  const SequenceLayout& layout;
  int64_t C;
};

// Per (sequence, head) scratch, sized once for full chunks.
struct Workspace {
  std::vector<float> S, z, G, Gz;               // states and their gradients
  std::vector<float> q_features, k_features;    // C x K
  std::vector<float> q_slopes, k_slopes;        // phi'(x), C x K
  std::vector<float> scores, cotangent_scores;  // C x C
  std::vector<float> d_features, running_z;     // C x K
  std::vector<float> numerator, cotangent;      // C x V
  std::vector<float> w;                         // one per token of the sequence
  Workspace(int64_t C, int64_t K, int64_t V, int64_t length)
      : S(K * V),
        z(K),
        G(K * V),
        Gz(K),
        q_features(C * K),
        k_features(C * K),
        q_slopes(C * K),
        k_slopes(C * K),
        scores(C * C),
        cotangent_scores(C * C),
        d_features(C * K),
        running_z(C * K),
        numerator(C * V),
        cotangent(C * V),
        w(length) {}
};

void load_features(const float* src, int64_t stride, int64_t rows, int64_t cols, float* features,
                   float* slopes) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float x = src[r * stride + c];
      const float feature = linear_attn_feature_map(x);
      features[r * cols + c] = feature;
      slopes[r * cols + c] = x > 0.0f ? 1.0f : feature;
    }
  }
}

// Keeps m[i, j] for j <= i (causal), zeroes the rest; m is L x L.
void mask_causal(float* m, int64_t L) {
  for (int64_t i = 0; i < L; ++i) std::fill(m + i * L + i + 1, m + (i + 1) * L, 0.0f);
}

void backward_one_head(const BackwardArgs& a, int64_t n, int64_t h) {
  const LinearAttnShape& s = a.in.shape;
  const int64_t start = a.layout.start(n), length = a.layout.length(n);
  const int64_t H = s.H, K = s.K, V = s.V, C = std::min(a.C, length);
  const int Ki = int(K), Vi = int(V);
  const int qk_stride = int(H * K), vo_stride = int(H * V);
  const float scale = float(s.effective_scale());
  const bool normalize = s.normalize;
  const int64_t state_row = n * H + h;
  Workspace ws(C, K, V, length);

  auto row = [&](auto* base, int64_t token, int64_t width) {
    return base + (token * H + h) * width;
  };

  // Forward walk: dq, and (normalised form) the numerator's cotangent E parked in dv.
  if (a.in.h0) std::copy_n(a.in.h0 + state_row * K * V, K * V, ws.S.begin());
  if (a.in.z0) std::copy_n(a.in.z0 + state_row * K, K, ws.z.begin());
  for (int64_t t0 = 0; t0 < length; t0 += C) {
    const int64_t L = std::min(C, length - t0), token = start + t0;
    const int Li = int(L);
    const float* v = row(a.in.v, token, V);
    const float* d_o = row(a.d_o, token, V);
    load_features(row(a.in.q, token, K), qk_stride, L, K, ws.q_features.data(), ws.q_slopes.data());
    load_features(row(a.in.k, token, K), qk_stride, L, K, ws.k_features.data(), ws.k_slopes.data());

    const float* E = d_o;
    int E_stride = vo_stride;
    if (normalize) {
      gemm_nt(Li, Li, Ki, 1.0f, ws.q_features.data(), Ki, ws.k_features.data(), Ki, 0.0f,
              ws.scores.data(), Li);
      mask_causal(ws.scores.data(), L);
      gemm_nn(Li, Vi, Li, scale, ws.scores.data(), Li, v, vo_stride, 0.0f, ws.numerator.data(), Vi);
      gemm_nn(Li, Vi, Ki, scale, ws.q_features.data(), Ki, ws.S.data(), Vi, 1.0f,
              ws.numerator.data(), Vi);
      float* parked = row(a.grads.dv, token, V);
      for (int64_t i = 0; i < L; ++i) {
        float* z_i = &ws.running_z[i * K];
        float qz = 0.0f;
        for (int64_t c = 0; c < K; ++c) {
          ws.z[c] += ws.k_features[i * K + c];
          z_i[c] = ws.z[c];
          qz += ws.q_features[i * K + c] * z_i[c];
        }
        const float den = scale * qz + 1e-10f;
        float o_dot_do = 0.0f;
        for (int64_t c = 0; c < V; ++c) {
          const float o = ws.numerator[i * V + c] / den;
          o_dot_do += o * d_o[i * vo_stride + c];
          ws.cotangent[i * V + c] = d_o[i * vo_stride + c] / den;
        }
        std::copy_n(&ws.cotangent[i * V], V, parked + i * vo_stride);
        ws.w[t0 + i] = -scale * o_dot_do / den;
      }
      E = ws.cotangent.data();
      E_stride = Vi;
    }

    // dQp = scale * ((E V^T) .* M) Kp + scale * E S^T (+ w_i z_i)
    gemm_nt(Li, Li, Vi, 1.0f, E, E_stride, v, vo_stride, 0.0f, ws.cotangent_scores.data(), Li);
    mask_causal(ws.cotangent_scores.data(), L);
    gemm_nn(Li, Ki, Li, scale, ws.cotangent_scores.data(), Li, ws.k_features.data(), Ki, 0.0f,
            ws.d_features.data(), Ki);
    gemm_nt(Li, Ki, Vi, scale, E, E_stride, ws.S.data(), Vi, 1.0f, ws.d_features.data(), Ki);
    float* dq = row(a.grads.dq, token, K);
    for (int64_t i = 0; i < L; ++i) {
      const float w = normalize ? ws.w[t0 + i] : 0.0f;
      for (int64_t c = 0; c < K; ++c) {
        float d = ws.d_features[i * K + c];
        if (normalize) d += w * ws.running_z[i * K + c];
        dq[i * qk_stride + c] = d * ws.q_slopes[i * K + c];
      }
    }
    gemm_tn(Ki, Vi, Li, 1.0f, ws.k_features.data(), Ki, v, vo_stride, 1.0f, ws.S.data(), Vi);
  }

  // Backward walk: dk, dv, and the state gradients G, Gz.
  if (a.d_ht) std::copy_n(a.d_ht + state_row * K * V, K * V, ws.G.begin());
  if (a.d_zt) std::copy_n(a.d_zt + state_row * K, K, ws.Gz.begin());
  const int64_t last_chunk_start = ((length - 1) / C) * C;
  for (int64_t t0 = last_chunk_start; t0 >= 0; t0 -= C) {
    const int64_t L = std::min(C, length - t0), token = start + t0;
    const int Li = int(L);
    const float* v = row(a.in.v, token, V);
    float* dv = row(a.grads.dv, token, V);
    load_features(row(a.in.q, token, K), qk_stride, L, K, ws.q_features.data(), ws.q_slopes.data());
    load_features(row(a.in.k, token, K), qk_stride, L, K, ws.k_features.data(), ws.k_slopes.data());

    const float* E = row(a.d_o, token, V);
    int E_stride = vo_stride;
    if (normalize) {  // take the parked cotangent out of dv before dv is written
      for (int64_t i = 0; i < L; ++i) std::copy_n(dv + i * vo_stride, V, &ws.cotangent[i * V]);
      E = ws.cotangent.data();
      E_stride = Vi;
    }

    gemm_nt(Li, Li, Ki, 1.0f, ws.q_features.data(), Ki, ws.k_features.data(), Ki, 0.0f,
            ws.scores.data(), Li);
    mask_causal(ws.scores.data(), L);
    gemm_nt(Li, Li, Vi, 1.0f, E, E_stride, v, vo_stride, 0.0f, ws.cotangent_scores.data(), Li);
    mask_causal(ws.cotangent_scores.data(), L);

    // dKp = scale * ((E V^T) .* M)^T Qp + V G^T
    gemm_tn(Li, Ki, Li, scale, ws.cotangent_scores.data(), Li, ws.q_features.data(), Ki, 0.0f,
            ws.d_features.data(), Ki);
    gemm_nt(Li, Ki, Vi, 1.0f, v, vo_stride, ws.G.data(), Vi, 1.0f, ws.d_features.data(), Ki);
    // dV = scale * ((Qp Kp^T) .* M)^T E + Kp G
    gemm_tn(Li, Vi, Li, scale, ws.scores.data(), Li, E, E_stride, 0.0f, dv, vo_stride);
    gemm_nn(Li, Vi, Ki, 1.0f, ws.k_features.data(), Ki, ws.G.data(), Vi, 1.0f, dv, vo_stride);

    if (normalize) {  // dKp_j += Gz + sum_{i >= j} w_i Qp_i, Gz carried to the previous chunk
      for (int64_t j = L - 1; j >= 0; --j) {
        const float w = ws.w[t0 + j];
        for (int64_t c = 0; c < K; ++c) {
          ws.Gz[c] += w * ws.q_features[j * K + c];
          ws.d_features[j * K + c] += ws.Gz[c];
        }
      }
    }
    float* dk = row(a.grads.dk, token, K);
    for (int64_t i = 0; i < L; ++i) {
      for (int64_t c = 0; c < K; ++c) {
        dk[i * qk_stride + c] = ws.d_features[i * K + c] * ws.k_slopes[i * K + c];
      }
    }
    gemm_tn(Ki, Vi, Li, scale, ws.q_features.data(), Ki, E, E_stride, 1.0f, ws.G.data(), Vi);
  }
  if (a.grads.dh0) std::copy(ws.G.begin(), ws.G.end(), a.grads.dh0 + state_row * K * V);
  if (a.grads.dz0) std::copy(ws.Gz.begin(), ws.Gz.end(), a.grads.dz0 + state_row * K);
}

}  // namespace

void linear_attn_chunk_backward(const LinearAttnInputs<float>& in, const float* d_o,
                                const float* d_ht, const float* d_zt,
                                const LinearAttnGrads<float>& grads, int chunk) {
  const SequenceLayout layout = validate_linear_attn_inputs(in);
  const LinearAttnShape& s = in.shape;
  require(chunk >= 1,
          "linear_attn_chunk_backward: chunk must be >= 1, got " + std::to_string(chunk));
  require(d_o != nullptr, "linear_attn_chunk_backward: d_o is required");
  require(grads.dq && grads.dk && grads.dv,
          "linear_attn_chunk_backward: dq, dk and dv are required");
  require(!d_zt || s.normalize, "linear_attn_chunk_backward: d_zt needs the normalised form");
  require(!grads.dz0 || s.normalize, "linear_attn_chunk_backward: dz0 needs the normalised form");
  const int64_t N = layout.num_sequences();
  require_finite(d_o, s.B * s.T * s.H * s.V, "linear_attn: d_o");
  require_finite(d_ht, N * s.H * s.K * s.V, "linear_attn: d_ht");
  require_finite(d_zt, N * s.H * s.K, "linear_attn: d_zt");
  const BackwardArgs args{in, d_o, d_ht, d_zt, grads, layout, chunk};
  parallel_for(N * s.H, [&](int64_t item) { backward_one_head(args, item / s.H, item % s.H); });
}

}  // namespace kda::ops
