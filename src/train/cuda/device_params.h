// The device side of a trainable model's parameters: for every host Param (name, shape, decay),
// an fp32 value, gradient and AdamW moments on the GPU, and for matrices a bf16 compute copy
// that the update refreshes. The host Params stay the model's face (names, checkpoints); push()
// and pull() move values between the two. DeviceAdamW is train::AdamW's update on these
// (train_cuda.h's adamw_step: the same formulas and order, fp32).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ops/common/device_buffer.h"
#include "ops/nn/cuda/train_cuda.h"
#include "train/adamw.h"
#include "train/trainable_model.h"

namespace kda::train::cuda {

class DeviceParams {
 public:
  struct Entry {
    Param* host = nullptr;
    int64_t n = 0;
    ops::cuda::DeviceBuffer value, grad, m, v, copy;  // copy: bf16, matrices only
    float* f() const { return value.as<float>(); }
    float* g() const { return grad.as<float>(); }
    // What the GEMMs read: the bf16 copy (matrices) or the fp32 value.
    const void* compute() const { return copy.data() ? copy.data() : value.data(); }
  };

  // Matrices (two or more dimensions) get a bf16 compute copy; moments start at zero.
  DeviceParams(std::vector<Param*> host, cudaStream_t stream);
  Entry& at(const std::string& name);
  const std::vector<std::unique_ptr<Entry>>& entries() const { return entries_; }

  void push();  // host values -> device values (and compute copies)
  void pull();  // device values -> host values
  void zero_grads();
  void reset_moments();
  void scale_grads(float s);
  // Host copies of the device gradients (checks).
  std::vector<float> gradient(const std::string& name);

  // One AdamW update from the device gradients (train::AdamW::step's formulas; `step` is the
  // 1-based update number), every parameter in three launches (AdamWMultiTensor). Returns the
  // gradient norm before clipping; throws kda::Error when it is not finite (nothing is updated
  // then).
  double adamw(const AdamWConfig& config, float lr, int64_t step);
  std::vector<std::pair<std::string, Tensor>> moments() const;
  void load_moments(const std::vector<std::pair<std::string, Tensor>>& tensors);

  cudaStream_t stream() const { return stream_; }

 private:
  cudaStream_t stream_;
  std::vector<std::unique_ptr<Entry>> entries_;
  std::map<std::string, Entry*> by_name_;
  std::unique_ptr<ops::cuda::AdamWMultiTensor> adamw_;  // made by the first adamw()
};

class DeviceAdamW final : public Optimizer {
 public:
  DeviceAdamW(DeviceParams& params, const AdamWConfig& config) : params_(params), config_(config) {}
  float lr_at(int64_t step) const override { return scheduled_lr(config_, step); }
  double step() override;
  int64_t steps_taken() const override { return step_; }
  std::vector<std::pair<std::string, Tensor>> state() const override { return params_.moments(); }
  void load_state(const std::vector<std::pair<std::string, Tensor>>& tensors,
                  int64_t step) override;

 private:
  DeviceParams& params_;
  AdamWConfig config_;
  int64_t step_ = 0;
};

}  // namespace kda::train::cuda
