// What the GPU training checks (kda_gpu_train) share: the relative error of a device result
// against the CPU reference, ||x - ref|| / ||ref|| (absolute when ref is zero); a non-finite
// value anywhere makes it infinite, so NaN never passes.
#pragma once
#include <cmath>
#include <cstddef>

inline double rel_error(const float* x, const float* ref, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) return INFINITY;
    num += (double(x[i]) - ref[i]) * (double(x[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}
