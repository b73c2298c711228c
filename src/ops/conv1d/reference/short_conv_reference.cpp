// float64 ground truth of the causal short convolution + SiLU: the input history laid out as
// [state; x] and convolved directly.
#include <cmath>
#include <vector>

#include "core/error.h"
#include "ops/conv1d/conv1d.h"

namespace kda::ops {

void short_conv_silu_reference(const double* x, int64_t T, int64_t C, const double* weight,
                               int64_t W, double* state, double* y) {
  require(T >= 0 && C >= 1 && W >= 1, "short_conv_silu_reference: sizes must be positive");
  const int64_t past = W - 1;
  std::vector<double> history((past + T) * C);
  for (int64_t i = 0; i < past * C; ++i) history[i] = state[i];
  for (int64_t i = 0; i < T * C; ++i) history[past * C + i] = x[i];
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < C; ++c) {
      double acc = 0;
      for (int64_t j = 0; j < W; ++j) acc += weight[c * W + j] * history[(t + j) * C + c];
      y[t * C + c] = acc / (1.0 + std::exp(-acc));
    }
  for (int64_t i = 0; i < past * C; ++i) state[i] = history[T * C + i];
}

}  // namespace kda::ops
