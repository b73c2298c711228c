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

void gated_rms_norm_sigmoid_backward(const float* x, const float* gate, int64_t rows, int64_t D,
                                     const float* weight, float eps, const float* dy, float* dx,
                                     float* dgate, float* dweight) {
  require(rows >= 0 && D >= 1, "gated_rms_norm_sigmoid_backward: sizes must be positive");
  require(x && gate && weight && dy && dx && dgate && dweight,
          "gated_rms_norm_sigmoid_backward: null pointer");
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    const float* gr = gate + r * D;
    const float* dyr = dy + r * D;
    double ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += double(xr[i]) * xr[i];
    const float inv = float(1.0 / std::sqrt(ss / double(D) + eps));
    // n = x inv; dn = dy w s; dx = inv (dn - n mean(dn n))
    double dot = 0;
    for (int64_t i = 0; i < D; ++i) {
      const float s = 1.0f / (1.0f + std::exp(-gr[i]));
      const float n = xr[i] * inv;
      const float dn = dyr[i] * weight[i] * s;
      dot += double(dn) * n;
      dweight[i] += dyr[i] * n * s;
      dgate[r * D + i] = dyr[i] * weight[i] * n * s * (1.0f - s);
    }
    const float mean = float(dot / double(D));
    for (int64_t i = 0; i < D; ++i) {
      const float s = 1.0f / (1.0f + std::exp(-gr[i]));
      const float n = xr[i] * inv;
      dx[r * D + i] = inv * (dyr[i] * weight[i] * s - n * mean);
    }
  }
}

void l2_normalize_rows_backward(const float* x, int64_t rows, int64_t D, float eps, const float* dy,
                                float* dx) {
  require(rows >= 0 && D >= 1, "l2_normalize_rows_backward: sizes must be positive");
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    double ss = 0, dot = 0;
    for (int64_t i = 0; i < D; ++i) {
      ss += double(xr[i]) * xr[i];
      dot += double(xr[i]) * dy[r * D + i];
    }
    const double inv = 1.0 / std::sqrt(ss + eps);
    const float c = float(dot * inv * inv * inv);
    for (int64_t i = 0; i < D; ++i) dx[r * D + i] = float(inv) * dy[r * D + i] - xr[i] * c;
  }
}

}  // namespace kda::ops
