// What every CUDA entry point shares: the element type of a device array, and the RAII device
// buffer the host side of the engine holds its device memory in.
#pragma once
#include <cstddef>
#include <cstdint>

namespace kda::ops::cuda {

// bf16 arrays are __nv_bfloat16; arithmetic is fp32 either way.
enum class ElementType { f32, bf16 };

inline size_t element_bytes(ElementType t) {
  return t == ElementType::f32 ? 4 : 2;
}

}  // namespace kda::ops::cuda
