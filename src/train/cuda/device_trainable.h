// What the GPU trainable models share (LineageCudaModel, KimiCudaModel): a CUDA stream, the
// parameters on the device (DeviceParams: fp32 values, gradients and AdamW moments, bf16
// compute copies) and the TrainableModel calls that touch only those.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "train/cuda/device_params.h"
#include "train/trainable_model.h"

namespace kda::train::cuda {

class DeviceTrainableModel : public TrainableModel {
 public:
  ~DeviceTrainableModel() override;  // after the derived model has freed its buffers

  void zero_grad() override;
  void scale_grads(float s) override;
  // A new optimizer starts with zero moments, as the host AdamW does.
  std::unique_ptr<Optimizer> make_optimizer(const AdamWConfig& config) override;
  void pull_values() override;
  void push_values() override;

  // Host copies of a parameter's device gradient and value (checks).
  std::vector<float> gradient(const std::string& name);
  std::vector<float> value(const std::string& name);

 protected:
  DeviceTrainableModel();  // creates the stream; the derived model then fills params_
  // Waits for the stream (a derived model's destructor, before its buffers go).
  void synchronize() const;
  // The checks at the top of forward_backward: B, T >= 1, valid documents (kept in
  // cu_seqlens_), every input id in [0, V) and every target in [-1, V) (-1: not scored).
  void begin_step(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                  std::span<const int64_t> cu_seqlens, int64_t V, const std::string& what);
  // The step's {loss sum, correct, scored} (a device float and two int32s), read back after the
  // queued work; waits for the stream. `what` names the model in errors.
  StepResult read_step_result(const ops::cuda::DeviceBuffer& result, const char* what) const;

  cudaStream_t stream_ = nullptr;
  std::unique_ptr<DeviceParams> params_;
  std::vector<int64_t> cu_seqlens_;  // this call's packed documents (empty: B rows of T)
};

}  // namespace kda::train::cuda
