// fp32 causal short convolution + SiLU, prefill and decode step.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "ops/conv1d/conv1d.h"

namespace kda::ops {
namespace {

void check_sizes(int64_t T, int64_t C, int64_t W, const char* what) {
  require(T >= 0 && C >= 1 && W >= 1, std::string(what) + ": sizes must be positive (T " +
                                          std::to_string(T) + ", C " + std::to_string(C) + ", W " +
                                          std::to_string(W) + ")");
}

inline float silu(float x) {
  return x / (1.0f + std::exp(-x));
}

}  // namespace

void short_conv_silu_forward(const float* x, int64_t T, int64_t C, int64_t x_stride,
                             const float* weight, int64_t W, float* state, float* y) {
  check_sizes(T, C, W, "short_conv_silu_forward");
  require(x_stride >= C, "short_conv_silu_forward: x_stride must be at least C");
  if (T == 0) return;
  const int64_t past = W - 1;
  // Channels in blocks so each thread streams its own columns; the work is tiny per element.
  constexpr int64_t kBlock = 256;
  const int64_t blocks = (C + kBlock - 1) / kBlock;
  parallel_for(
      blocks,
      [&](int64_t b) {
        const int64_t c0 = b * kBlock, c1 = std::min(C, c0 + kBlock);
        // Input at time index s (s < 0 reads the state: s = -1 is its last row).
        auto input = [&](int64_t s, int64_t c) {
          return s >= 0 ? x[s * x_stride + c] : state[(past + s) * C + c];
        };
        for (int64_t t = 0; t < T; ++t) {
          float* yt = y + t * C;
          for (int64_t c = c0; c < c1; ++c) {
            const float* w = weight + c * W;
            float acc = 0.0f;
            for (int64_t j = 0; j < W; ++j) acc += w[j] * input(t - past + j, c);
            yt[c] = silu(acc);
          }
        }
        // New state: the last W - 1 inputs (from x, or the old state when T < W - 1).
        for (int64_t r = 0; r < past; ++r) {
          const int64_t s = T - past + r;
          for (int64_t c = c0; c < c1; ++c) {
            state[r * C + c] = s >= 0 ? x[s * x_stride + c] : state[(past + s) * C + c];
          }
        }
      },
      double(T * kBlock * W * 2));
}

void short_conv_silu_decode_step(const float* x, int64_t C, const float* weight, int64_t W,
                                 float* state, float* y) {
  check_sizes(1, C, W, "short_conv_silu_decode_step");
  const int64_t past = W - 1;
  for (int64_t c = 0; c < C; ++c) {
    const float* w = weight + c * W;
    const float xc = x[c];
    float acc = 0.0f;  // in the prefill's order
    for (int64_t j = 0; j < past; ++j) acc += w[j] * state[j * C + c];
    acc += w[past] * xc;
    // Shift the window by one token (row 0 is the oldest).
    for (int64_t j = 0; j + 1 < past; ++j) state[j * C + c] = state[(j + 1) * C + c];
    if (past > 0) state[(past - 1) * C + c] = xc;
    y[c] = silu(acc);
  }
}

}  // namespace kda::ops
