#include "train/cuda/device_trainable.h"

#include <string>

#include "core/error.h"
#include "core/token_ids.h"
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

void DeviceTrainableModel::begin_step(const int32_t* inputs, const int32_t* targets, int64_t B,
                                      int64_t T, std::span<const int64_t> cu_seqlens, int64_t V,
                                      const std::string& what) {
  require(B >= 1 && T >= 1, what + ": B and T must be >= 1");
  document_segments(cu_seqlens, B, T, what);  // validates them
  cu_seqlens_.assign(cu_seqlens.begin(), cu_seqlens.end());
  require_token_ids({inputs, size_t(B * T)}, V, what);
  require_targets({targets, size_t(B * T)}, V, what);
}

StepResult DeviceTrainableModel::read_step_result(const k::DeviceBuffer& result,
                                                  const char* what) const {
  // read back after the backward is queued (a pageable copy would block the host until then)
  struct {
    float loss_sum;
    int32_t correct, scored;
  } host_result{};
  k::check_cuda(cudaMemcpyAsync(&host_result, result.data(), 12, cudaMemcpyDeviceToHost, stream_),
                "cudaMemcpyAsync (loss)");
  k::check_cuda(cudaStreamSynchronize(stream_), what);
  StepResult r;
  r.scored = host_result.scored;
  r.correct = host_result.correct;
  r.loss = host_result.scored > 0 ? double(host_result.loss_sum) / host_result.scored : 0.0;
  return r;
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
