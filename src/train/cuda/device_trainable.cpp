#include "train/cuda/device_trainable.h"

#include "core/error.h"
#include "ops/common/device_buffer.h"

namespace kda::train::cuda {

namespace k = ops::cuda;

DeviceTrainableModel::DeviceTrainableModel() {
  k::check_cuda(cudaStreamCreate(&stream_), "cudaStreamCreate");
}

DeviceTrainableModel::~DeviceTrainableModel() {
  synchronize();
  params_.reset();
  if (stream_) cudaStreamDestroy(stream_);
}

void DeviceTrainableModel::synchronize() const {
  if (stream_) cudaStreamSynchronize(stream_);
}

void DeviceTrainableModel::zero_grad() {
  params_->zero_grads();
}
void DeviceTrainableModel::scale_grads(float s) {
  params_->scale_grads(s);
}
void DeviceTrainableModel::pull_values() {
  params_->pull();
}
void DeviceTrainableModel::push_values() {
  params_->push();
}

std::unique_ptr<Optimizer> DeviceTrainableModel::make_optimizer(const AdamWConfig& config) {
  require(config.lr > 0 && config.total_steps >= 1, "adamw: lr and total_steps must be positive");
  params_->reset_moments();
  return std::make_unique<DeviceAdamW>(*params_, config);
}

std::vector<float> DeviceTrainableModel::gradient(const std::string& name) {
  return params_->gradient(name);
}

std::vector<float> DeviceTrainableModel::value(const std::string& name) {
  DeviceParams::Entry& e = params_->at(name);
  k::check_cuda(cudaStreamSynchronize(stream_), "device model: value");
  std::vector<float> v(static_cast<size_t>(e.n));
  e.value.download(v.data(), v.size() * 4);
  return v;
}

}  // namespace kda::train::cuda
