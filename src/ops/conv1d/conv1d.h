// Causal depthwise short convolution over time followed by SiLU: the q/k/v pre-mixing of KDA
// layers (fla's ShortConvolution(activation="silu"), transformers' causal_conv1d_fn/_update).
// Per channel c of a sequence, with kernel width W and weight w [C, W] (torch's [C, 1, W]):
//
//   y[t, c] = silu( sum_{j < W} w[c, j] * x[t - (W - 1) + j, c] )
//
// Inputs before the sequence's first fed token come from the conv state [W - 1, C] (the last
// W - 1 inputs, oldest first; zeros for a fresh sequence). After a call the state holds the last
// W - 1 inputs seen, so prefill in pieces and token-by-token decode continue one another exactly.
#pragma once
#include <cstdint>

namespace kda::ops {

// Prefill over T tokens: x [T, C] with row stride x_stride (>= C), y [T, C] contiguous (must not
// overlap x), state [W - 1, C] updated in place. Throws kda::Error on bad sizes.
void short_conv_silu_forward(const float* x, int64_t T, int64_t C, int64_t x_stride,
                             const float* weight, int64_t W, float* state, float* y);

// One token: x [C], y [C] (y may alias x), state [W - 1, C] updated in place.
void short_conv_silu_decode_step(const float* x, int64_t C, const float* weight, int64_t W,
                                 float* state, float* y);

// Backward of short_conv_silu_forward from a zero initial state (training: every sequence
// starts fresh): dy [T, C] -> dx [T, C] with row stride dx_stride (overwritten), dweight [C, W]
// accumulated. x as in the forward.
void short_conv_silu_backward(const float* x, int64_t T, int64_t C, int64_t x_stride,
                              const float* weight, int64_t W, const float* dy, float* dx,
                              int64_t dx_stride, float* dweight);

// float64 ground truth of short_conv_silu_forward (contiguous x).
void short_conv_silu_reference(const double* x, int64_t T, int64_t C, const double* weight,
                               int64_t W, double* state, double* y);

}  // namespace kda::ops
