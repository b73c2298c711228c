#include "core/dtype.h"

#include <cmath>

namespace kda {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f64:
    case DType::i64:
      return 8;
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::bf16:
    case DType::f16:
      return 2;
    case DType::i8:
    case DType::u8:
    case DType::boolean:
      return 1;
  }
  return 0;
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "F32";
    case DType::f64:
      return "F64";
    case DType::bf16:
      return "BF16";
    case DType::f16:
      return "F16";
    case DType::i64:
      return "I64";
    case DType::i32:
      return "I32";
    case DType::i8:
      return "I8";
    case DType::u8:
      return "U8";
    case DType::boolean:
      return "BOOL";
  }
  return "?";
}

std::optional<DType> dtype_from_name(std::string_view name) {
  for (DType t : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i64, DType::i32,
                  DType::i8, DType::u8, DType::boolean}) {
    if (dtype_name(t) == name) return t;
  }
  return std::nullopt;
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const int exponent = (h >> 10) & 0x1f;
  const uint32_t mantissa = h & 0x3ffu;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(float(mantissa), -24);
  } else if (exponent == 31) {
    magnitude = mantissa ? NAN : INFINITY;
  } else {
    magnitude = std::ldexp(float(mantissa | 0x400u), exponent - 25);
  }
  uint32_t u;
  std::memcpy(&u, &magnitude, 4);
  u |= sign;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const float a = std::fabs(f);
  if (std::isnan(f)) return sign | 0x7e00u;
  if (a >= 65520.0f) return sign | 0x7c00u;
  if (a < std::ldexp(1.0f, -24) * 0.5f) return sign;
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  if (e < -13) {      // subnormal: units of 2^-24
    return sign | uint16_t(std::nearbyint(std::ldexp(a, 24)));
  }
  // normal: 11 significant bits
  const float scaled = std::nearbyint(std::ldexp(a, 11 - e));  // in [1024, 2048]
  uint32_t m = uint32_t(scaled);
  int exponent = e - 1 + 15;
  if (m == 2048) {
    m = 1024;
    exponent += 1;
  }
  if (exponent >= 31) return sign | 0x7c00u;
  return sign | uint16_t(exponent << 10) | uint16_t(m & 0x3ffu);
}

}  // namespace kda
