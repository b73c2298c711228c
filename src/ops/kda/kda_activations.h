// The elementwise activations of a KDA layer (forward and backward), shared by the float64
// reference and the fp32 path.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "ops/kda/kda.h"

namespace kda::ops::detail {

constexpr double kL2NormEps = 1e-6;  // torch.nn.functional.normalize's default

// torch's softplus (beta 1, threshold 20)
template <class F>
F softplus(F x) {
  return x > F(20) ? x : std::log1p(std::exp(x));
}
template <class F>
F sigmoid(F x) {
  return F(1) / (F(1) + std::exp(-x));
}

// y = x / max(|x|, eps) over rows of width D
template <class F>
void l2norm_rows(const F* x, int64_t rows, int64_t D, F* y) {
  for (int64_t r = 0; r < rows; ++r) {
    F n2 = 0;
    for (int64_t i = 0; i < D; ++i) n2 += x[r * D + i] * x[r * D + i];
    const F inv = F(1) / std::max(std::sqrt(n2), F(kL2NormEps));
    for (int64_t i = 0; i < D; ++i) y[r * D + i] = x[r * D + i] * inv;
  }
}

// dx from dy for y = x / max(|x|, eps): (dy - y (y . dy)) / |x| above eps, dy / eps below.
template <class F>
void l2norm_rows_backward(const F* x, const F* dy, int64_t rows, int64_t D, F* dx) {
  for (int64_t r = 0; r < rows; ++r) {
    F n2 = 0;
    for (int64_t i = 0; i < D; ++i) n2 += x[r * D + i] * x[r * D + i];
    const F norm = std::sqrt(n2);
    if (norm <= F(kL2NormEps)) {
      for (int64_t i = 0; i < D; ++i) dx[r * D + i] = dy[r * D + i] / F(kL2NormEps);
      continue;
    }
    F dot = 0;
    for (int64_t i = 0; i < D; ++i) dot += x[r * D + i] * dy[r * D + i];
    const F inv = F(1) / norm;
    for (int64_t i = 0; i < D; ++i) {
      dx[r * D + i] = (dy[r * D + i] - x[r * D + i] * inv * inv * dot) * inv;
    }
  }
}

// g [tokens, HV, K] from graw; see KdaGate.
template <class F>
void kda_gate_forward(const KdaOptions& opt, const F* graw, const F* A_log, const F* dt_bias,
                      int64_t tokens, int64_t HV, int64_t K, F* g) {
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t hv = 0; hv < HV; ++hv) {
      const F a = std::exp(A_log[hv]);
      for (int64_t c = 0; c < K; ++c) {
        const int64_t i = (t * HV + hv) * K + c;
        const F x = graw[i] + dt_bias[hv * K + c];
        g[i] =
            opt.gate == KdaGate::softplus ? -a * softplus(x) : F(opt.lower_bound) * sigmoid(a * x);
      }
    }
}

// Accumulates dA_log and ddt_bias (which the caller zeroes) and writes dgraw.
template <class F>
void kda_gate_backward(const KdaOptions& opt, const F* graw, const F* A_log, const F* dt_bias,
                       const F* dg, int64_t tokens, int64_t HV, int64_t K, F* dgraw, F* dA_log,
                       F* ddt_bias) {
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t hv = 0; hv < HV; ++hv) {
      const F a = std::exp(A_log[hv]);
      F dA = 0;
      for (int64_t c = 0; c < K; ++c) {
        const int64_t i = (t * HV + hv) * K + c;
        const F x = graw[i] + dt_bias[hv * K + c];
        F dx;
        if (opt.gate == KdaGate::softplus) {
          // g = -a softplus(x): dg/dx = -a sigmoid(x), dg/dA_log = g
          dx = -a * sigmoid(x) * dg[i];
          dA += -a * softplus(x) * dg[i];
        } else {
          // g = lb sigmoid(a x): dg/dx = lb s (1 - s) a, dg/dA_log = lb s (1 - s) a x
          const F s = sigmoid(a * x);
          const F ds = F(opt.lower_bound) * s * (F(1) - s) * dg[i];
          dx = ds * a;
          dA += ds * a * x;
        }
        dgraw[i] = dx;
        ddt_bias[hv * K + c] += dx;
      }
      dA_log[hv] += dA;
    }
}

}  // namespace kda::ops::detail
