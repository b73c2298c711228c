// model_type -> architecture: the one place that knows every supported model.
#include <string>

#include "core/error.h"
#include "model/causal_lm.h"
#include "model/gpt2.h"
#include "model/kimi_linear.h"
#include "model/model_folder.h"

namespace kda::model {

namespace {

// `where` names the config in messages: "config.json" or "DIR/config.json".
std::string model_type_of(const nlohmann::json& config, const std::string& where) {
  require(config.is_object(), where + ": not a JSON object");
  require(config.contains("model_type") && config["model_type"].is_string(),
          where + ": no model_type string");
  return config["model_type"].get<std::string>();
}

[[noreturn]] void unknown_type(const std::string& type, const std::string& where) {
  throw Error(where + ": model_type '" + type +
              "' is not supported (supported: gpt2, kimi_linear)");
}

}  // namespace

ArchitectureInfo describe_config(const nlohmann::json& config) {
  const std::string type = model_type_of(config, "config.json");
  if (type == "gpt2") return describe_gpt2(config);
  if (type == "kimi_linear") return describe_kimi_linear(config);
  unknown_type(type, "config.json");
}

std::unique_ptr<CausalLM> load_causal_lm(const std::string& path) {
  const ModelFolder folder = ModelFolder::open(path);
  const std::string where = folder.dir() + "/config.json";
  const std::string type = model_type_of(folder.config(), where);
  if (type == "gpt2") return load_gpt2(folder);
  if (type == "kimi_linear") return load_kimi_linear(folder);
  unknown_type(type, where);
}

}  // namespace kda::model
