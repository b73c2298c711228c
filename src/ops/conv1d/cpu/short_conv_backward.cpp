// fp32 backward of the causal short convolution + SiLU (zero initial state).
//   a[t, c] = sum_j w[c, j] x[t - (W - 1) + j, c],  y = silu(a)
//   da = dy * silu'(a);  dx[s, c] = sum_j w[c, j] da[s + (W - 1) - j, c];
//   dw[c, j] += sum_t da[t, c] x[t - (W - 1) + j, c]
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "ops/conv1d/conv1d.h"

namespace kda::ops {

void short_conv_silu_backward(const float* x, int64_t T, int64_t C, int64_t x_stride,
                              const float* weight, int64_t W, const float* dy, float* dx,
                              int64_t dx_stride, float* dweight) {
  require(T >= 0 && C >= 1 && W >= 1, "short_conv_silu_backward: sizes must be positive");
  require(x_stride >= C && dx_stride >= C, "short_conv_silu_backward: strides must be >= C");
  if (T == 0) return;
  const int64_t past = W - 1;
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (C + kBlock - 1) / kBlock;
  parallel_for(
      blocks,
      [&](int64_t b) {
        const int64_t c0 = b * kBlock, c1 = std::min(C, c0 + kBlock), n = c1 - c0;
        auto input = [&](int64_t s, int64_t c) { return s >= 0 ? x[s * x_stride + c] : 0.0f; };
        std::vector<float> da(size_t(T * n));
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t c = c0; c < c1; ++c) {
            const float* w = weight + c * W;
            float a = 0.0f;
            for (int64_t j = 0; j < W; ++j) a += w[j] * input(t - past + j, c);
            const float s = 1.0f / (1.0f + std::exp(-a));
            da[t * n + (c - c0)] = dy[t * C + c] * s * (1.0f + a * (1.0f - s));
          }
        }
        for (int64_t s = 0; s < T; ++s) {
          for (int64_t c = c0; c < c1; ++c) {
            const float* w = weight + c * W;
            float acc = 0.0f;
            for (int64_t j = 0; j < W; ++j) {
              const int64_t t = s + past - j;
              if (t < T) acc += w[j] * da[t * n + (c - c0)];
            }
            dx[s * dx_stride + c] = acc;
          }
        }
        // dw in time order, contiguous channels innermost (da and x rows are contiguous)
        std::vector<double> dw(size_t(n * W), 0.0);
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t j = 0; j < W; ++j) {
            const int64_t s = t - past + j;
            if (s < 0) continue;
            const float* xs = x + s * x_stride + c0;
            const float* dat = da.data() + t * n;
            for (int64_t c = 0; c < n; ++c) dw[size_t(c * W + j)] += double(dat[c]) * xs[c];
          }
        }
        for (int64_t c = 0; c < n; ++c)
          for (int64_t j = 0; j < W; ++j) dweight[(c0 + c) * W + j] += float(dw[size_t(c * W + j)]);
      },
      double(T * kBlock * W * 6));
}

}  // namespace kda::ops
