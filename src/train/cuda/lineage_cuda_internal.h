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

namespace kda::train::cuda {

namespace lineage_detail {

namespace k = ops::cuda;
using Entry = DeviceParams::Entry;

constexpr k::ElementType kF32 = k::ElementType::f32;
constexpr k::ElementType kBf16 = k::ElementType::bf16;

template <class T = char>
T* offset(const k::DeviceBuffer& b, int64_t elements, size_t element_bytes) {
  return reinterpret_cast<T*>(b.as<char>() + size_t(elements) * element_bytes);
}

inline void copy_device(void* to, const void* from, size_t bytes, cudaStream_t s) {
  k::check_cuda(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToDevice, s), "cudaMemcpyAsync");
}

// dW[out, in] += dy^T x and dx[rows, in] (=, or += with accumulate) dy W, with dy bf16
// [rows, out] (row stride ld_dy) and x bf16 [rows, in] (row stride ld_x); no dx when dx.data
// is null.
inline void linear_backward(k::Gemm& gemm, model::cuda::WeightGradGemm& wgrad, int64_t rows,
                            int64_t in, int64_t out, const void* dy_c, int64_t ld_dy,
                            const void* x_c, int64_t ld_x, const Entry& W, k::Gemm::Output dx,
                            bool accumulate) {
  wgrad.weight_gradient(kBf16, rows, out, in, dy_c, ld_dy, x_c, ld_x, W.g(), 1.f);
  if (dx.data)
    gemm.matmul(kBf16, rows, in, out, {dy_c, ld_dy}, {W.compute(), in}, dx, 1.f,
                accumulate ? 1.f : 0.f);
}

// The attention calls of one layer: one batched call over B rows of T tokens, or one call per
// packed document.
template <class Fn>
void for_each_attention(int64_t B, int64_t T, const std::vector<int64_t>& cu_seqlens, Fn&& fn) {
  if (cu_seqlens.empty()) {
    fn(int64_t(0), T, B);
    return;
  }
  for (size_t n = 0; n + 1 < cu_seqlens.size(); ++n)
    fn(cu_seqlens[n], cu_seqlens[n + 1] - cu_seqlens[n], int64_t(1));
}

// The sizes of a lineage MLA layer (LineageConfig: Kimi's 128 / 64 / 128 / 512 at head_dim 128).
struct MlaSizes {
  int64_t nope, rope, v, latent, qk, row;
  explicit MlaSizes(int64_t head_dim)
      : nope(head_dim),
        rope(head_dim / 2 > 1 ? head_dim / 2 : 1),
        v(head_dim),
        latent(4 * head_dim),
        qk(nope + rope),
        row(latent + rope) {}
};

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
      v32, o32, lse, o_c, inv2, m_c, up32, act_c;
  // MLA: the kv_a rows [c | k_rope] fp32, the latent before its norm, its inverse RMS, the normed
  // latent in bf16 (q_c, k_c, v_c hold q, the per-head keys [k_nope | k_rope] and values)
  ops::cuda::DeviceBuffer rows32, lat32, inv_lat, latn_c;
};

// What the forward keeps (per layer) and the backward's scratch, for R rows.
struct LineageCudaModel::Activations {
  int64_t R = 0, capacity = 0;  // rows of this call; rows the buffers hold
  ops::cuda::DeviceBuffer ids, targets, positions, result;  // result: loss sum, correct, scored
  std::vector<ops::cuda::DeviceBuffer> h;  // residual stream fp32 [R, d]: h[2l] enters layer l's
                                           // mixer, h[2l + 1] its MLP, h[2L] the final norm
  std::vector<PerLayer> layers;
  ops::cuda::DeviceBuffer invf, hf_c, logits;
  ops::cuda::DeviceBuffer dh, dtmp, dan, dy_c, d32a, d32b, do_c, dq_c, dk_c, dv_c, dg_c, db_c, dA,
      ddt, dlinear32, workspace;
  // MLA backward: dq / dk (bf16, per-head width qk), dk and dv in fp32, d(kv_b out), d(kv_a rows),
  // d(latent), and the [H qk, rope] 0/1 matrix that sums the heads' rope-key gradients
  ops::cuda::DeviceBuffer dqm_c, dkm_c, dkeys32, dvalues32, dkvb32, drows32, dlat32, rope_sum;
};

}  // namespace kda::train::cuda
