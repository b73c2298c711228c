// Branch-free elementwise math that the compiler vectorises (glibc's expf is a call per element).
#pragma once
#include <algorithm>
#include <bit>
#include <cstdint>

namespace kda {

// exp(x) within 2 ulp for x in [-87, 88] (Cephes' polynomial); clamped outside that range
// (about 1.6e-38 below, 1.7e38 above). NaN maps to the lower clamp: callers check finiteness.
inline float fast_exp(float x) {
  x = std::min(88.0f, std::max(-87.0f, x));
  const float rounder = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (x * 1.44269504088896341f + rounder) - rounder;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  // 2^n as two factors so that n = 128 (x near 88) stays representable
  const int32_t n_int = int32_t(n);
  const int32_t half = n_int / 2;
  const float a = std::bit_cast<float>((half + 127) << 23);
  const float b = std::bit_cast<float>((n_int - half + 127) << 23);
  return e * a * b;
}

}  // namespace kda
