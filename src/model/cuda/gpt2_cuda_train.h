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
#include <span>
#include <string>
#include <vector>

#include "model/gpt2_config.h"
#include "ops/attention/cuda/attention_cuda.h"
#include "ops/common/device_buffer.h"
#include "ops/common/device_types.h"

namespace kda::model::cuda {

struct Gpt2StepResult {
  double loss = 0;  // mean over the scored targets (NaN if none)
  int64_t scored = 0, correct = 0;
};

class Gpt2CudaTrainer {
 public:
  // A model folder (config.json + model.safetensors; names with or without "transformer.").
  Gpt2CudaTrainer(const std::string& folder, ops::cuda::ElementType type);
  // Random weights as train::Gpt2Trainable::from_config: N(0, initializer_range) matrices and
  // embeddings, c_proj weights / sqrt(2 n_layer), zero biases, LayerNorm weights 1.
  Gpt2CudaTrainer(const nlohmann::json& config, ops::cuda::ElementType type, uint64_t seed);
  // Zero weights under the checkpoint names prefix + "wte.weight", ... (set_value fills them).
  Gpt2CudaTrainer(const nlohmann::json& config, ops::cuda::ElementType type,
                  const std::string& prefix);
  ~Gpt2CudaTrainer();
  Gpt2CudaTrainer(const Gpt2CudaTrainer&) = delete;
  Gpt2CudaTrainer& operator=(const Gpt2CudaTrainer&) = delete;

  // Forward + backward of the mean next-token cross-entropy over B rows of T tokens (host ids
  // and targets [B, T]; target -1: not scored; positions restart at every row). Gradients are
  // overwritten (not accumulated across calls). Returns the mean loss (NaN if nothing scored).
  double step(const int32_t* ids, const int32_t* targets, int64_t B, int64_t T);
  // The general step: rows of T tokens, or packed documents (cu_seqlens: offsets into the B * T
  // tokens, first 0, last B * T; positions restart and attention stops at each); the backward
  // only when asked, its gradients added to the ones held (accumulate) or replacing them.
  Gpt2StepResult run(const int32_t* ids, const int32_t* targets, int64_t B, int64_t T,
                     std::span<const int64_t> cu_seqlens, bool backward, bool accumulate);
  void zero_gradients();
  void scale_gradients(float s);
  // A parameter's fp32 value from host values in the checkpoint's name and layout.
  void set_value(const std::string& hf_name, const float* host);
  // AdamW's first (m) or second (v) moment of a parameter, in the checkpoint's layout, and back.
  std::vector<float> moment(const std::string& hf_name, bool first) const;
  void set_moment(const std::string& hf_name, bool first, const float* host);
  int64_t adam_steps() const { return adam_steps_; }
  void reset_adam();  // moments to zero, no steps taken
  void set_adam_steps(int64_t steps) { adam_steps_ = steps; }
  // The gradient held (the last step's, or the sum since zero_gradients) of a parameter, host fp32
  // in the checkpoint's name and layout (Conv1D weights [in, out]).
  std::vector<float> gradient(const std::string& hf_name) const;
  // A parameter's fp32 master value, likewise.
  std::vector<float> value(const std::string& hf_name) const;
  // Every parameter's checkpoint name, in a fixed order.
  std::vector<std::string> parameter_names() const;
  // One AdamW update from the last step's gradients (train::AdamW's formulas; weight decay on
  // matrices and embeddings only; clip_norm <= 0: no clipping). Returns the gradient norm
  // before clipping.
  double adamw(float lr, float weight_decay, float clip_norm, float beta1 = 0.9f,
               float beta2 = 0.95f, float eps = 1e-8f);

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
  Param& named(const std::string& hf_name) const;
  ops::cuda::AttentionArgs attention_args(int64_t layer, int64_t B, int64_t T) const;
  ops::cuda::AttentionArgs document_args(int64_t layer, const std::vector<int64_t>& docs,
                                         size_t d) const;
  // The backward of the last forward (docs: its document boundaries; rows_B: B when they are B
  // rows of T tokens, null when packed).
  void backward_pass(const std::vector<int64_t>& docs, const int64_t* rows_B, int64_t T);
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
