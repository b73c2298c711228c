// Kimi Linear (train/hf_kimi_linear.h) trained on the GPU: the host KimiLinearTrainable keeps
// the parameters' names, initialisation and host mirrors; this model holds fp32 master weights,
// gradients and AdamW moments on the device (train/cuda/device_params.h) and runs the forward
// and backward with bf16 GEMMs (cuBLAS), the chunked KDA kernels (gate, beta and q/k L2 norm in
// the kernel), flash attention for the NoPE MLA, and per-expert cuBLAS products for the MoE.
// The design is LineageCudaModel's (train/cuda/lineage_cuda_model.h): every layer's activations
// are kept for the backward (no recomputation), the residual stream is fp32.
//
// Numerics against the fp32 CPU model: GEMM inputs and the mixers' inputs are rounded to bf16,
// so the loss agrees to ~1e-3 and gradients to ~1e-2. Exceptions, all for a reason:
//  - the MoE router runs in fp32 (transformers does too): its logits see only the upstream
//    bf16 noise, so the expert selection equals the CPU's unless two scores nearly tie;
//  - the KDA kernel normalises q, k as x / max(|x|, 1e-6) where transformers uses
//    x rsqrt(sum x^2 + 1e-6) (relative difference ~1e-6 / (2 |x|^2));
//  - Kimi's unbounded softplus gate is applied inside the chunked kernel; the chunks where it
//    decays past the kernel's bf16 split (e^-78 over 16 tokens) are redone in fp32 there.
// Determinism: the same bits run to run (fixed-order sums everywhere; the one kernel with
// atomics, the wgmma attention backward, takes head dims 128 / 128 only, not MLA's 192 / 128;
// --deterministic, DeviceTrainingOptions, keeps any MLA off it). The MoE copies each layer's
// top-k ids to the host (one synchronisation per MoE layer and pass) to group the tokens by
// expert.
//
// Expert balancing: each forward counts the tokens per expert (on the host, from the ids);
// after_optimizer_step applies KimiLinearTrainable's rule (bias[e] += rate * sign(mean - load[e]),
// rate = the host model's bias_update_rate) to the device bias, in the CPU's float arithmetic.
// As on the CPU, a pass without backward (evaluation) resets the counts.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "model/kimi_linear_config.h"
#include "train/cuda/device_trainable.h"
#include "train/hf_kimi_linear.h"
#include "train/trainable_model.h"

namespace kda::train::cuda {

class KimiCudaModel final : public DeviceTrainableModel {
 public:
  // Takes the host model (its params() stay the host mirrors of the device weights).
  explicit KimiCudaModel(std::unique_ptr<KimiLinearTrainable> host);
  ~KimiCudaModel() override;

  std::vector<Param*> params() override { return host_->params(); }
  StepResult forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B, int64_t T,
                              bool backward, std::span<const int64_t> cu_seqlens = {}) override;
  void after_optimizer_step() override;

  KimiLinearTrainable& host() { return *host_; }
  // max / mean expert load of the training passes since the last optimizer step, per MoE layer.
  std::vector<double> expert_load_imbalance() const;

  // The model's parts (train/cuda/kimi_cuda_internal.h).
  struct Layer;
  struct PerLayer;
  struct Activations;
  struct Engines;

 private:
  void ensure_activations(int64_t R);
  size_t workspace_bytes(int64_t B, int64_t T, bool backward) const;
  // Mixers (kimi_cuda_kda.cpp, kimi_cuda_mla.cpp): the forward reads P.a_c (the normed input)
  // and leaves the output projection's input in P.o_c; the backward reads the output
  // projection's input gradient in acts_->do_c and writes the normed input's gradient to
  // acts_->dan.
  void kda_forward(Layer& L, PerLayer& P, int64_t B, int64_t T);
  void kda_backward(Layer& L, PerLayer& P, int64_t B, int64_t T);
  void mla_forward(Layer& L, PerLayer& P, int64_t B, int64_t T);
  void mla_backward(Layer& L, PerLayer& P, int64_t B, int64_t T);
  // Feed-forward (kimi_cuda_moe.cpp for the MoE): the forward reads P.m_c (P.m32 for the router)
  // and ADDS its output to y; the backward reads dy (fp32, the output's gradient) and writes the
  // normed input's gradient to dx.
  void dense_forward(Layer& L, PerLayer& P, float* y);
  void dense_backward(Layer& L, PerLayer& P, const float* dy, float* dx);
  void moe_forward(Layer& L, PerLayer& P, float* y, bool count_load);
  void moe_backward(Layer& L, PerLayer& P, const float* dy, float* dx);

  std::unique_ptr<KimiLinearTrainable> host_;
  model::KimiLinearConfig c_;
  std::unique_ptr<Engines> engines_;
  std::vector<Layer> layers_;
  std::unique_ptr<Activations> acts_;
  // a training step: KDA layers run chunk_forward_for_backward into their own workspace
  // (PerLayer::chunk_ws) and the backward skips its recompute
  bool keep_chunk_forward_ = false;
};

}  // namespace kda::train::cuda
