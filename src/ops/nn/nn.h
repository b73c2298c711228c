// The small dense building blocks of transformer layers, fp32, token-major rows:
// linear projections (torch's [out, in] weight layout), norms and activations.
#pragma once
#include <cstdint>

namespace kda::ops {

// y[T, out] = x[T, in] W[out, in]^T (+ bias[out]); bias may be null. BLAS underneath.
void linear(const float* x, int64_t T, int64_t in, const float* W, int64_t out, const float* bias,
            float* y);
// Same, accumulating: y += x W^T.
void linear_accumulate(const float* x, int64_t T, int64_t in, const float* W, int64_t out,
                       float* y);

// LayerNorm over rows of width D: (x - mean) / sqrt(var + eps) * weight + bias.
void layer_norm(const float* x, int64_t rows, int64_t D, const float* weight, const float* bias,
                float eps, float* y);
// RMSNorm over rows of width D, as transformers computes it: x * rsqrt(mean(x^2) + eps), then
// times weight (weight may be null: no affine).
void rms_norm(const float* x, int64_t rows, int64_t D, const float* weight, float eps, float* y);

// Activations, in place over n values.
void gelu_tanh(float* x, int64_t n);  // GPT-2's "gelu_new"
void silu(float* x, int64_t n);
inline float sigmoidf(float x);

}  // namespace kda::ops

#include <cmath>

inline float kda::ops::sigmoidf(float x) {
  return 1.0f / (1.0f + std::exp(-x));
}
