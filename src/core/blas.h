// Row-major fp32 matrix products through CBLAS (OpenBLAS). Names spell out which operand is
// transposed so call sites read like the math: C = alpha * op(A) op(B) + beta * C.
#pragma once

namespace kda {

// C[m, n] = alpha * A[m, k] B[k, n] + beta * C, all row-major with leading dimensions.
void gemm_nn(int m, int n, int k, float alpha, const float* a, int lda, const float* b, int ldb,
             float beta, float* c, int ldc);
// C[m, n] = alpha * A[m, k] B[n, k]^T + beta * C
void gemm_nt(int m, int n, int k, float alpha, const float* a, int lda, const float* b, int ldb,
             float beta, float* c, int ldc);
// C[m, n] = alpha * A[k, m]^T B[k, n] + beta * C
void gemm_tn(int m, int n, int k, float alpha, const float* a, int lda, const float* b, int ldb,
             float beta, float* c, int ldc);

}  // namespace kda
