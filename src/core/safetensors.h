// safetensors files: an 8-byte little-endian header length, a JSON header, then raw data.
// Reading maps the file and validates the whole header before handing out any view;
// writing is atomic (temp file, fsync, rename), so a crash never leaves half a file.
#pragma once
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace kda {

class SafetensorsFile {
 public:
  // Throws kda::Error naming the file and the first problem found.
  static SafetensorsFile open(const std::string& path);

  const std::string& path() const { return path_; }
  bool contains(const std::string& name) const { return entries_.count(name) != 0; }
  std::vector<std::string> names() const;  // sorted
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // The whole mapped file, header included; every view points inside it.
  std::span<const std::byte> file_bytes() const;

  // A view into the mapped file; valid while this object (or a copy) lives.
  TensorView view(const std::string& name) const;
  // An owning copy converted to `dtype`.
  Tensor load(const std::string& name, DType dtype = DType::f32) const;

 private:
  struct Entry {
    DType dtype;
    Shape shape;
    size_t begin, end;  // within the data section
  };
  struct Mapping;
  std::string path_;
  std::shared_ptr<Mapping> mapping_;
  const std::byte* data_ = nullptr;
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

struct NamedTensor {
  std::string name;
  const Tensor* tensor;
};

// Writes tensors (in the given order) and string metadata atomically to `path`.
void write_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Writes `bytes` to `path` atomically (temp file in the same folder, fsync, rename).
void write_file_atomic(const std::string& path, const std::string& bytes);

}  // namespace kda
