// cuBLAS behind Gemm: row-major products expressed as column-major ones (a row-major [M, N]
// array is a column-major [N, M] one), so y^T = op(W) x^T with W as the first operand.
// linear_add runs the same view through cuBLASLt, whose C and D may be different arrays.
#include <cublasLt.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <map>
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

// The largest power of two (up to 256, cuBLASLt's default assumption) dividing the address:
// cuBLASLt's heuristic must be told, or it may pick a kernel that needs more.
int64_t alignment(const void* p) {
  const auto a = uintptr_t(p);
  return a == 0 ? 256 : int64_t(std::min<uintptr_t>(a & (~a + 1), 256));
}

bool lt_from_environment() {
  const char* v = std::getenv("KDA_GEMM_LT");
  return !(v && std::string(v) == "0");
}

}  // namespace

// One cuBLASLt handle and, per key (types, sizes, strides, alignments, in place), the matmul
// and layout descriptors with the algorithm the heuristic chose: the heuristic costs tens of
// microseconds a query, far more than the launch.
struct Gemm::LtPlans {
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t w = nullptr, x = nullptr, c = nullptr, y = nullptr;
    cublasLtMatmulAlgo_t algo{};
    bool supported = false;  // false: no cuBLASLt algorithm (copy + cublasGemmEx)
  };
  using Key = std::array<int64_t, 13>;

  cublasLtHandle_t handle = nullptr;
  std::map<Key, Plan> plans;

  LtPlans() { check_cublas(cublasLtCreate(&handle), "cublasLtCreate"); }
  ~LtPlans() {
    for (auto& [key, plan] : plans) release(plan);
    if (handle) cublasLtDestroy(handle);
  }
  LtPlans(const LtPlans&) = delete;
  LtPlans& operator=(const LtPlans&) = delete;

  static void release(Plan& plan) {
    if (plan.op) cublasLtMatmulDescDestroy(plan.op);
    for (cublasLtMatrixLayout_t l : {plan.w, plan.x, plan.c, plan.y})
      if (l) cublasLtMatrixLayoutDestroy(l);
    plan = Plan{};
  }

  // The plan for y^T [N, M] = W^T... in cuBLAS's column-major view: A = W stored [K, N] (ld
  // ldw, transposed), B = x^T stored [K, M] (ld ldx), C and D fp32 [N, M] (ld ldc, ldy).
  const Plan& plan(const Key& key, ElementType in, int64_t M, int64_t N, int64_t K, int64_t ldx,
                   int64_t ldw, int64_t ldc, int64_t ldy, const std::array<int64_t, 4>& align) {
    if (auto it = plans.find(key); it != plans.end()) return it->second;
    Plan p;
    try {
      const cudaDataType_t t = data_type(in);
      // Plain fp32 compute: cuBLASLt uses TF32 only when asked (CUBLAS_COMPUTE_32F_FAST_TF32).
      check_cublas(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                   "cublasLtMatmulDescCreate");
      const cublasOperation_t trans = CUBLAS_OP_T, no_trans = CUBLAS_OP_N;
      check_cublas(
          cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &trans, sizeof(trans)),
          "cublasLtMatmulDescSetAttribute (TRANSA)");
      check_cublas(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &no_trans,
                                                  sizeof(no_trans)),
                   "cublasLtMatmulDescSetAttribute (TRANSB)");
      check_cublas(cublasLtMatrixLayoutCreate(&p.w, t, uint64_t(K), uint64_t(N), ldw),
                   "cublasLtMatrixLayoutCreate (W)");
      check_cublas(cublasLtMatrixLayoutCreate(&p.x, t, uint64_t(K), uint64_t(M), ldx),
                   "cublasLtMatrixLayoutCreate (x)");
      check_cublas(cublasLtMatrixLayoutCreate(&p.c, CUDA_R_32F, uint64_t(N), uint64_t(M), ldc),
                   "cublasLtMatrixLayoutCreate (c)");
      check_cublas(cublasLtMatrixLayoutCreate(&p.y, CUDA_R_32F, uint64_t(N), uint64_t(M), ldy),
                   "cublasLtMatrixLayoutCreate (y)");
      cublasLtMatmulPreference_t pref = nullptr;
      check_cublas(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
      const uint64_t workspace = kCublasWorkspaceBytes;
      const uint32_t align_w = uint32_t(align[0]), align_x = uint32_t(align[1]),
                     align_c = uint32_t(align[2]), align_y = uint32_t(align[3]);
      cublasStatus_t status = cublasLtMatmulPreferenceSetAttribute(
          pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof(workspace));
      const std::pair<cublasLtMatmulPreferenceAttributes_t, const uint32_t*> aligns[] = {
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_w},
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_x},
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c},
          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_y}};
      if (in == ElementType::f32 && status == CUBLAS_STATUS_SUCCESS) {
        // fp32 stays true fp32 (as the pedantic cublasGemmEx path): no TF32 / 16-bit inputs
        const uint64_t mask = ~(CUBLASLT_NUMERICAL_IMPL_FLAGS_OP_INPUT_TYPE_MASK) |
                              CUBLASLT_NUMERICAL_IMPL_FLAGS_INPUT_32F;
        status = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_IMPL_MASK, &mask,
                                                      sizeof(mask));
      }
      for (const auto& [attribute, value] : aligns)
        if (status == CUBLAS_STATUS_SUCCESS)
          status = cublasLtMatmulPreferenceSetAttribute(pref, attribute, value, sizeof(uint32_t));
      cublasLtMatmulHeuristicResult_t result{};
      int found = 0;
      if (status == CUBLAS_STATUS_SUCCESS)
        status = cublasLtMatmulAlgoGetHeuristic(handle, p.op, p.w, p.x, p.c, p.y, pref, 1, &result,
                                                &found);
      cublasLtMatmulPreferenceDestroy(pref);
      // NOT_SUPPORTED (or no result) means no algorithm for this layout: the fallback path
      if (status != CUBLAS_STATUS_SUCCESS && status != CUBLAS_STATUS_NOT_SUPPORTED)
        check_cublas(status, "cublasLtMatmulAlgoGetHeuristic");
      p.supported = status == CUBLAS_STATUS_SUCCESS && found > 0 &&
                    result.state == CUBLAS_STATUS_SUCCESS &&
                    result.workspaceSize <= kCublasWorkspaceBytes;
      if (p.supported) p.algo = result.algo;
    } catch (...) {
      release(p);
      throw;
    }
    return plans.emplace(key, p).first->second;
  }
};

Gemm::Gemm(cudaStream_t stream) : stream_(stream), lt_enabled_(lt_from_environment()) {
  check_cublas(cublasCreate(&handle_), "cublasCreate");
  check_cublas(cublasSetStream(handle_, stream), "cublasSetStream");
  // Pedantic fp32: no TF32 down-conversion of fp32 operands.
  check_cublas(cublasSetMathMode(handle_, CUBLAS_PEDANTIC_MATH), "cublasSetMathMode");
  check_cuda(cudaMalloc(&workspace_, kCublasWorkspaceBytes), "cudaMalloc (cuBLAS workspace)");
  check_cublas(cublasSetWorkspace(handle_, workspace_, kCublasWorkspaceBytes),
               "cublasSetWorkspace");
  // cuBLASLt shares the workspace: both run in order on the one stream.
  lt_ = std::make_unique<LtPlans>();
}

Gemm::~Gemm() {
  lt_.reset();
  if (handle_) cublasDestroy(handle_);
  if (workspace_) cudaFree(workspace_);
}

void Gemm::linear(ElementType in, int64_t M, int64_t N, int64_t K, Operand x, Operand W, Output y,
                  float alpha, float beta) {
  batched(in, 1, M, N, K, {x, 0}, {W, 0}, true, {y, 0}, alpha, beta);
}

void Gemm::linear_add(ElementType in, int64_t M, int64_t N, int64_t K, Operand x, Operand W,
                      Operand c, Output y, float alpha, float beta) {
  require(M >= 0 && N > 0 && K > 0, "Gemm::linear_add: sizes must be positive");
  if (M == 0) return;
  require(y.type == ElementType::f32, "Gemm::linear_add: the output (and the addend) is fp32");
  require(x.data && W.data && c.data && y.data, "Gemm::linear_add: null operand");
  const int64_t ldx = ld_or(x.ld, K), ldw = ld_or(W.ld, K);
  const int64_t ldc = ld_or(c.ld, N), ldy = ld_or(y.ld, N);
  require(ldx >= K && ldw >= K && ldc >= N && ldy >= N,
          "Gemm::linear_add: a row stride is shorter than its row");
  const bool in_place = c.data == y.data;
  require(!in_place || ldc == ldy, "Gemm::linear_add: in place (c == y) needs c.ld == y.ld");
  if (!in_place) {  // the byte ranges [first, last) the two arrays span
    const auto c0 = uintptr_t(c.data), y0 = uintptr_t(y.data);
    const auto c1 = c0 + uintptr_t(((M - 1) * ldc + N) * 4);
    const auto y1 = y0 + uintptr_t(((M - 1) * ldy + N) * 4);
    require(c1 <= y0 || y1 <= c0, "Gemm::linear_add: c and y overlap without being the same");
  }
  const std::array<int64_t, 4> align = {alignment(W.data), alignment(x.data), alignment(c.data),
                                        alignment(y.data)};
  if (lt_enabled_) {
    const LtPlans::Key key = {int64_t(in), M,        N,        K,        ldx,      ldw,     ldc,
                              ldy,         align[0], align[1], align[2], align[3], in_place};
    const LtPlans::Plan& p = lt_->plan(key, in, M, N, K, ldx, ldw, ldc, ldy, align);
    if (p.supported) {
      check_cublas(
          cublasLtMatmul(lt_->handle, p.op, &alpha, W.data, p.w, x.data, p.x, &beta, c.data, p.c,
                         y.data, p.y, &p.algo, workspace_, kCublasWorkspaceBytes, stream_),
          "cublasLtMatmul");
      return;
    }
  }
  // The fallback: y = c, then y = alpha x W^T + beta y
  ++lt_fallbacks_;
  if (!in_place)
    check_cuda(cudaMemcpy2DAsync(y.data, size_t(ldy) * 4, c.data, size_t(ldc) * 4, size_t(N) * 4,
                                 size_t(M), cudaMemcpyDeviceToDevice, stream_),
               "cudaMemcpy2DAsync (linear_add addend)");
  linear(in, M, N, K, x, W, y, alpha, beta);
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
