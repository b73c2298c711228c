#include "ops/nn/nn.h"

#include <algorithm>
#include <cmath>

#include <cblas.h>

#include "core/blas.h"

namespace kda::ops {
namespace {

// One token (decode): y = W x (+ y). GEMM would pack the whole weight matrix first, which
// costs more than the product; small matrices stay on this thread (waking OpenBLAS's threads
// for ~10K elements costs more than the work).
void matvec(const float* x, int64_t in, const float* W, int64_t out, bool accumulate, float* y) {
  constexpr int64_t kThreadedElements = int64_t(1) << 18;
  if (out * in < kThreadedElements) {
    for (int64_t o = 0; o < out; ++o) {
      const float* row = W + o * in;
      float dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < in; ++i) dot += row[i] * x[i];
      y[o] = (accumulate ? y[o] : 0.0f) + dot;
    }
    return;
  }
  cblas_sgemv(CblasRowMajor, CblasNoTrans, int(out), int(in), 1.0f, W, int(in), x, 1,
              accumulate ? 1.0f : 0.0f, y, 1);
}

}  // namespace

void linear(const float* x, int64_t T, int64_t in, const float* W, int64_t out, const float* bias,
            float* y) {
  if (T == 1) {
    if (bias) std::copy(bias, bias + out, y);
    matvec(x, in, W, out, bias != nullptr, y);
    return;
  }
  if (bias) {
    for (int64_t t = 0; t < T; ++t)
      for (int64_t o = 0; o < out; ++o) y[t * out + o] = bias[o];
  }
  gemm_nt(int(T), int(out), int(in), 1.0f, x, int(in), W, int(in), bias ? 1.0f : 0.0f, y, int(out));
}

void linear_accumulate(const float* x, int64_t T, int64_t in, const float* W, int64_t out,
                       float* y) {
  if (T == 1) return matvec(x, in, W, out, true, y);
  gemm_nt(int(T), int(out), int(in), 1.0f, x, int(in), W, int(in), 1.0f, y, int(out));
}

void layer_norm(const float* x, int64_t rows, int64_t D, const float* weight, const float* bias,
                float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    double mean = 0, var = 0;
    for (int64_t i = 0; i < D; ++i) mean += xr[i];
    mean /= double(D);
    for (int64_t i = 0; i < D; ++i) var += (xr[i] - mean) * (xr[i] - mean);
    var /= double(D);
    const float inv = float(1.0 / std::sqrt(var + eps));
    for (int64_t i = 0; i < D; ++i) {
      const float n = float(xr[i] - mean) * inv;
      y[r * D + i] = n * (weight ? weight[i] : 1.0f) + (bias ? bias[i] : 0.0f);
    }
  }
}

void rms_norm(const float* x, int64_t rows, int64_t D, const float* weight, float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    double ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += double(xr[i]) * xr[i];
    const float inv = float(1.0 / std::sqrt(ss / double(D) + eps));
    for (int64_t i = 0; i < D; ++i) y[r * D + i] = xr[i] * inv * (weight ? weight[i] : 1.0f);
  }
}

void gelu_tanh(float* x, int64_t n) {
  const float c = 0.7978845608028654f;  // sqrt(2 / pi)
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    x[i] = 0.5f * v * (1.0f + std::tanh(c * (v + 0.044715f * v * v * v)));
  }
}

void silu(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] / (1.0f + std::exp(-x[i]));
}

}  // namespace kda::ops
