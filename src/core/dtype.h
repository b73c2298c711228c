// Element types of tensors and files, with their safetensors names.
#pragma once
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace kda {

enum class DType { f32, f64, bf16, f16, i64, i32, i8, u8, boolean };

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);  // safetensors spelling: "F32", "BF16", ...
std::optional<DType> dtype_from_name(std::string_view name);

// bf16 and fp16 conversions (round to nearest even on the way down).
inline float bf16_to_f32(uint16_t bits) {
  uint32_t u = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

float f16_to_f32(uint16_t bits);
uint16_t f32_to_f16(float f);

}  // namespace kda
