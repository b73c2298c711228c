// fp32 sigmoid-gated RMSNorm and the rsqrt(sum + eps) L2 normalisation.
#include <cmath>

#include "core/error.h"
#include "ops/norm/norm.h"

namespace kda::ops {

void gated_rms_norm_sigmoid(const float* x, const float* gate, int64_t rows, int64_t D,
                            const float* weight, float eps, float* y) {
  require(rows >= 0 && D >= 1, "gated_rms_norm_sigmoid: sizes must be positive");
  require(x && gate && weight && y, "gated_rms_norm_sigmoid: null pointer");
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    const float* gr = gate + r * D;
    float* yr = y + r * D;
    double ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += double(xr[i]) * xr[i];
    const float inv = float(1.0 / std::sqrt(ss / double(D) + eps));
    for (int64_t i = 0; i < D; ++i) {
      yr[i] = weight[i] * (xr[i] * inv) / (1.0f + std::exp(-gr[i]));
    }
  }
}

void l2_normalize_rows(const float* x, int64_t rows, int64_t D, float eps, float* y) {
  require(rows >= 0 && D >= 1, "l2_normalize_rows: sizes must be positive");
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    double ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += double(xr[i]) * xr[i];
    const float inv = float(1.0 / std::sqrt(ss + eps));
    for (int64_t i = 0; i < D; ++i) y[r * D + i] = xr[i] * inv;
  }
}

}  // namespace kda::ops
