// The small kernels of a transformer layer on the GPU, the device twins of ops/nn, ops/norm,
// ops/conv1d and ops/kda's activations (same formulas, same conventions; see those headers):
// norms, activations, the KDA layer's short convolution and gates, embeddings and casts.
//
// All pointers are DEVICE pointers, rows token-major. Inputs are fp32 (the residual stream and
// GEMM outputs stay fp32); `out` arguments carry their element type (fp32, or bf16 when the
// result feeds a bf16 GEMM or kernel), so a cast costs no extra pass. Row strides are in
// elements and let inputs be column slices of a wider projection. Norm weights are fp32.
// Every function queues its work on `stream`; bad sizes throw kda::Error first.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ops/common/device_types.h"

namespace kda::ops::cuda {

// An output array: data with its element type and row stride (0: dense, the row width).
struct OutRows {
  void* data = nullptr;
  ElementType type = ElementType::f32;
  int64_t stride = 0;
};

// y[r, :] = x[r, :] (with the cast to y's type). x row stride x_stride (0: cols).
void copy_rows(const float* x, int64_t rows, int64_t cols, int64_t x_stride, OutRows y,
               cudaStream_t stream);

// n values of type `from` converted to `to` (f32 <-> bf16, or a plain copy).
void convert(const void* x, ElementType from, void* y, ElementType to, int64_t n,
             cudaStream_t stream);

// y += x over n fp32 values (the residual add).
void add_inplace(float* y, const float* x, int64_t n, cudaStream_t stream);

// out[t, :] = table[ids[t], :] (+ positions[position0 + t, :] when positions is not null);
// table and positions [*, D] of type table_type; ids int32 on the device. out fp32 [T, D].
void embedding(const int32_t* ids, int64_t T, const void* table, const void* positions,
               int64_t position0, ElementType table_type, int64_t D, float* out,
               cudaStream_t stream);

// RMSNorm as transformers computes it: y = x * rsqrt(mean(x^2) + eps) * weight (weight may be
// null). x rows of width D with stride x_stride (0: D).
void rms_norm(const float* x, int64_t rows, int64_t D, int64_t x_stride, const float* weight,
              float eps, OutRows y, cudaStream_t stream);

// LayerNorm: (x - mean) / sqrt(var + eps) * weight + bias (biased variance, as torch).
void layer_norm(const float* x, int64_t rows, int64_t D, const float* weight, const float* bias,
                float eps, OutRows y, cudaStream_t stream);

// y = x + bias (bias [cols] broadcast over rows; fp32 in place when y aliases x).
void add_bias(float* x, int64_t rows, int64_t cols, const float* bias, cudaStream_t stream);

// GPT-2's gelu_new (tanh approximation): y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
void gelu_tanh(const float* x, int64_t rows, int64_t cols, OutRows y, cudaStream_t stream);

// SwiGLU: y[r, i] = silu(gate_up[r, i]) * gate_up[r, I + i], i < I (gate_up rows [2 I], gate
// first, dense).
void swiglu(const float* gate_up, int64_t rows, int64_t I, OutRows y, cudaStream_t stream);
// The same with gate_up of gate_up_type (f32, or bf16: the lineage trainer keeps its MLP
// pre-activations in bf16); fp32 arithmetic either way.
void swiglu(const void* gate_up, ElementType gate_up_type, int64_t rows, int64_t I, OutRows y,
            cudaStream_t stream);

// Causal depthwise short conv + SiLU over T tokens (prefill, or T = 1 for a decode step),
// exactly ops::short_conv_silu_forward: x [T, C] with stride x_stride, weight [C, W] fp32 (W in
// [1, 4]), state [W - 1, C] fp32 (the last W - 1 inputs, oldest first) read, then updated in
// place to the last W - 1 inputs seen (older state rows shift in when T < W - 1). y [T, C]
// (y.stride 0: C) must not overlap x.
void short_conv_silu(const float* x, int64_t T, int64_t C, int64_t x_stride, const float* weight,
                     int64_t W, float* state, OutRows y, cudaStream_t stream);

// L2 normalisation as transformers' KDA path computes it: y = x * rsqrt(sum(x^2) + eps) over
// rows of width D (x dense [rows, D]).
void l2_normalize_rows(const float* x, int64_t rows, int64_t D, float eps, OutRows y,
                       cudaStream_t stream);

// KDA forget gate in log space, as ops::kda's activations (kda_activations.h):
//   lower_bound < 0: g = lower_bound * sigmoid(exp(A_log[h]) * (graw + dt_bias[h, c]))
//   otherwise:       g = -exp(A_log[h]) * softplus(graw + dt_bias[h, c])   (torch's softplus)
// graw [T, H, K] with row stride graw_stride (0: H K), A_log [H], dt_bias [H K] (fp32; either
// may be null: 0). g fp32 dense [T, H, K].
void kda_gate(const float* graw, int64_t T, int64_t H, int64_t K, int64_t graw_stride,
              const float* A_log, const float* dt_bias, float lower_bound, float* g,
              cudaStream_t stream);

// y = sigmoid(x) over rows x cols (x row stride x_stride; y fp32 dense [rows, cols]).
void sigmoid(const float* x, int64_t rows, int64_t cols, int64_t x_stride, float* y,
             cudaStream_t stream);

// Kimi's output norm, ops::gated_rms_norm_sigmoid: y = x * rsqrt(mean(x^2) + eps) * weight *
// sigmoid(gate) over rows of width D (weight [D] shared by every row). x is `x_type` (the KDA
// kernel's output), dense [rows, D]; gate fp32 dense [rows, D].
void gated_rms_norm_sigmoid(const void* x, ElementType x_type, const float* gate, int64_t rows,
                            int64_t D, const float* weight, float eps, OutRows y,
                            cudaStream_t stream);

// Deterministic pseudo-random fill (benchmarks' synthetic weights): x[i] = scale * u(seed, i),
// u uniform in [-1, 1) from a counter hash, so the same seed gives the same array everywhere.
void fill_uniform(void* x, ElementType type, int64_t n, float scale, uint64_t seed,
                  cudaStream_t stream);

}  // namespace kda::ops::cuda
