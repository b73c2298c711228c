// A Hugging Face model folder: config.json plus model.safetensors, or shards listed by
// model.safetensors.index.json. Weights stay memory-mapped; `load` converts one tensor
// (F32, BF16 or F16) to an owning fp32 Tensor after checking its shape.
#pragma once
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "core/safetensors.h"
#include "core/tensor.h"

namespace kda::model {

class ModelFolder {
 public:
  // `path`: the folder, or its config.json. Throws kda::Error naming the file or field.
  static ModelFolder open(const std::string& path);

  const std::string& dir() const { return dir_; }
  const nlohmann::json& config() const { return config_; }
  std::string model_type() const;  // config["model_type"]

  bool has(const std::string& name) const { return where_.count(name) != 0; }
  std::vector<std::string> names() const;  // sorted
  TensorView view(const std::string& name) const;
  // fp32 copy; throws naming the tensor if it is missing or its shape is not `shape`.
  Tensor load(const std::string& name, const Shape& shape) const;
  // Throws naming the first missing tensor, wrong shape, or tensor not in `expected`.
  void check_tensors(const std::map<std::string, Shape>& expected) const;
  // Total bytes of the mapped weights as stored.
  size_t stored_bytes() const;

 private:
  std::string dir_;
  nlohmann::json config_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, size_t> where_;  // tensor name -> index in files_
};

// Typed config access with clear errors: "config.json: field 'n_embd' missing / not an integer".
int64_t config_int(const nlohmann::json& config, const std::string& key);
int64_t config_int_or(const nlohmann::json& config, const std::string& key, int64_t fallback);
double config_double_or(const nlohmann::json& config, const std::string& key, double fallback);
bool config_bool_or(const nlohmann::json& config, const std::string& key, bool fallback);
std::string config_string_or(const nlohmann::json& config, const std::string& key,
                             const std::string& fallback);

}  // namespace kda::model
