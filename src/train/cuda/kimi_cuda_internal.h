// KimiCudaModel's private parts shared by its source files (kimi_cuda_model.cpp: the model, the
// dense MLP, the head; kimi_cuda_kda.cpp, kimi_cuda_mla.cpp: the mixers; kimi_cuda_moe.cpp: the
// mixture of experts): per-layer device parameters, what the forward keeps, the backward's
// scratch; the small helpers it shares with LineageCudaModel are in training_helpers.h.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "model/cuda/gpt2_train_kernels.h"
#include "ops/common/device_buffer.h"
#include "ops/gemm/cuda/gemm_cuda.h"
#include "ops/nn/cuda/train_cuda.h"
#include "train/cuda/device_params.h"
#include "train/cuda/kimi_cuda_model.h"
#include "train/cuda/training_helpers.h"

namespace kda::train::cuda {

namespace kimi_detail {

using namespace training_helpers;  // k, Entry, kF32, kBf16, offset, linear_backward, ...

// Grows a buffer to at least `bytes` (dropping its contents when it grows).
inline void reserve(k::DeviceBuffer& b, int64_t bytes) {
  b.reserve(size_t(bytes > 0 ? bytes : 1));
}

}  // namespace kimi_detail

// One layer's device parameters and kinds.
struct KimiCudaModel::Layer {
  using Entry = kimi_detail::Entry;
  bool kda = false, moe = false;
  int64_t o_width = 0;  // the output projection's input width (KDA H K, MLA H v)
  Entry *norm1 = nullptr, *norm2 = nullptr, *o_proj = nullptr;
  // KDA: q, k, v projections, their short convolutions, the low-rank gates, beta, A_log,
  // dt_bias, the output norm. MLA: q (q_proj, or q_b_proj with q_lora_rank, then also q_a and
  // its norm), kv_a, kv_a_norm, kv_b.
  Entry *q = nullptr, *k = nullptr, *v = nullptr, *conv[3] = {nullptr, nullptr, nullptr};
  Entry *f_a = nullptr, *f_b = nullptr, *g_a = nullptr, *g_b = nullptr, *b = nullptr;
  Entry *A_log = nullptr, *dt_bias = nullptr, *o_norm = nullptr;
  Entry *kv_a = nullptr, *kv_a_norm = nullptr, *kv_b = nullptr, *q_a = nullptr, *q_a_norm = nullptr;
  // Dense SwiGLU MLP
  Entry *gate = nullptr, *up = nullptr, *down = nullptr;
  // MoE: router, selection bias, experts, shared expert (null when there is none)
  Entry *router = nullptr, *bias = nullptr;
  std::vector<Entry*> w1, w2, w3;
  Entry *shared_gate = nullptr, *shared_up = nullptr, *shared_down = nullptr;
  std::vector<int64_t> load;  // tokens per expert since the last bias update
  // This pass's grouping by expert (host): expert e owns pairs [offsets[e], offsets[e + 1]);
  // ids [R top_k]; index = [pair_token | pair_slot | slot_pair] ([3 R top_k], uploaded).
  std::vector<int64_t> offsets;
  std::vector<int32_t> ids, index;
};

struct KimiCudaModel::Engines {
  explicit Engines(cudaStream_t s) : gemm(s), wgrad(s) {}
  ops::cuda::Gemm gemm;
  model::cuda::WeightGradGemm wgrad;
  ops::cuda::TrainScratch scratch;
  ops::cuda::DeviceBuffer norm_partials;  // the gated norm backward's scratch
};

// What the forward keeps of one layer for the backward.
struct KimiCudaModel::PerLayer {
  // every layer: the normed inputs of the mixer (a_c) and of the feed-forward (m_c; m32 in fp32
  // for the MoE router), their inverse RMS, the output projection's input (o_c)
  ops::cuda::DeviceBuffer inv1, a_c, o_c, inv2, m_c, m32;
  // KDA: q, k, v projections fp32 [R, 3 HK]; conv outputs (bf16); f_a x, g_a x (bf16 [R, K]);
  // graw (bf16), the output gate (fp32), beta's pre-activation (bf16), the kernel's output
  // MLA: q_c, k_c ([R, H, qk]), v_c, the kv_a rows fp32, the latent before and after its norm,
  // its inverse RMS and lse (the attention writes its output to o_c in bf16); with q_lora_rank
  // the query's q_a rows (fp32), their inverse RMS and normed rows (bf16)
  ops::cuda::DeviceBuffer qkv32, q_c, k_c, v_c, fa_c, ga_c, g_c, gate32, b_c, kda_o_c;
  ops::cuda::DeviceBuffer rows32, lat32, inv_lat, latn_c, lse, q_lat32, inv_q_lat, q_latn_c;
  // KDA in training: the chunked forward's workspace, with what the backward needs from it
  // (chunk_forward_for_backward)
  ops::cuda::DeviceBuffer chunk_ws;
  // Dense MLP: [gate | up] fp32 [R, 2 F], the hidden (bf16)
  ops::cuda::DeviceBuffer up32, act_c;
  // MoE: router logits fp32 [R, E], ids / weights [R, top_k], the uploaded index, the gathered
  // inputs (bf16 [pairs, D]), the experts' [gate | up] (fp32 [pairs, 2 I]) and hidden (bf16),
  // the shared expert's [gate | up] and hidden
  ops::cuda::DeviceBuffer logits32, ids, weights, index, xg_c, eup32, eact_c, sh_up32, sh_act_c;
};

// What the forward keeps (per layer) and the backward's scratch, for R rows.
struct KimiCudaModel::Activations {
  int64_t R = 0, capacity = 0;
  ops::cuda::DeviceBuffer ids, targets, positions, result;  // result: loss sum, correct, scored
  std::vector<ops::cuda::DeviceBuffer> h;  // residual stream fp32 [R, D]: h[2l] enters layer l's
                                           // mixer, h[2l + 1] its feed-forward, h[2L] the norm
  std::vector<PerLayer> layers;
  ops::cuda::DeviceBuffer invf, hf_c, logits, workspace;
  ops::cuda::DeviceBuffer dh, dtmp, dan, dy_c, d32a, do_c;
  // KDA backward: the raw q / k / v, graw and beta gradients (bf16, from the kernel), dA_log,
  // ddt_bias, the kernel output's and the output gate's gradients (bf16), d(f_a x) / d(g_a x)
  ops::cuda::DeviceBuffer dq_c, dk_c, dv_c, dg_c, db_c, dA, ddt, dko_c, dgate_c;
  // MLA backward (and the forward's kv_b output in dkvb32): dq / dk / dv (bf16), dk and dv in
  // fp32, d(kv_b out), d(kv_a rows), d(latent), the [H qk, rope] 0/1 matrix that sums the heads'
  // rope-key gradients; with q_lora_rank d(q_a rows) (fp32)
  ops::cuda::DeviceBuffer dqm_c, dkm_c, dvm_c, dkeys32, dvalues32, dkvb32, drows32, dlat32,
      rope_sum, dq_lat32;
  // MoE: expert outputs fp32 [pairs, D] (forward) / d(gathered inputs) (backward); gathered dy
  // (bf16); the weighted hidden (bf16 [pairs, I]); dy W2 (fp32 [pairs, I]); d[gate | up] (bf16);
  // d(routing weights) [R, top_k]; d(router logits) [R, E]
  ops::cuda::DeviceBuffer eo32, dyg_c, wh_c, g32, dup_c, dweights, dlogits;
};

}  // namespace kda::train::cuda
