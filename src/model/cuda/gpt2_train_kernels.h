// The pieces of GPT-2's backward on the GPU that are not generic training ops (train_cuda.h):
// weight gradients of a linear layer (dW += dy^T x, a product the Gemm wrapper does not offer),
// the position-embedding gradient, and the packing of the attention's dq, dk, dv into one
// [rows, 3E] gradient of the fused c_attn projection. Device pointers; every result is
// deterministic (no atomics).
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/common/device_types.h"

namespace kda::model::cuda {

// A cuBLAS handle on `stream` for the weight-gradient products (same math settings as
// ops::cuda::Gemm: pedantic fp32 for fp32 inputs, fp32 accumulation for bf16 inputs).
class WeightGradGemm {
 public:
  explicit WeightGradGemm(cudaStream_t stream);
  ~WeightGradGemm();
  WeightGradGemm(const WeightGradGemm&) = delete;
  WeightGradGemm& operator=(const WeightGradGemm&) = delete;

  // dW[out, in] (fp32, dense, row-major) = dy^T x + beta dW, with dy [rows, out] (row stride
  // ld_dy) and x [rows, in] (row stride ld_x), both of element type `type`.
  void weight_gradient(ops::cuda::ElementType type, int64_t rows, int64_t out, int64_t in,
                       const void* dy, int64_t ld_dy, const void* x, int64_t ld_x, float* dW,
                       float beta);

 private:
  cublasHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
};

// dwpe[t, :] += sum over b of dx[b T + t, :] (dx fp32 [B T, E]; the rows of B sequences whose
// positions restart at 0), summed over b in order.
void position_embedding_backward(const float* dx, int64_t B, int64_t T, int64_t E, float* dwpe,
                                 cudaStream_t stream);

// dqkv[r, :] = [dq[r, :] | dk[r, :] | dv[r, :]] as fp32 [rows, 3E]; dq, dk, dv dense [rows, E]
// of element type `type`.
void pack_qkv_gradient(const void* dq, const void* dk, const void* dv, ops::cuda::ElementType type,
                       int64_t rows, int64_t E, float* dqkv, cudaStream_t stream);

}  // namespace kda::model::cuda
