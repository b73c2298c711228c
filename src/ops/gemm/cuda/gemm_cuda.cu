// cuBLAS behind Gemm: row-major products expressed as column-major ones (a row-major [M, N]
// array is a column-major [N, M] one), so y^T = op(W) x^T with W as the first operand.
#include <string>

#include "ops/common/device_buffer.h"
#include "ops/gemm/cuda/gemm_cuda.h"

namespace kda::ops::cuda {
namespace {

constexpr size_t kCublasWorkspaceBytes = size_t(32) << 20;  // cuBLAS's advice for Hopper

void check_cublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw kda::Error(std::string("cuBLAS error in ") + what + ": " + cublasGetStatusString(status));
}

cudaDataType_t data_type(ElementType t) {
  return t == ElementType::f32 ? CUDA_R_32F : CUDA_R_16BF;
}

int64_t ld_or(int64_t ld, int64_t width) {
  return ld > 0 ? ld : width;
}

}  // namespace

Gemm::Gemm(cudaStream_t stream) : stream_(stream) {
  check_cublas(cublasCreate(&handle_), "cublasCreate");
  check_cublas(cublasSetStream(handle_, stream), "cublasSetStream");
  // Pedantic fp32: no TF32 down-conversion of fp32 operands.
  check_cublas(cublasSetMathMode(handle_, CUBLAS_PEDANTIC_MATH), "cublasSetMathMode");
  check_cuda(cudaMalloc(&workspace_, kCublasWorkspaceBytes), "cudaMalloc (cuBLAS workspace)");
  check_cublas(cublasSetWorkspace(handle_, workspace_, kCublasWorkspaceBytes),
               "cublasSetWorkspace");
}

Gemm::~Gemm() {
  if (handle_) cublasDestroy(handle_);
  if (workspace_) cudaFree(workspace_);
}

void Gemm::linear(ElementType in, int64_t M, int64_t N, int64_t K, Operand x, Operand W, Output y,
                  float alpha, float beta) {
  batched(in, 1, M, N, K, {x, 0}, {W, 0}, true, {y, 0}, alpha, beta);
}

void Gemm::matmul(ElementType in, int64_t M, int64_t N, int64_t K, Operand x, Operand W, Output y,
                  float alpha, float beta) {
  batched(in, 1, M, N, K, {x, 0}, {W, 0}, false, {y, 0}, alpha, beta);
}

void Gemm::batched(ElementType in, int64_t batch, int64_t M, int64_t N, int64_t K, Strided x,
                   Strided W, bool transpose_w, StridedOutput y, float alpha, float beta) {
  require(M >= 0 && N > 0 && K > 0 && batch > 0, "Gemm: sizes must be positive");
  if (M == 0) return;
  require(y.out.type == ElementType::f32 || y.out.type == in,
          "Gemm: the output is fp32 or the inputs' type");
  const int64_t ldx = ld_or(x.op.ld, K);
  const int64_t ldw = ld_or(W.op.ld, transpose_w ? K : N);
  const int64_t ldy = ld_or(y.out.ld, N);
  // Column-major view: Y^T [N, M] = op(W)^T... as cuBLAS sees it: C = A B with
  // A = W (column-major [K, N] when W is row-major [N, K], so op = T), B = x^T ([K, M]).
  const cublasOperation_t op_w = transpose_w ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasComputeType_t compute =
      in == ElementType::f32 ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
  check_cublas(cublasGemmStridedBatchedEx(handle_, op_w, CUBLAS_OP_N, int(N), int(M), int(K),
                                          &alpha, W.op.data, data_type(in), int(ldw), W.stride,
                                          x.op.data, data_type(in), int(ldx), x.stride, &beta,
                                          y.out.data, data_type(y.out.type), int(ldy), y.stride,
                                          int(batch), compute, CUBLAS_GEMM_DEFAULT),
               "cublasGemmStridedBatchedEx");
}

}  // namespace kda::ops::cuda
