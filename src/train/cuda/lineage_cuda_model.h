// A lineage-family model (train/lineage_model.h) trained on the GPU: the same parameters, names,
// initialisation and forward as the CPU LineageModel, with bf16 compute (cuBLAS GEMMs, the
// chunked delta-rule kernels, flash attention forward + backward) and fp32 master weights,
// gradients and AdamW moments on the device (train/cuda/device_params.h). Mixers: softmax
// attention (RoPE when every layer is softmax), linear attention (fp32 kernel), DeltaNet, Gated
// DeltaNet and KDA (with the short convolutions), and Kimi's NoPE MLA. Activations of
// every layer are kept for the backward (no recomputation; the delta-family layers keep their
// chunked kernels' per-chunk arrays too, by chunk_forward_for_backward into a workspace each).
//
// Numerics: the CPU model is the fp32 reference; this one rounds GEMM inputs and the mixers'
// inputs to bf16 (fla's precision), so losses agree to ~1e-3 and gradients to ~1e-2. The KDA
// layer's gate is applied inside the chunked kernel, either gate: the chunks where a softplus
// gate decays past the kernel's bf16 split (e^-78 over 16 tokens) are redone in fp32.
// Determinism: every kernel sums in a fixed order but the wgmma softmax attention backward's dQ
// (fp32 atomics; head dim 128 on compute capability 9), which --deterministic
// (DeviceTrainingOptions) replaces: then two runs give the same bits.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "ops/attention/cuda/attention_cuda.h"
#include "ops/delta_rule/cuda/delta_rule_cuda.h"
#include "ops/linear_attn/cuda/linear_attn_cuda.h"
#include "train/cuda/device_trainable.h"
#include "train/lineage_model.h"
#include "train/trainable_model.h"

namespace kda::train::cuda {

class LineageCudaModel final : public DeviceTrainableModel {
 public:
  // Takes the host model (its params() stay the host mirrors of the device weights).
  explicit LineageCudaModel(std::unique_ptr<LineageModel> host);
  ~LineageCudaModel() override;

  std::vector<Param*> params() override { return host_->params(); }
  StepResult forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                              bool backward, std::span<const int64_t> cu_seqlens = {}) override;

  const LineageConfig& config() const { return host_->config(); }
  // With KDA_CUDA_PROFILE set when the model was made: the time per stage of every step so far
  // (each stage boundary synchronises the stream), to stderr.
  void report_profile(const std::string& title) const;
  void reset_profile();

  // The model's parts (defined in train/cuda/lineage_cuda_internal.h).
  struct Layer;
  struct PerLayer;
  struct Activations;
  struct Engines;

 private:
  void ensure_activations(int64_t R);
  // The scored rows (targets >= 0) of this call and their targets into head_rows_ /
  // head_targets_; true when the head should run on them alone (some, and at most 7 in 8).
  bool select_head_rows(const int32_t* targets, int64_t R);
  void mixer_forward(Layer& L, int64_t layer_index, int64_t B, int64_t T);
  void mixer_backward(Layer& L, int64_t layer_index, int64_t B, int64_t T);
  // The MLA mixer (lineage_cuda_mla.cpp).
  void mla_forward(Layer& L, int64_t layer_index, int64_t B, int64_t T);
  void mla_backward(Layer& L, int64_t layer_index, int64_t B, int64_t T);
  ops::cuda::AttentionArgs mla_workspace_args(const PerLayer& P, int64_t len, int64_t batch) const;
  static ops::cuda::AttentionArgs attention_args(const PerLayer& P, int64_t H, int64_t dh,
                                                 int64_t r0, int64_t len, int64_t batch);
  static ops::cuda::LinearAttnDeviceArgs linear_attn_args(const PerLayer& P, const LineageConfig& c,
                                                          int64_t B, int64_t T, int64_t R,
                                                          std::span<const int64_t> cu);
  static ops::cuda::DeltaRuleDeviceInputs delta_rule_inputs(const Layer& L, const PerLayer& P,
                                                            const LineageConfig& c, int64_t B,
                                                            int64_t T, int64_t R,
                                                            std::span<const int64_t> cu);

  std::unique_ptr<LineageModel> host_;
  std::vector<int32_t> head_rows_, head_targets_;
  std::unique_ptr<Engines> engines_;
  std::vector<Layer> layers_;
  std::unique_ptr<Activations> acts_;
  // a training step: delta-family layers run chunk_forward_for_backward into their own
  // workspace (PerLayer::chunk_ws) and the backward skips its recompute
  bool keep_chunk_forward_ = false;
};

}  // namespace kda::train::cuda
