// Chunked fp32 forward of linear attention. Per (sequence, head), walking chunks of C tokens:
//
//   O_c  = scale * (phi(Q_c) phi(K_c)^T  masked causal) V_c + scale * phi(Q_c) S
//   S   += phi(K_c)^T V_c
//
// and for the normalised form O_c[i] /= scale * phi(q_i)^T (z + sum_{j<=i} phi(k_j)) + 1e-10,
// whose sum is the row sum of the masked intra-chunk scores. Inputs are checked for finite
// values chunk by chunk as the feature map reads them, so the check costs no extra pass.
#include <algorithm>
#include <bit>
#include <string>
#include <vector>

#include "core/blas.h"
#include "core/error.h"
#include "core/parallel.h"
#include "ops/linear_attn/linear_attn.h"

namespace kda::ops {
namespace {

// 1 when x is NaN or infinite (all exponent bits set). Integer flags, OR-ed together, keep the
// loops below vectorisable where a bool reduction would not be.
uint32_t non_finite_bit(float x) {
  return uint32_t((std::bit_cast<uint32_t>(x) & 0x7f800000u) == 0x7f800000u);
}

[[noreturn]] void throw_non_finite(const char* what, int64_t token, int64_t head) {
  throw Error(std::string("linear_attn: ") + what + " has a non-finite value at token " +
              std::to_string(token) + ", head " + std::to_string(head));
}

// dst[r, :] = phi(src[r * stride, :]) for `rows` rows of `cols`; false if any input is not finite.
bool load_features(const float* src, int64_t stride, int64_t rows, int64_t cols, float* dst) {
  uint32_t non_finite = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = src + r * stride;
    float* out = dst + r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      non_finite |= non_finite_bit(x[c]);
      out[c] = linear_attn_feature_map(x[c]);
    }
  }
  return non_finite == 0;
}

bool rows_finite(const float* src, int64_t stride, int64_t rows, int64_t cols) {
  uint32_t non_finite = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) non_finite |= non_finite_bit(src[r * stride + c]);
  }
  return non_finite == 0;
}

// Returns the first token in [t0, t0 + rows) whose row is not finite (t0 + rows if none).
int64_t first_bad_row(const float* src, int64_t stride, int64_t rows, int64_t cols, int64_t t0) {
  for (int64_t r = 0; r < rows; ++r) {
    if (!rows_finite(src + r * stride, stride, 1, cols)) return t0 + r;
  }
  return t0 + rows;
}

void forward_one_head(const LinearAttnInputs<float>& in, const LinearAttnOutputs<float>& out,
                      const SequenceLayout& layout, int64_t n, int64_t h, int64_t chunk) {
  const int64_t H = in.shape.H, K = in.shape.K, V = in.shape.V;
  const int64_t start = layout.start(n), length = layout.length(n);
  const int64_t C = std::min(chunk, length);  // no scratch beyond the sequence
  const int64_t qk_stride = H * K, vo_stride = H * V;
  const float scale = float(in.shape.effective_scale());
  const bool normalize = in.shape.normalize;
  const int64_t state_row = n * H + h;

  std::vector<float> S(K * V, 0.0f), z(K, 0.0f);
  std::vector<float> q_features(C * K), k_features(C * K), scores(C * C);
  if (in.h0) std::copy_n(in.h0 + state_row * K * V, K * V, S.begin());
  if (in.z0) std::copy_n(in.z0 + state_row * K, K, z.begin());
  bool state_is_zero = !in.h0;

  for (int64_t t0 = 0; t0 < length; t0 += C) {
    const int64_t L = std::min(C, length - t0);
    const int64_t token = start + t0;
    const float* q = in.q + (token * H + h) * K;
    const float* k = in.k + (token * H + h) * K;
    const float* v = in.v + (token * H + h) * V;
    float* o = out.o + (token * H + h) * V;

    const bool q_ok = load_features(q, qk_stride, L, K, q_features.data());
    const bool k_ok = load_features(k, qk_stride, L, K, k_features.data());
    if (!q_ok) throw_non_finite("q", first_bad_row(q, qk_stride, L, K, token), h);
    if (!k_ok) throw_non_finite("k", first_bad_row(k, qk_stride, L, K, token), h);
    if (!rows_finite(v, vo_stride, L, V)) {
      throw_non_finite("v", first_bad_row(v, vo_stride, L, V, token), h);
    }

    // scores[i, j] = phi(q_i) . phi(k_j) for j <= i, else 0
    const int Li = int(L);
    gemm_nt(Li, Li, int(K), 1.0f, q_features.data(), int(K), k_features.data(), int(K), 0.0f,
            scores.data(), Li);
    for (int64_t i = 0; i < L; ++i) {
      std::fill(scores.data() + i * L + i + 1, scores.data() + (i + 1) * L, 0.0f);
    }

    gemm_nn(Li, int(V), Li, scale, scores.data(), Li, v, int(vo_stride), 0.0f, o, int(vo_stride));
    if (!state_is_zero) {
      gemm_nn(Li, int(V), int(K), scale, q_features.data(), int(K), S.data(), int(V), 1.0f, o,
              int(vo_stride));
    }

    if (normalize) {
      for (int64_t i = 0; i < L; ++i) {
        float intra = 0.0f, carried = 0.0f;
        for (int64_t j = 0; j <= i; ++j) intra += scores[i * L + j];
        for (int64_t c = 0; c < K; ++c) carried += q_features[i * K + c] * z[c];
        const float inverse = 1.0f / (scale * (intra + carried) + 1e-10f);
        float* o_row = o + i * vo_stride;
        for (int64_t c = 0; c < V; ++c) o_row[c] *= inverse;
      }
      for (int64_t j = 0; j < L; ++j) {
        for (int64_t c = 0; c < K; ++c) z[c] += k_features[j * K + c];
      }
    }

    gemm_tn(int(K), int(V), Li, 1.0f, k_features.data(), int(K), v, int(vo_stride), 1.0f, S.data(),
            int(V));
    state_is_zero = false;
  }
  if (out.ht) std::copy(S.begin(), S.end(), out.ht + state_row * K * V);
  if (out.zt) std::copy(z.begin(), z.end(), out.zt + state_row * K);
}

}  // namespace

void linear_attn_chunk_forward(const LinearAttnInputs<float>& in,
                               const LinearAttnOutputs<float>& out, int chunk) {
  // q, k, v are checked for finite values chunk by chunk inside the walk.
  const SequenceLayout layout = validate_linear_attn_inputs(in, /*check_values=*/false);
  require(chunk >= 1,
          "linear_attn_chunk_forward: chunk must be >= 1, got " + std::to_string(chunk));
  require(out.o != nullptr, "linear_attn_chunk_forward: o is required");
  require(!out.zt || in.shape.normalize, "linear_attn_chunk_forward: zt needs the normalised form");
  const LinearAttnShape& s = in.shape;
  const int64_t N = layout.num_sequences();
  require_finite(in.h0, N * s.H * s.K * s.V, "linear_attn: h0");
  require_finite(in.z0, N * s.H * s.K, "linear_attn: z0");
  parallel_for(N * s.H, [&](int64_t item) {
    forward_one_head(in, out, layout, item / s.H, item % s.H, chunk);
  });
}

double linear_attn_chunk_forward_flops_per_token(const LinearAttnShape& shape, int chunk) {
  const double C = chunk, K = double(shape.K), V = double(shape.V);
  // scores (C x C x K) and scores V (C x C x V) per chunk, phi(Q) S and phi(K)^T V (K x V each)
  // per token; the normalised form adds a row sum, phi(q) . z and the z update.
  double multiply_adds = C * K + C * V + 2.0 * K * V;
  if (shape.normalize) multiply_adds += C / 2.0 + 2.0 * K + V;
  return 2.0 * multiply_adds;
}

}  // namespace kda::ops
