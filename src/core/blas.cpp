#include "core/blas.h"

#include <cblas.h>

#include <cstdlib>
#include <cstring>

namespace kda {

std::string openblas_core_name() {
  return openblas_get_corename();
}

std::string openblas_coretype_upgrade() {
  if (std::getenv("OPENBLAS_CORETYPE")) return "";
  const std::string core = openblas_core_name();
  const bool fallback = core == "Prescott" || core == "Core2" || core == "Nehalem" ||
                        core == "Sandybridge" || core == "Haswell" || core == "Zen";
  if (!fallback) return "";
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && core != "SkylakeX") return "SkylakeX";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && core != "Haswell" &&
      core != "Zen") {
    return "Haswell";
  }
  return "";
}

void gemm_nn(int m, int n, int k, float alpha, const float* a, int lda, const float* b, int ldb,
             float beta, float* c, int ldc) {
  if (m == 0 || n == 0) return;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, n, k, alpha, a, lda, b, ldb, beta, c,
              ldc);
}

void gemm_nt(int m, int n, int k, float alpha, const float* a, int lda, const float* b, int ldb,
             float beta, float* c, int ldc) {
  if (m == 0 || n == 0) return;
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, alpha, a, lda, b, ldb, beta, c,
              ldc);
}

void gemm_tn(int m, int n, int k, float alpha, const float* a, int lda, const float* b, int ldb,
             float beta, float* c, int ldc) {
  if (m == 0 || n == 0) return;
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, m, n, k, alpha, a, lda, b, ldb, beta, c,
              ldc);
}

}  // namespace kda
