// Linear attention (Katharopoulos et al. 2020) with fla's feature map and semantics. Per head,
// with state S (K x V, fp32) and the feature map phi(x) = elu(x) + 1 applied to the raw q, k:
//
//   S_t = S_{t-1} + phi(k_t) v_t^T
//   o_t = scale * S_t^T phi(q_t)
//
// Normalised form (normalize = true), exactly fla's normalize_output on the scaled output:
//
//   z_t  = z_{t-1} + phi(k_t)                          (z_0 = z0, or zero)
//   o_t /= scale * phi(q_t)^T z_t + 1e-10
//
// Layouts follow fla (token-major): q, k [B, T, H, K]; v, o [B, T, H, V]; states h0, ht
// [N, H, K, V] and normaliser states z0, zt [N, H, K], where N is the number of sequences.
// With cu_seqlens, B = 1 and the sequences are packed along T, each starting from its own
// h0 (z0) row.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>

#include "core/fast_math.h"
#include "core/tensor.h"
#include "ops/common/sequences.h"

namespace kda::ops {

struct LinearAttnShape {
  int64_t B = 1, T = 1, H = 1, K = 64, V = 64;
  double scale = 0;  // 0 means K^-0.5
  bool normalize = false;

  double effective_scale() const;
  // Throws kda::Error on non-positive sizes or a negative or non-finite scale.
  void validate() const;
};

// Reads B, T, H, K, V from q, k [B, T, H, K] and v [B, T, H, V], and checks h0 [N, H, K, V] and
// z0 [N, H, K] where given (an empty shape means absent; N = B, or the number of sequences in
// cu_seqlens). Throws kda::Error naming the tensor that does not fit. scale = 0,
// normalize = false: set them on the result.
LinearAttnShape linear_attn_shape_of(const Shape& q, const Shape& k, const Shape& v,
                                     std::span<const int64_t> cu_seqlens = {}, const Shape& h0 = {},
                                     const Shape& z0 = {});

template <class F>
struct LinearAttnInputs {
  LinearAttnShape shape;
  const F* q = nullptr;  // raw (before the feature map)
  const F* k = nullptr;  // raw (before the feature map)
  const F* v = nullptr;
  const F* h0 = nullptr;  // optional initial state [N, H, K, V]
  const F* z0 = nullptr;  // optional initial normaliser [N, H, K]; normalised form only
  std::span<const int64_t> cu_seqlens = {};
};

template <class F>
struct LinearAttnOutputs {
  F* o = nullptr;   // [B, T, H, V], required
  F* ht = nullptr;  // final state [N, H, K, V]; may be null
  F* zt = nullptr;  // final normaliser [N, H, K]; normalised form only; may be null
};

template <class F>
struct LinearAttnGrads {
  F* dq = nullptr;   // [B, T, H, K], with respect to the raw q
  F* dk = nullptr;   // [B, T, H, K], with respect to the raw k
  F* dv = nullptr;   // [B, T, H, V]
  F* dh0 = nullptr;  // [N, H, K, V]; may be null
  F* dz0 = nullptr;  // [N, H, K]; normalised form only; may be null
};

// Validates a call: shape, required pointers, cu_seqlens, z0 only with the normalised form,
// and (with check_values) that q, k, v, h0, z0 are finite. Returns where the sequences lie.
// Throws kda::Error naming the problem.
template <class F>
SequenceLayout validate_linear_attn_inputs(const LinearAttnInputs<F>& in, bool check_values = true);

// Ground truth: the plain recurrence in float64, token by token (fla's
// naive_recurrent_linear_attn plus the feature map).
void linear_attn_reference(const LinearAttnInputs<double>& in,
                           const LinearAttnOutputs<double>& out);

// Fast fp32 forward, chunkwise: per chunk of at most `chunk` tokens, the causal intra-chunk
// product (phi(Q) phi(K)^T masked) V plus phi(Q) S_prev, then S += phi(K)^T V. BLAS for the
// products, parallel over (sequence, head).
void linear_attn_chunk_forward(const LinearAttnInputs<float>& in,
                               const LinearAttnOutputs<float>& out, int chunk = 64);

// Backward of the forward: gradients of sum(o * d_o) + sum(ht * d_ht) + sum(zt * d_zt) with
// respect to raw q, k, v and h0 (z0). d_ht and d_zt may be null (zero cotangents); d_zt is only
// for the normalised form. dq, dk, dv are required; dh0, dz0 may be null. Chunked: a forward
// walk for dq, a backward walk for dk, dv, dh0 (dv holds scratch in between).
void linear_attn_chunk_backward(const LinearAttnInputs<float>& in, const float* d_o,
                                const float* d_ht, const float* d_zt,
                                const LinearAttnGrads<float>& grads, int chunk = 64);

// One decode step for N = shape.B sequences, one token each (shape.T is ignored): q, k
// [N, H, K]; v [N, H, V]; o [N, H, V]. `state` [N, H, K, V] and, for the normalised form, `z`
// [N, H, K] are updated in place (z may be null for the plain form). q, k, v must be finite;
// the state is trusted (it is this op's own output).
void linear_attn_decode_step(const LinearAttnShape& shape, const float* q, const float* k,
                             const float* v, float* state, float* z, float* o);

// Floating-point operations (a multiply-add counts 2) that the chunked forward executes per
// token and head, full-chunk products included (for GFLOP/s reports: multiply by B * T * H).
double linear_attn_chunk_forward_flops_per_token(const LinearAttnShape& shape, int chunk = 64);

// The feature map phi(x) = elu(x) + 1 = (x > 0 ? x + 1 : exp(x)); its derivative is
// (x > 0 ? 1 : exp(x)). The double version is the reference's.
inline double linear_attn_feature_map(double x) {
  return x > 0 ? x + 1.0 : std::exp(x);
}

// fp32, branch-free so loops over it vectorise: exp of the non-positive part (the feature map
// only needs exp on x <= 0; callers check finiteness).
inline float linear_attn_exp_nonpositive(float x) {
  return fast_exp(std::min(0.0f, x));
}

inline float linear_attn_feature_map(float x) {
  const float e = linear_attn_exp_nonpositive(x);
  return x > 0.0f ? x + 1.0f : e;
}

inline float linear_attn_feature_map_derivative(float x) {
  const float e = linear_attn_exp_nonpositive(x);
  return x > 0.0f ? 1.0f : e;
}

}  // namespace kda::ops
