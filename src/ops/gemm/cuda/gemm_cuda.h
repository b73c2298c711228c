// Matrix products on the GPU through cuBLAS, in the layouts the engine keeps (row-major,
// torch's Linear weights [out, in]):
//
//   y[M, N] = alpha * x[M, K] . W[N, K]^T + beta * y       (linear)
//
// x and W share one element type (fp32 or bf16); y is fp32 or that type. fp32 products run in
// true fp32 (TF32 off: the fp32 path is the one held to 1e-4 against the CPU); bf16 products
// accumulate in fp32. Leading dimensions are in elements and let x and y be column slices of
// wider rows. All work is queued on the handle's stream.
//
//   y[M, N] = alpha * x[M, K] . W[N, K]^T + beta * c       (linear_add)
//
// reads the addend from a separate fp32 array c (a residual stream kept for the backward) and
// writes y without a copy of c: cuBLASLt's D = alpha A B + beta C with C != D, which
// cublasGemmEx cannot do.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

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

  // y[M, N] = alpha x[M, K] W[N, K]^T + beta c, with c and y fp32 (row strides c.ld, y.ld;
  // 0: N). c == y runs in place (then c.ld must equal y.ld); otherwise c and y must not overlap,
  // and c is left unchanged. Runs through cublasLtMatmul with the algorithm cuBLASLt's heuristic
  // picks for the shape, strides and pointer alignments (asked once per such key, then cached);
  // where it offers none, or cuBLASLt is switched off (set_lt / KDA_GEMM_LT=0), c is copied into
  // y and linear accumulates with beta (the same result, one extra pass over y).
  void linear_add(ElementType in, int64_t M, int64_t N, int64_t K, Operand x, Operand W, Operand c,
                  Output y, float alpha = 1.f, float beta = 1.f);

  // cuBLASLt on (the default; KDA_GEMM_LT=0 in the environment starts it off) or off for
  // linear_add: the off path is the copy + cublasGemmEx fallback (checks, A/B timings).
  void set_lt(bool enabled) { lt_enabled_ = enabled; }
  bool lt_enabled() const { return lt_enabled_; }
  // linear_add calls that took the copy + cublasGemmEx path (counted for the checks).
  int64_t lt_fallbacks() const { return lt_fallbacks_; }

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
  struct LtPlans;  // the cuBLASLt handle and the cached descriptors + algorithm per key
  std::unique_ptr<LtPlans> lt_;
  bool lt_enabled_ = true;
  int64_t lt_fallbacks_ = 0;
};

}  // namespace kda::ops::cuda
