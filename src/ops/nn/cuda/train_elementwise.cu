// Elementwise kernels of training: the GELU (tanh) and SwiGLU backward, the AdamW update (with
// its bf16 copy of the weights) and a scale. Formulas as train/hf_gpt2.cpp, train/layers.cpp and
// train/adamw.cpp. The AdamW arithmetic uses explicitly rounded operations (no fused
// multiply-adds, IEEE division and square root), the CPU's operation order.
#include <cmath>
#include <string>

#include "ops/nn/cuda/nn_common.cuh"
#include "ops/nn/cuda/train_cuda.h"

namespace kda::ops::cuda {
namespace {

using namespace nn_detail;

constexpr int kThreads = 256;

__global__ void gelu_tanh_backward_kernel(const float* x, const float* dy, int64_t n, float* dx) {
  constexpr float kC = 0.7978845608028654f;  // sqrt(2 / pi)
  constexpr float kCubic = 0.044715f;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const float v = x[i];
    const float t = tanhf(kC * (v + kCubic * v * v * v));
    const float d =
        0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * kC * (1.0f + 3.0f * kCubic * v * v);
    dx[i] = dy[i] * d;
  }
}

// VW consecutive columns per thread and step (VW = 4 needs I % 4 == 0 and aligned arrays). Each
// array fp32 or bf16 (InT, GradT, OutT); arithmetic fp32.
template <class InT, class GradT, class OutT, int VW>
__global__ void swiglu_backward_kernel(const InT* gate_up, const GradT* dh, int64_t rows, int64_t I,
                                       OutT* d_gate_up) {
  const int64_t n = rows * I / VW;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const int64_t e = i * VW, r = e / I, c = e - r * I;
    const int64_t ia = r * 2 * I + c, ib = ia + I;
    const Vec<VW> a = load_vec<VW>(gate_up + ia), b = load_vec<VW>(gate_up + ib),
                  g = load_vec<VW>(dh + e);
    Vec<VW> da, db;
#pragma unroll
    for (int j = 0; j < VW; ++j) {
      const float s = 1.0f / (1.0f + expf(-a.v[j]));
      db.v[j] = g.v[j] * a.v[j] * s;
      da.v[j] = g.v[j] * b.v[j] * s * (1.0f + a.v[j] * (1.0f - s));
    }
    store_vec<VW>(d_gate_up + ib, db);  // (after every read of this thread's columns)
    store_vec<VW>(d_gate_up + ia, da);
  }
}

template <class CopyT>
__global__ void adamw_kernel(float* param, const float* grad, float* m, float* v, int64_t n,
                             float lr, float b1, float b2, float eps, float decay, float c1,
                             float c2, float grad_scale, CopyT* copy) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < n; j += step) {
    const float w = adamw_update(param, grad, m, v, j, lr, b1, b2, eps, decay, c1, c2, grad_scale);
    if constexpr (!std::is_same_v<CopyT, void>) {
      if (copy) {
        if constexpr (std::is_same_v<CopyT, __nv_bfloat16>)
          copy[j] = __float2bfloat16_rn(w);
        else
          copy[j] = w;
      }
    }
  }
}

__global__ void scale_kernel(float* x, int64_t n, float s) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) x[i] *= s;
}

}  // namespace

void gelu_tanh_backward(const float* x, const float* dy, int64_t n, float* dx,
                        cudaStream_t stream) {
  require(n >= 0, "cuda::gelu_tanh_backward: n must not be negative");
  if (n == 0) return;
  require(x && dy && dx, "cuda::gelu_tanh_backward: null pointer");
  gelu_tanh_backward_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(x, dy, n, dx);
  check_launch("cuda::gelu_tanh_backward");
}

void swiglu_backward(const void* gate_up, ElementType gate_up_type, const void* dh,
                     ElementType dh_type, int64_t rows, int64_t I, void* d_gate_up,
                     ElementType d_type, cudaStream_t stream) {
  require(rows >= 0 && I >= 1, "cuda::swiglu_backward: sizes must be positive");
  if (rows == 0) return;
  require(gate_up && dh && d_gate_up, "cuda::swiglu_backward: null pointer");
  require(d_type == gate_up_type || d_gate_up != gate_up,
          "cuda::swiglu_backward: gradients of another type cannot overwrite gate_up");
  const bool vector = I % 4 == 0 && aligned_for(gate_up, 4, element_bytes(gate_up_type)) &&
                      aligned_for(dh, 4, element_bytes(dh_type)) &&
                      aligned_for(d_gate_up, 4, element_bytes(d_type));
  dispatch_type(gate_up_type, [&](auto* in_tag) {
    using InT = std::remove_pointer_t<decltype(in_tag)>;
    dispatch_type(dh_type, [&](auto* grad_tag) {
      using GradT = std::remove_pointer_t<decltype(grad_tag)>;
      dispatch_type(d_type, [&](auto* tag) {
        using OutT = std::remove_pointer_t<decltype(tag)>;
        const auto* in = static_cast<const InT*>(gate_up);
        const auto* grad = static_cast<const GradT*>(dh);
        auto* out = static_cast<OutT*>(d_gate_up);
        if (vector)
          swiglu_backward_kernel<InT, GradT, OutT, 4>
              <<<grid_for(rows * I / 4, kThreads), kThreads, 0, stream>>>(in, grad, rows, I, out);
        else
          swiglu_backward_kernel<InT, GradT, OutT, 1>
              <<<grid_for(rows * I, kThreads), kThreads, 0, stream>>>(in, grad, rows, I, out);
      });
    });
  });
  check_launch("cuda::swiglu_backward");
}

void swiglu_backward(const float* gate_up, const float* dh, int64_t rows, int64_t I,
                     void* d_gate_up, ElementType d_type, cudaStream_t stream) {
  swiglu_backward(gate_up, ElementType::f32, dh, ElementType::f32, rows, I, d_gate_up, d_type,
                  stream);
}

void swiglu_backward(const float* gate_up, const float* dh, int64_t rows, int64_t I,
                     float* d_gate_up, cudaStream_t stream) {
  swiglu_backward(gate_up, dh, rows, I, d_gate_up, ElementType::f32, stream);
}

void adamw_step(float* param, const float* grad, float* m, float* v, int64_t n,
                const AdamWHyper& hyper, int64_t step, float grad_scale, void* param_copy,
                ElementType copy_type, cudaStream_t stream) {
  require(n >= 0, "cuda::adamw_step: n must not be negative");
  require(step >= 1, "cuda::adamw_step: step is the 1-based number of this update");
  require(hyper.lr > 0 && hyper.beta1 >= 0 && hyper.beta1 < 1 && hyper.beta2 >= 0 &&
              hyper.beta2 < 1 && hyper.eps > 0 && hyper.weight_decay >= 0,
          "cuda::adamw_step: bad hyper-parameters");
  require(std::isfinite(grad_scale), "cuda::adamw_step: grad_scale is not finite");
  if (n == 0) return;
  require(param && grad && m && v, "cuda::adamw_step: null pointer");
  // The bias corrections and the decay as the CPU computes them (float pow of the step).
  const float c1 = 1.0f - std::pow(hyper.beta1, float(step));
  const float c2 = 1.0f - std::pow(hyper.beta2, float(step));
  const float decay = hyper.lr * hyper.weight_decay;
  const unsigned grid = grid_for(n, kThreads);
  if (!param_copy) {
    adamw_kernel<void><<<grid, kThreads, 0, stream>>>(param, grad, m, v, n, hyper.lr, hyper.beta1,
                                                      hyper.beta2, hyper.eps, decay, c1, c2,
                                                      grad_scale, nullptr);
  } else {
    dispatch_type(copy_type, [&](auto* tag) {
      using CopyT = std::remove_pointer_t<decltype(tag)>;
      adamw_kernel<CopyT><<<grid, kThreads, 0, stream>>>(
          param, grad, m, v, n, hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, decay, c1, c2,
          grad_scale, static_cast<CopyT*>(param_copy));
    });
  }
  check_launch("cuda::adamw_step");
}

void scale(float* x, int64_t n, float s, cudaStream_t stream) {
  require(n >= 0, "cuda::scale: n must not be negative");
  if (n == 0) return;
  require(x, "cuda::scale: null pointer");
  scale_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(x, n, s);
  check_launch("cuda::scale");
}

}  // namespace kda::ops::cuda
