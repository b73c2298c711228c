// Matrix products on the GPU through cuBLAS, in the layouts the engine keeps (row-major,
// torch's Linear weights [out, in]):
//
//   y[M, N] = alpha * x[M, K] . W[N, K]^T + beta * y       (linear)
//
// x and W share one element type (fp32 or bf16); y is fp32 or that type. fp32 products run in
// true fp32 (TF32 off: the fp32 path is the one held to 1e-4 against the CPU); bf16 products
// accumulate in fp32. Leading dimensions are in elements and let x and y be column slices of
// wider rows. All work is queued on the handle's stream.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/common/device_types.h"

namespace kda::ops::cuda {

// One cuBLAS handle bound to a stream (and a workspace for cuBLAS's own use).
class Gemm {
 public:
  explicit Gemm(cudaStream_t stream);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  cudaStream_t stream() const { return stream_; }

  struct Operand {
    const void* data = nullptr;
    int64_t ld = 0;  // elements between rows; 0: the row width
  };
  struct Output {
    void* data = nullptr;
    ElementType type = ElementType::f32;
    int64_t ld = 0;
  };

  // y[M, N] = alpha x[M, K] W[N, K]^T + beta y
  void linear(ElementType in, int64_t M, int64_t N, int64_t K, Operand x, Operand W, Output y,
              float alpha = 1.f, float beta = 0.f);

  // y[M, N] = alpha x[M, K] W[K, N] + beta y (W row-major [K, N], not transposed)
  void matmul(ElementType in, int64_t M, int64_t N, int64_t K, Operand x, Operand W, Output y,
              float alpha = 1.f, float beta = 0.f);

  // `batch` independent products, operand b starting `stride` elements after operand b - 1:
  // y_b[M, N] = x_b[M, K] . op(W_b) with op(W_b) = W_b^T for W_b [N, K] (transpose_w) or W_b
  // for W_b [K, N].
  struct Strided {
    Operand op;
    int64_t stride = 0;
  };
  struct StridedOutput {
    Output out;
    int64_t stride = 0;
  };
  void batched(ElementType in, int64_t batch, int64_t M, int64_t N, int64_t K, Strided x, Strided W,
               bool transpose_w, StridedOutput y, float alpha = 1.f, float beta = 0.f);

 private:
  cudaStream_t stream_ = nullptr;
  cublasHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
};

}  // namespace kda::ops::cuda
