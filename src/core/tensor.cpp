#include "core/tensor.h"

#include <cstdlib>
#include <cstring>
#include <sstream>

#include "core/error.h"

namespace kda {

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_string(const Shape& shape) {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << ']';
  return out.str();
}

std::vector<int64_t> contiguous_strides(const Shape& shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= shape[i];
  }
  return strides;
}

void Tensor::FreeAligned::operator()(std::byte* p) const {
  std::free(p);
}

Tensor::Tensor(DType dtype, Shape shape) : dtype_(dtype), shape_(std::move(shape)) {
  for (int64_t d : shape_) require(d >= 0, "tensor dimension is negative: " + shape_string(shape_));
  const size_t bytes = nbytes();
  const size_t padded = (bytes + 63) / 64 * 64 + 64;
  auto* p = static_cast<std::byte*>(std::aligned_alloc(64, padded));
  if (!p) throw Error("out of memory allocating " + std::to_string(bytes) + " bytes");
  std::memset(p, 0, padded);
  storage_ = std::shared_ptr<std::byte>(p, FreeAligned{});
}

Tensor Tensor::filled(Shape shape, float value) {
  Tensor t(DType::f32, std::move(shape));
  for (float& x : t.span_f32()) x = value;
  return t;
}

TensorView Tensor::view() const {
  return TensorView{const_cast<void*>(raw()), dtype_, shape_, contiguous_strides(shape_)};
}

Tensor Tensor::reshaped(Shape shape) const& {
  Tensor t = to(dtype_);
  t.reshape(std::move(shape));
  return t;
}

void Tensor::reshape(Shape shape) {
  require(shape_numel(shape) == numel(),
          "cannot reshape " + shape_string(shape_) + " to " + shape_string(shape));
  shape_ = std::move(shape);
}

double element_as_double(const void* data, DType dtype, int64_t i) {
  const auto* b = static_cast<const std::byte*>(data);
  switch (dtype) {
    case DType::f32: {
      float f;
      std::memcpy(&f, b + 4 * i, 4);
      return f;
    }
    case DType::f64: {
      double d;
      std::memcpy(&d, b + 8 * i, 8);
      return d;
    }
    case DType::bf16: {
      uint16_t h;
      std::memcpy(&h, b + 2 * i, 2);
      return bf16_to_f32(h);
    }
    case DType::f16: {
      uint16_t h;
      std::memcpy(&h, b + 2 * i, 2);
      return f16_to_f32(h);
    }
    case DType::i64: {
      int64_t v;
      std::memcpy(&v, b + 8 * i, 8);
      return double(v);
    }
    case DType::i32: {
      int32_t v;
      std::memcpy(&v, b + 4 * i, 4);
      return double(v);
    }
    case DType::i8:
      return double(int8_t(b[i]));
    case DType::u8:
    case DType::boolean:
      return double(uint8_t(b[i]));
  }
  return 0;
}

Tensor Tensor::from_view_as(const TensorView& v, DType dtype) {
  require(v.is_contiguous(), "cannot convert a non-contiguous view");
  Tensor out(dtype, v.shape);
  const int64_t n = v.numel();
  if (v.dtype == dtype) {
    if (n) std::memcpy(out.raw(), v.data, v.nbytes());
    return out;
  }
  for (int64_t i = 0; i < n; ++i) {
    const double x = element_as_double(v.data, v.dtype, i);
    switch (dtype) {
      case DType::f32:
        out.data<float>()[i] = float(x);
        break;
      case DType::f64:
        out.data<double>()[i] = x;
        break;
      case DType::bf16:
        out.data<uint16_t>()[i] = f32_to_bf16(float(x));
        break;
      case DType::f16:
        out.data<uint16_t>()[i] = f32_to_f16(float(x));
        break;
      case DType::i64:
        out.data<int64_t>()[i] = int64_t(x);
        break;
      case DType::i32:
        out.data<int32_t>()[i] = int32_t(x);
        break;
      default:
        throw Error("conversion to " + std::string(dtype_name(dtype)) + " not supported");
    }
  }
  return out;
}

}  // namespace kda
