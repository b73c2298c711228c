// float64 MLA: expand every key and value through kv_b, then plain causal softmax attention.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "ops/mla/mla.h"

namespace kda::ops {

double MlaShape::effective_scale() const {
  return scale != 0 ? scale : 1.0 / std::sqrt(double(nope + rope));
}

void MlaShape::validate() const {
  require(H >= 1 && nope >= 1 && rope >= 0 && v >= 1 && latent >= 1,
          "mla: head counts and dims must be positive (rope may be 0)");
  require(std::isfinite(effective_scale()), "mla: scale must be finite");
}

void mla_reference(const MlaShape& s, const double* q, int64_t T, const double* rows, int64_t past,
                   const double* kv_b, double* o) {
  s.validate();
  const int64_t keys = past + T, L = s.latent, W = s.row_width(), kv_w = s.nope + s.v;
  const double scale = s.effective_scale();
  std::vector<double> k(keys * s.qk_dim()), val(keys * s.v), p(keys);
  for (int64_t h = 0; h < s.H; ++h) {
    for (int64_t j = 0; j < keys; ++j) {
      const double* c = rows + j * W;
      for (int64_t i = 0; i < kv_w; ++i) {
        const double* w = kv_b + (h * kv_w + i) * L;
        double acc = 0;
        for (int64_t l = 0; l < L; ++l) acc += w[l] * c[l];
        if (i < s.nope) {
          k[j * s.qk_dim() + i] = acc;
        } else {
          val[j * s.v + i - s.nope] = acc;
        }
      }
      for (int64_t r = 0; r < s.rope; ++r) k[j * s.qk_dim() + s.nope + r] = c[L + r];
    }
    for (int64_t t = 0; t < T; ++t) {
      const double* qt = q + (t * s.H + h) * s.qk_dim();
      const int64_t visible = past + t + 1;
      double mx = -INFINITY;
      for (int64_t j = 0; j < visible; ++j) {
        double dot = 0;
        for (int64_t i = 0; i < s.qk_dim(); ++i) dot += qt[i] * k[j * s.qk_dim() + i];
        p[j] = dot * scale;
        mx = std::max(mx, p[j]);
      }
      double sum = 0;
      for (int64_t j = 0; j < visible; ++j) sum += (p[j] = std::exp(p[j] - mx));
      double* ot = o + (t * s.H + h) * s.v;
      for (int64_t i = 0; i < s.v; ++i) {
        double acc = 0;
        for (int64_t j = 0; j < visible; ++j) acc += p[j] * val[j * s.v + i];
        ot[i] = acc / sum;
      }
    }
  }
}

}  // namespace kda::ops
