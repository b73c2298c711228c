#include "train/cuda/gpt2_cuda_trainable.h"

#include <algorithm>
#include <map>
#include <string>

#include "core/error.h"
#include "train/adamw.h"

namespace kda::train::cuda {

namespace {

// The device trainer's AdamW (same formulas as train::AdamW) with the host optimizer's schedule
// and checkpoint format.
class Gpt2DeviceAdamW final : public Optimizer {
 public:
  Gpt2DeviceAdamW(model::cuda::Gpt2CudaTrainer& device, std::vector<Param*> params,
                  const AdamWConfig& config)
      : device_(device), params_(std::move(params)), config_(config) {}
  float lr_at(int64_t step) const override { return scheduled_lr(config_, step); }
  double step() override {
    const double norm = device_.adamw(lr_at(device_.adam_steps()), config_.weight_decay,
                                      config_.clip_norm, config_.beta1, config_.beta2, config_.eps);
    return norm;
  }
  int64_t steps_taken() const override { return device_.adam_steps(); }
  std::vector<std::pair<std::string, Tensor>> state() const override {
    std::vector<std::pair<std::string, Tensor>> out;
    for (const Param* p : params_)
      for (const bool first : {true, false}) {
        const std::vector<float> m = device_.moment(p->name, first);
        Tensor t(DType::f32, p->value.shape());
        std::copy(m.begin(), m.end(), t.f32());
        out.emplace_back((first ? "m." : "v.") + p->name, std::move(t));
      }
    return out;
  }
  void load_state(const std::vector<std::pair<std::string, Tensor>>& tensors,
                  int64_t step) override {
    std::map<std::string, const Tensor*> by_name;
    for (const auto& [name, t] : tensors) by_name[name] = &t;
    for (const Param* p : params_)
      for (const bool first : {true, false}) {
        const std::string name = (first ? "m." : "v.") + p->name;
        const auto it = by_name.find(name);
        require(it != by_name.end(), "optimizer state lacks '" + name + "'");
        require(it->second->shape() == p->value.shape(),
                "optimizer state '" + name + "' has the wrong shape");
        device_.set_moment(p->name, first, it->second->f32());
      }
    device_.set_adam_steps(step);
  }

 private:
  model::cuda::Gpt2CudaTrainer& device_;
  std::vector<Param*> params_;
  AdamWConfig config_;
};

}  // namespace

Gpt2CudaTrainable::Gpt2CudaTrainable(std::unique_ptr<Gpt2Trainable> host) : host_(std::move(host)) {
  const std::string first = host_->params().front()->name;  // "[transformer.]wte.weight"
  const std::string prefix = first.substr(0, first.size() - std::string("wte.weight").size());
  device_ = std::make_unique<model::cuda::Gpt2CudaTrainer>(host_->config(),
                                                           ops::cuda::ElementType::bf16, prefix);
  require(device_->parameter_names().size() == host_->params().size(),
          "gpt2 (cuda training): the GPU model does not hold the host model's parameters");
  push_values();
}

StepResult Gpt2CudaTrainable::forward_backward(const int32_t* inputs, const int32_t* targets,
                                               int64_t B, int64_t T, bool backward,
                                               std::span<const int64_t> cu_seqlens) {
  // gradients accumulate across calls, as TrainableModel's contract says (zero_grad clears)
  const model::cuda::Gpt2StepResult r =
      device_->run(inputs, targets, B, T, cu_seqlens, backward, true);
  StepResult out;
  out.loss = r.scored > 0 ? r.loss : 0.0;
  out.scored = r.scored;
  out.correct = r.correct;
  return out;
}

std::unique_ptr<Optimizer> Gpt2CudaTrainable::make_optimizer(const AdamWConfig& config) {
  require(config.lr > 0 && config.total_steps >= 1, "adamw: lr and total_steps must be positive");
  device_->reset_adam();  // a new optimizer starts fresh, as the host AdamW does
  return std::make_unique<Gpt2DeviceAdamW>(*device_, host_->params(), config);
}

void Gpt2CudaTrainable::pull_values() {
  for (Param* p : host_->params()) {
    const std::vector<float> v = device_->value(p->name);
    std::copy(v.begin(), v.end(), p->value.f32());
  }
}

void Gpt2CudaTrainable::push_values() {
  for (Param* p : host_->params()) device_->set_value(p->name, p->value.f32());
}

}  // namespace kda::train::cuda
