// Device memory owned by the host side of the engine: one cudaMalloc per buffer, freed by the
// destructor; movable, not copyable. Sizes in bytes; `as<T>()` views the memory as T.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <string>
#include <utility>

#include "core/error.h"

namespace kda::ops::cuda {

inline void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw kda::Error(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(status));
}

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) { resize(bytes); }
  ~DeviceBuffer() { release(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : ptr_(std::exchange(other.ptr_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      release();
      ptr_ = std::exchange(other.ptr_, nullptr);
      bytes_ = std::exchange(other.bytes_, 0);
    }
    return *this;
  }

  // Drops the old contents; a no-op when the size is unchanged.
  void resize(size_t bytes) {
    if (bytes == bytes_) return;
    release();
    if (bytes > 0) check_cuda(cudaMalloc(&ptr_, bytes), "cudaMalloc");
    bytes_ = bytes;
  }
  // Grows (dropping the contents) only when smaller than `bytes`.
  void reserve(size_t bytes) {
    if (bytes > bytes_) resize(bytes);
  }
  void upload(const void* host, size_t bytes, size_t offset = 0) {
    require(offset + bytes <= bytes_, "DeviceBuffer::upload: past the end");
    check_cuda(cudaMemcpy(static_cast<char*>(ptr_) + offset, host, bytes, cudaMemcpyHostToDevice),
               "cudaMemcpy (upload)");
  }
  void download(void* host, size_t bytes, size_t offset = 0) const {
    require(offset + bytes <= bytes_, "DeviceBuffer::download: past the end");
    check_cuda(
        cudaMemcpy(host, static_cast<const char*>(ptr_) + offset, bytes, cudaMemcpyDeviceToHost),
        "cudaMemcpy (download)");
  }

  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void release() {
    if (ptr_) cudaFree(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace kda::ops::cuda
