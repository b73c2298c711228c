// Small helpers that the GPU training models (LineageCudaModel, KimiCudaModel) share: element
// types, byte offsets into device buffers, device copies, a linear layer's backward (weight
// gradient and input gradient) and the attention calls of one layer over rows or documents.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <vector>

#include "model/cuda/gpt2_train_kernels.h"
#include "ops/common/device_buffer.h"
#include "ops/delta_rule/cuda/delta_rule_cuda.h"
#include "ops/gemm/cuda/gemm_cuda.h"
#include "ops/nn/cuda/train_cuda.h"
#include "train/cuda/device_params.h"

namespace kda::train::cuda::training_helpers {

namespace k = ops::cuda;
using Entry = DeviceParams::Entry;

constexpr k::ElementType kF32 = k::ElementType::f32;
constexpr k::ElementType kBf16 = k::ElementType::bf16;

template <class T = char>
T* offset(const k::DeviceBuffer& b, int64_t elements, size_t element_bytes) {
  return reinterpret_cast<T*>(b.as<char>() + size_t(elements) * element_bytes);
}

// Whether a training step's delta-family layers keep their chunked forward's arrays for the
// backward (chunk_forward_for_backward into a workspace per layer: faster, ~0.3 GB a layer at
// 16384 tokens and 6 heads of 128) or share one workspace and let the backward recompute them
// (KDA_CHUNK_RECOMPUTE=1: the lean choice for large models).
inline bool keep_chunk_forward_for_backward() {
  static const bool keep = [] {
    const char* recompute = std::getenv("KDA_CHUNK_RECOMPUTE");
    return !(recompute && recompute[0] == '1');
  }();
  return keep;
}

// A layer's kept workspace grown to `bytes` (before anything of the step is queued: the stream
// is synchronised first, since growing frees memory earlier work may still use).
inline void reserve_chunk_workspace(k::DeviceBuffer& own, size_t bytes, cudaStream_t s) {
  if (bytes <= own.bytes()) return;
  k::check_cuda(cudaStreamSynchronize(s), "chunk workspace");
  own.resize(bytes);
}

// One layer's chunked delta-rule forward and backward in a training step: through the layer's
// own workspace, kept from forward to backward (`keep`), or through the shared one (the
// backward recomputes the forward's arrays).
inline void chunk_forward_step(const k::DeltaRuleDeviceInputs& in, void* o, bool keep,
                               const k::DeviceBuffer& own, const k::DeviceBuffer& shared,
                               cudaStream_t s) {
  if (keep)
    k::chunk_forward_for_backward(in, o, nullptr, own.data(), own.bytes(), s);
  else
    k::chunk_forward(in, o, nullptr, shared.data(), shared.bytes(), s);
}
inline void chunk_backward_step(const k::DeltaRuleDeviceInputs& in, const void* d_o,
                                const k::DeltaRuleDeviceGrads& grads, bool keep,
                                const k::DeviceBuffer& own, const k::DeviceBuffer& shared,
                                cudaStream_t s) {
  const k::DeviceBuffer& ws = keep ? own : shared;
  k::chunk_backward(in, d_o, nullptr, grads, ws.data(), ws.bytes(), s,
                    keep ? k::ChunkBackwardFrom::kept_forward : k::ChunkBackwardFrom::recompute);
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

}  // namespace kda::train::cuda::training_helpers
