// Tensors: a shape, a dtype and bytes. `Tensor` owns its (64-byte aligned) storage;
// `TensorView` points into storage owned elsewhere (a mapped file, a Tensor).
// Layout is row-major and contiguous unless strides say otherwise.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace kda {

using Shape = std::vector<int64_t>;

int64_t shape_numel(const Shape& shape);
std::string shape_string(const Shape& shape);  // "[2, 3, 4]"
std::vector<int64_t> contiguous_strides(const Shape& shape);

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Shape shape;
  std::vector<int64_t> strides;  // in elements

  int64_t numel() const { return shape_numel(shape); }
  int64_t dim(int i) const { return shape.at(i < 0 ? shape.size() + i : i); }
  int rank() const { return int(shape.size()); }
  bool is_contiguous() const { return strides == contiguous_strides(shape); }
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype); }

  template <class T>
  T* as() const {
    return static_cast<T*>(data);
  }
};

class Tensor {
 public:
  Tensor() = default;
  Tensor(DType dtype, Shape shape);
  static Tensor zeros(DType dtype, Shape shape) { return Tensor(dtype, std::move(shape)); }
  static Tensor filled(Shape shape, float value);  // f32

  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const { return shape_.at(i < 0 ? shape_.size() + i : i); }
  int rank() const { return int(shape_.size()); }
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype_); }
  bool empty() const { return numel() == 0 || !storage_; }

  void* raw() { return storage_.get(); }
  const void* raw() const { return storage_.get(); }
  template <class T>
  T* data() {
    return static_cast<T*>(raw());
  }
  template <class T>
  const T* data() const {
    return static_cast<const T*>(raw());
  }
  float* f32() { return data<float>(); }
  const float* f32() const { return data<float>(); }
  std::span<float> span_f32() { return {f32(), size_t(numel())}; }
  std::span<const float> span_f32() const { return {f32(), size_t(numel())}; }

  TensorView view() const;
  Tensor reshaped(Shape shape) const&;  // copy with a new shape of the same numel
  void reshape(Shape shape);            // in place, same numel

  // Converting copies; sources may be any floating dtype (and integers for f64).
  static Tensor from_view_as(const TensorView& v, DType dtype);
  Tensor to(DType dtype) const { return from_view_as(view(), dtype); }

 private:
  struct FreeAligned {
    void operator()(std::byte* p) const;
  };
  DType dtype_ = DType::f32;
  Shape shape_;
  std::shared_ptr<std::byte> storage_;
};

// Reads element i (flat, contiguous) of any floating or integer dtype as double.
double element_as_double(const void* data, DType dtype, int64_t i);

}  // namespace kda
