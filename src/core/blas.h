// Row-major fp32 matrix products through CBLAS (OpenBLAS). Names spell out which operand is
// transposed so call sites read like the math: C = alpha * op(A) op(B) + beta * C.
#pragma once

#include <string>

namespace kda {

// OpenBLAS 0.3.21 (Debian 12) does not recognise recent Xeons (Sapphire/Emerald Rapids) and
// falls back to its SSE3 "Prescott" kernels, several times slower than its AVX-512 ones. When
// the CPU has AVX-512 (or AVX2), the library picked such a fallback, and the user set no
// OPENBLAS_CORETYPE, this returns the core type to ask for ("SkylakeX" or "Haswell"); else "".
// The library reads the variable when it loads, so the program must re-execute itself to use it.
std::string openblas_coretype_upgrade();
std::string openblas_core_name();

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
