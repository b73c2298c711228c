#include "model/model_folder.h"

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "core/error.h"

namespace kda::model {

namespace fs = std::filesystem;
using json = nlohmann::json;

static json read_json(const fs::path& path) {
  std::ifstream in(path);
  require(bool(in), path.string() + ": cannot open");
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    throw Error(path.string() + ": not valid JSON: " + e.what());
  }
}

ModelFolder ModelFolder::open(const std::string& path) {
  ModelFolder m;
  fs::path dir(path);
  if (fs::is_regular_file(dir) && dir.filename() == "config.json") dir = dir.parent_path();
  require(fs::is_directory(dir), path + ": not a model folder (no such directory)");
  m.dir_ = dir.string();
  m.config_ = read_json(dir / "config.json");
  require(m.config_.is_object(), (dir / "config.json").string() + ": not a JSON object");
  std::vector<std::string> shard_names;
  if (fs::exists(dir / "model.safetensors.index.json")) {
    const json index = read_json(dir / "model.safetensors.index.json");
    const std::string where = (dir / "model.safetensors.index.json").string();
    require(index.contains("weight_map") && index["weight_map"].is_object(),
            where + ": no weight_map object");
    std::map<std::string, std::string> tensor_to_shard;
    for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
      require(it.value().is_string(), where + ": weight_map['" + it.key() + "'] is not a string");
      const std::string shard = it.value().get<std::string>();
      require(shard.find('/') == std::string::npos && shard.find("..") == std::string::npos,
              where + ": shard name '" + shard + "' must be a plain file name");
      tensor_to_shard[it.key()] = shard;
      if (std::find(shard_names.begin(), shard_names.end(), shard) == shard_names.end())
        shard_names.push_back(shard);
    }
    for (const std::string& shard : shard_names) {
      require(fs::exists(dir / shard), where + " names shard '" + shard + "', which is missing");
    }
    std::map<std::string, size_t> shard_index;
    for (const std::string& shard : shard_names) {
      shard_index[shard] = m.files_.size();
      m.files_.push_back(
          std::make_shared<SafetensorsFile>(SafetensorsFile::open((dir / shard).string())));
    }
    for (const auto& [tensor, shard] : tensor_to_shard) {
      require(m.files_[shard_index[shard]]->contains(tensor),
              where + " puts '" + tensor + "' in " + shard + ", which does not hold it");
      m.where_[tensor] = shard_index[shard];
    }
  } else {
    require(fs::exists(dir / "model.safetensors"),
            m.dir_ + ": no model.safetensors or model.safetensors.index.json");
    m.files_.push_back(std::make_shared<SafetensorsFile>(
        SafetensorsFile::open((dir / "model.safetensors").string())));
    for (const std::string& name : m.files_[0]->names()) m.where_[name] = 0;
  }
  return m;
}

std::string ModelFolder::model_type() const {
  require(config_.contains("model_type") && config_["model_type"].is_string(),
          dir_ + "/config.json: no model_type string");
  return config_["model_type"].get<std::string>();
}

std::vector<std::string> ModelFolder::names() const {
  std::vector<std::string> out;
  for (const auto& [name, file] : where_) out.push_back(name);
  return out;
}

TensorView ModelFolder::view(const std::string& name) const {
  const auto it = where_.find(name);
  require(it != where_.end(), dir_ + ": the checkpoint has no tensor '" + name + "'");
  return files_[it->second]->view(name);
}

Tensor ModelFolder::load(const std::string& name, const Shape& shape) const {
  const TensorView v = view(name);
  require(v.shape == shape, dir_ + ": tensor '" + name + "' has shape " + shape_string(v.shape) +
                                ", expected " + shape_string(shape));
  require(v.dtype == DType::f32 || v.dtype == DType::bf16 || v.dtype == DType::f16,
          dir_ + ": tensor '" + name + "' has dtype " + std::string(dtype_name(v.dtype)) +
              "; weights must be F32, BF16 or F16");
  return Tensor::from_view_as(v, DType::f32);
}

void ModelFolder::check_tensors(const std::map<std::string, Shape>& expected) const {
  for (const auto& [name, shape] : expected) {
    require(has(name), dir_ + ": the checkpoint lacks tensor '" + name + "'");
    const TensorView v = view(name);
    require(v.shape == shape, dir_ + ": tensor '" + name + "' has shape " + shape_string(v.shape) +
                                  ", expected " + shape_string(shape));
  }
  for (const auto& [name, file] : where_) {
    require(expected.count(name) != 0,
            dir_ + ": unexpected tensor '" + name + "' for model_type " + model_type());
  }
}

size_t ModelFolder::stored_bytes() const {
  size_t total = 0;
  for (const auto& [name, file] : where_) total += files_[file]->view(name).nbytes();
  return total;
}

static const json& field(const json& config, const std::string& key) {
  require(config.contains(key), "config.json: field '" + key + "' is missing");
  return config[key];
}

int64_t config_int(const json& config, const std::string& key) {
  const json& v = field(config, key);
  require(v.is_number_integer(), "config.json: field '" + key + "' is not an integer");
  return v.get<int64_t>();
}

int64_t config_int_or(const json& config, const std::string& key, int64_t fallback) {
  if (!config.contains(key) || config[key].is_null()) return fallback;
  return config_int(config, key);
}

double config_double_or(const json& config, const std::string& key, double fallback) {
  if (!config.contains(key) || config[key].is_null()) return fallback;
  require(config[key].is_number(), "config.json: field '" + key + "' is not a number");
  return config[key].get<double>();
}

bool config_bool_or(const json& config, const std::string& key, bool fallback) {
  if (!config.contains(key) || config[key].is_null()) return fallback;
  require(config[key].is_boolean(), "config.json: field '" + key + "' is not true/false");
  return config[key].get<bool>();
}

std::string config_string_or(const json& config, const std::string& key,
                             const std::string& fallback) {
  if (!config.contains(key) || config[key].is_null()) return fallback;
  require(config[key].is_string(), "config.json: field '" + key + "' is not a string");
  return config[key].get<std::string>();
}

}  // namespace kda::model
