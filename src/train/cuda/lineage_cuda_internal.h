// LineageCudaModel's private parts shared by its source files (lineage_cuda_model.cpp: the model,
// its delta-rule / attention / linear mixers; lineage_cuda_mla.cpp: the MLA mixer): per-layer
// parameters, what the forward keeps, the backward's scratch, and small helpers.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "model/cuda/gpt2_train_kernels.h"
#include "model/cuda/stage_timer.h"
#include "ops/common/device_buffer.h"
#include "ops/gemm/cuda/gemm_cuda.h"
#include "ops/nn/cuda/train_cuda.h"
#include "train/cuda/device_params.h"
#include "train/cuda/lineage_cuda_model.h"
#include "train/cuda/mla_train.h"
#include "train/cuda/training_helpers.h"

namespace kda::train::cuda {

namespace lineage_detail {

using namespace training_helpers;  // k, Entry, kF32, kBf16, offset, linear_backward, ...

// The sizes of a lineage MLA layer (LineageConfig: Kimi's 128 / 64 / 128 / 512 at head_dim 128).
inline mla_train::Shape mla_shape(int64_t heads, int64_t head_dim) {
  return {heads, head_dim, head_dim / 2 > 1 ? head_dim / 2 : 1, head_dim, 4 * head_dim};
}

}  // namespace lineage_detail

// One block's parameters (device entries) and kind.
struct LineageCudaModel::Layer {
  MixerKind kind = MixerKind::softmax;
  bool rope = false;
  lineage_detail::Entry *norm1 = nullptr, *norm2 = nullptr, *W1 = nullptr, *W3 = nullptr,
                        *W2 = nullptr;
  lineage_detail::Entry *Wq = nullptr, *Wk = nullptr, *Wv = nullptr, *Wo = nullptr, *Wb = nullptr,
                        *Wg = nullptr;
  lineage_detail::Entry *A_log = nullptr, *dt_bias = nullptr;
  lineage_detail::Entry* conv[3] = {nullptr, nullptr, nullptr};
  // MLA layers (Wq is q_proj, Wo o_proj): kv_a, its latent norm, kv_b
  lineage_detail::Entry *kv_a = nullptr, *kv_a_norm = nullptr, *kv_b = nullptr;
  bool delta_family() const {
    return kind == MixerKind::delta || kind == MixerKind::gated_delta || kind == MixerKind::kda;
  }
};

struct LineageCudaModel::Engines {
  explicit Engines(cudaStream_t s) : gemm(s), wgrad(s) {}
  ops::cuda::Gemm gemm;
  model::cuda::WeightGradGemm wgrad;
  ops::cuda::TrainScratch scratch;
  model::cuda::StageTimer timer;  // KDA_CUDA_PROFILE: time per stage of a step (synchronises)
};

// What the forward keeps of one layer for the backward.
struct LineageCudaModel::PerLayer {
  ops::cuda::DeviceBuffer inv1, a_c, qkv32, q_c, k_c, v_c, g_c, b_c, braw32, graw32, qa32, ka32,
      v32, o32, lse, o_c, inv2, m_c;
  // linear layers: the normalised form's denominators (fp32 [R, H]), kept with o32 so that the
  // backward does not run the forward again
  ops::cuda::DeviceBuffer den32;
  // the MLP: pre-activations [W1 m | W3 m] (bf16 [R, 2F]), silu(W1 m) * W3 m (bf16 [R, F]), and
  // [W1; W3] (bf16 [2F, d], the compute copies side by side, copied by each forward)
  ops::cuda::DeviceBuffer up_c, act_c, w13_c;
  // softmax layers: rows [q | k | v] (bf16 [R, 3 inner], RoPE applied) and [Wq; Wk; Wv] (bf16
  // [3 inner, d], the compute copies side by side, copied by each forward); delta-family layers
  // keep wqkv_c too (KDA: [Wq; Wk; Wv; Wg], bf16 [4 inner, d])
  ops::cuda::DeviceBuffer qkv_c, wqkv_c;
  // MLA: the kv_a rows [c | k_rope] fp32, the latent before its norm, its inverse RMS, the normed
  // latent in bf16 (q_c, k_c, v_c hold q, the per-head keys [k_nope | k_rope] and values)
  ops::cuda::DeviceBuffer rows32, lat32, inv_lat, latn_c;
  // (a query rank's rows, inverse RMS and normed rows: mla_train.h names them, but the lineage's
  // MLA layers have no query rank, so they stay empty)
  ops::cuda::DeviceBuffer q_lat32, inv_q_lat, q_latn_c;
  // delta-family layers in training: the chunked forward's workspace, with what the backward
  // needs from the forward (chunk_forward_for_backward; ~290 MB at 16384 rows, 6 heads of 128)
  ops::cuda::DeviceBuffer chunk_ws;
};

// What the forward keeps (per layer) and the backward's scratch, for R rows.
struct LineageCudaModel::Activations {
  int64_t R = 0, capacity = 0;  // rows of this call; rows the buffers hold
  ops::cuda::DeviceBuffer ids, targets, positions, result;  // result: loss sum, correct, scored
  std::vector<ops::cuda::DeviceBuffer> h;  // residual stream fp32 [R, d]: h[2l] enters layer l's
                                           // mixer, h[2l + 1] its MLP, h[2L] the final norm
  std::vector<PerLayer> layers;
  ops::cuda::DeviceBuffer invf, hf_c, logits;
  // the head over the scored rows only (select_head_rows): their row indices (int32 [R]) and
  // final residual rows (fp32 [R, d]); `targets` then holds their targets alone
  ops::cuda::DeviceBuffer head_rows, x_head;
  ops::cuda::DeviceBuffer dh, dtmp, dan, dy_c, d32a, do_c, dq_c, dk_c, dv_c, dg_c, db_c, dA, ddt,
      dlinear32, workspace;
  ops::cuda::DeviceBuffer dact_c;  // the MLP's d(act) (bf16 [R, F]), what its SwiGLU reads
  // [dq | dk | dv] rows (bf16 [R, 3 inner]; softmax layers: attention's, delta family: before
  // the short convolutions; KDA layers: [dq | dk | dv | dg], [R, 4 inner]), one GEMM back, and
  // the stacked weight gradient (fp32 [3 or 4 inner, d])
  ops::cuda::DeviceBuffer dqkv_c, dw_qkv;
  // MLA backward: dq / dk (bf16, per-head width qk), dk and dv in fp32, d(kv_b out), d(kv_a rows),
  // d(latent), and the [H qk, rope] 0/1 matrix that sums the heads' rope-key gradients
  ops::cuda::DeviceBuffer dqm_c, dkm_c, dkeys32, dvalues32, dkvb32, drows32, dlat32, rope_sum;
  ops::cuda::DeviceBuffer dq_lat32;  // (empty: no query rank, as q_lat32 above)
};

}  // namespace kda::train::cuda
