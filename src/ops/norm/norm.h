// Normalisations beyond nn.h's plain RMSNorm/LayerNorm.
#pragma once
#include <cstdint>

namespace kda::ops {

// The sigmoid-gated RMSNorm at the output of a KDA layer (fla's FusedRMSNormGated with
// activation "sigmoid", transformers' KimiLinearRMSNormGated): over rows of width D,
//
//   y = weight * x * rsqrt(mean(x^2) + eps) * sigmoid(gate)
//
// (norm before gate). x, gate, y [rows, D]; weight [D] is shared by every row (every head).
// y may alias x. Throws kda::Error on bad sizes.
void gated_rms_norm_sigmoid(const float* x, const float* gate, int64_t rows, int64_t D,
                            const float* weight, float eps, float* y);

// L2 normalisation as transformers' KDA path and fla's l2norm kernel compute it, over rows of
// width D: y = x * rsqrt(sum(x^2) + eps). (Not x / max(|x|, eps), the in-op form of
// ops::kda: the two differ by about eps / (2 |x|^2) relative, which is visible when |x| is small.)
// y may alias x.
void l2_normalize_rows(const float* x, int64_t rows, int64_t D, float eps, float* y);

// Backward of gated_rms_norm_sigmoid: dx and dgate overwritten, dweight [D] accumulated over
// every row. x, gate are the forward's inputs.
void gated_rms_norm_sigmoid_backward(const float* x, const float* gate, int64_t rows, int64_t D,
                                     const float* weight, float eps, const float* dy, float* dx,
                                     float* dgate, float* dweight);

// Backward of l2_normalize_rows: dx = (dy - y (y . dy)) / sqrt(sum(x^2) + eps), overwritten.
// dx may alias dy.
void l2_normalize_rows_backward(const float* x, int64_t rows, int64_t D, float eps, const float* dy,
                                float* dx);

}  // namespace kda::ops
