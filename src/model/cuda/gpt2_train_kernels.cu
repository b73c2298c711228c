#include <cuda_bf16.h>

#include <algorithm>
#include <string>

#include "core/error.h"
#include "model/cuda/gpt2_train_kernels.h"
#include "ops/common/device_buffer.h"

namespace kda::model::cuda {
namespace {

using ops::cuda::check_cuda;
using ops::cuda::ElementType;

constexpr size_t kCublasWorkspaceBytes = size_t(32) << 20;

void check_cublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw kda::Error(std::string("cuBLAS error in ") + what + ": " + cublasGetStatusString(status));
}

unsigned blocks_for(int64_t n, int threads) {
  return unsigned(std::clamp<int64_t>((n + threads - 1) / threads, 1, int64_t(1) << 20));
}

__global__ void position_backward_kernel(const float* __restrict__ dx, int64_t B, int64_t T,
                                         int64_t E, float* __restrict__ dwpe) {
  const int64_t n = T * E;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    float sum = 0.f;
    for (int64_t b = 0; b < B; ++b) sum += dx[b * n + i];
    dwpe[i] += sum;
  }
}

__device__ inline float as_float(float x) {
  return x;
}
__device__ inline float as_float(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <class T>
__global__ void pack_qkv_kernel(const T* __restrict__ dq, const T* __restrict__ dk,
                                const T* __restrict__ dv, int64_t rows, int64_t E,
                                float* __restrict__ dqkv) {
  const int64_t n = rows * 3 * E;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / (3 * E), c = i % (3 * E);
    const int64_t part = c / E, e = c % E;
    const T* src = part == 0 ? dq : part == 1 ? dk : dv;
    dqkv[i] = as_float(src[r * E + e]);
  }
}

}  // namespace

WeightGradGemm::WeightGradGemm(cudaStream_t stream) {
  check_cublas(cublasCreate(&handle_), "cublasCreate");
  check_cublas(cublasSetStream(handle_, stream), "cublasSetStream");
  check_cublas(cublasSetMathMode(handle_, CUBLAS_PEDANTIC_MATH), "cublasSetMathMode");
  check_cuda(cudaMalloc(&workspace_, kCublasWorkspaceBytes), "cudaMalloc (cuBLAS workspace)");
  check_cublas(cublasSetWorkspace(handle_, workspace_, kCublasWorkspaceBytes),
               "cublasSetWorkspace");
}

WeightGradGemm::~WeightGradGemm() {
  if (handle_) cublasDestroy(handle_);
  if (workspace_) cudaFree(workspace_);
}

void WeightGradGemm::weight_gradient(ElementType type, int64_t rows, int64_t out, int64_t in,
                                     const void* dy, int64_t ld_dy, const void* x, int64_t ld_x,
                                     float* dW, float beta) {
  require(rows > 0 && out > 0 && in > 0, "weight_gradient: sizes must be positive");
  require(ld_dy >= out && ld_x >= in, "weight_gradient: a row stride is below the row width");
  // Column-major view: dW^T [in, out] (ld in) = x^T [in, rows] (x as stored, ld ld_x) times
  // (dy^T [out, rows])^T (dy as stored, transposed).
  const cudaDataType_t t = type == ElementType::f32 ? CUDA_R_32F : CUDA_R_16BF;
  const cublasComputeType_t compute =
      type == ElementType::f32 ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
  const float alpha = 1.f;
  check_cublas(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_T, int(in), int(out), int(rows), &alpha,
                            x, t, int(ld_x), dy, t, int(ld_dy), &beta, dW, CUDA_R_32F, int(in),
                            compute, CUBLAS_GEMM_DEFAULT),
               "cublasGemmEx (weight gradient)");
}

void position_embedding_backward(const float* dx, int64_t B, int64_t T, int64_t E, float* dwpe,
                                 cudaStream_t stream) {
  require(B > 0 && T > 0 && E > 0, "position_embedding_backward: sizes must be positive");
  position_backward_kernel<<<blocks_for(T * E, 256), 256, 0, stream>>>(dx, B, T, E, dwpe);
  check_cuda(cudaGetLastError(), "position_embedding_backward");
}

void pack_qkv_gradient(const void* dq, const void* dk, const void* dv, ElementType type,
                       int64_t rows, int64_t E, float* dqkv, cudaStream_t stream) {
  require(rows > 0 && E > 0, "pack_qkv_gradient: sizes must be positive");
  const unsigned blocks = blocks_for(rows * 3 * E, 256);
  if (type == ElementType::f32) {
    pack_qkv_kernel<float>
        <<<blocks, 256, 0, stream>>>(static_cast<const float*>(dq), static_cast<const float*>(dk),
                                     static_cast<const float*>(dv), rows, E, dqkv);
  } else {
    pack_qkv_kernel<__nv_bfloat16><<<blocks, 256, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(dq), static_cast<const __nv_bfloat16*>(dk),
        static_cast<const __nv_bfloat16*>(dv), rows, E, dqkv);
  }
  check_cuda(cudaGetLastError(), "pack_qkv_gradient");
}

}  // namespace kda::model::cuda
