// GPT-2 training on the GPU: train/hf_gpt2.cpp's forward and backward (learned positions,
// pre-LayerNorm causal attention and a gelu_new MLP, the head tied to the token embedding) and
// train/adamw.cpp's update, with fp32 master weights, gradients and moments on the device and
// the GEMMs in fp32 (exact) or bf16 (compute copies of the matrices, refreshed by the update).
// Activations of every layer are kept for the backward (no recomputation).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/gpt2_config.h"
#include "ops/common/device_buffer.h"
#include "ops/common/device_types.h"

namespace kda::model::cuda {

class Gpt2CudaTrainer {
 public:
  // A model folder (config.json + model.safetensors; names with or without "transformer.").
  Gpt2CudaTrainer(const std::string& folder, ops::cuda::ElementType type);
  // Random weights as train::Gpt2Trainable::from_config: N(0, initializer_range) matrices and
  // embeddings, c_proj weights / sqrt(2 n_layer), zero biases, LayerNorm weights 1.
  Gpt2CudaTrainer(const nlohmann::json& config, ops::cuda::ElementType type, uint64_t seed);
  ~Gpt2CudaTrainer();
  Gpt2CudaTrainer(const Gpt2CudaTrainer&) = delete;
  Gpt2CudaTrainer& operator=(const Gpt2CudaTrainer&) = delete;

  // Forward + backward of the mean next-token cross-entropy over B rows of T tokens (host ids
  // and targets [B, T]; target -1: not scored; positions restart at every row). Gradients are
  // overwritten (not accumulated across calls). Returns the mean loss (NaN if nothing scored).
  double step(const int32_t* ids, const int32_t* targets, int64_t B, int64_t T);
  // The last step's gradient of a parameter, host fp32 in the checkpoint's name and layout
  // (Conv1D weights [in, out]).
  std::vector<float> gradient(const std::string& hf_name) const;
  // A parameter's fp32 master value, likewise.
  std::vector<float> value(const std::string& hf_name) const;
  // Every parameter's checkpoint name, in a fixed order.
  std::vector<std::string> parameter_names() const;
  // One AdamW update from the last step's gradients (train::AdamW's formulas, beta1 0.9, beta2
  // 0.95, eps 1e-8; weight decay on matrices and embeddings only; clip_norm <= 0: no clipping).
  // Returns the gradient norm before clipping.
  double adamw(float lr, float weight_decay, float clip_norm);

  const Gpt2Config& config() const { return c_; }
  int64_t parameter_count() const;
  cudaStream_t stream() const { return stream_; }

 private:
  struct Param;
  struct Layer;
  struct Activations;
  void init(const nlohmann::json& config);
  Param* add(const std::string& name, int64_t rows, int64_t cols, bool conv1d, bool compute_copy);
  void ensure_activations(int64_t B, int64_t T);
  // A device array of parameter `hf_name` (its value or gradient) in the checkpoint's layout.
  std::vector<float> host_copy(const std::string& hf_name, bool grad) const;
  // dx, dW, db of y = x W^T + b (W [out, in]) given dy fp32 [rows, out]: dx [rows, in] of
  // dx_type (overwritten; nothing when dx is null); dW and db (when b is not null) accumulated.
  void linear_backward(int64_t rows, int64_t in, int64_t out, const float* dy, const void* x_c,
                       const Param& W, const Param* b, void* dx, ops::cuda::ElementType dx_type);

  Gpt2Config c_;
  ops::cuda::ElementType type_;
  std::string prefix_;
  cudaStream_t stream_ = nullptr;
  struct Engines;
  std::unique_ptr<Engines> engines_;
  std::vector<std::unique_ptr<Param>> params_;
  std::map<std::string, Param*> by_name_;
  std::vector<Layer> layers_;
  Param *wte_ = nullptr, *wpe_ = nullptr, *ln_f_w_ = nullptr, *ln_f_b_ = nullptr;
  std::unique_ptr<Activations> acts_;
  int64_t adam_steps_ = 0;
};

}  // namespace kda::model::cuda
