// The small kernels of training a lineage mixer layer on the GPU (train/mixer_layer.cpp's
// forward and backward): the causal short convolution over packed sequences, rotary position
// embedding, the L2 row norm, beta's sigmoid and Gated DeltaNet's scalar gate. Same formulas and
// conventions as the CPU (ops/conv1d, ops/kda/kda_activations.h, mixer_layer.cpp's rotary).
//
// All pointers are DEVICE pointers, rows token-major. Sequence boundaries reach the kernels as
// `positions`: an int32 device array [rows] with each token's position inside its own sequence
// (0 at every sequence start), written by sequence_positions. Every result is deterministic:
// sums over rows (dweight, dA_log, ddt_bias) run in a fixed order (fixed row chunks summed in
// fp64, then the chunks in order), no float atomics. Bad sizes throw kda::Error before anything
// is queued; every launch is checked.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <span>

#include "ops/common/device_types.h"
#include "ops/nn/cuda/nn_cuda.h"
#include "ops/nn/cuda/train_cuda.h"

namespace kda::ops::cuda {

// Causal depthwise short convolution + SiLU over packed sequences, ops::short_conv_silu_forward's
// formula with a zero state at every sequence start: y[r, c] = silu(sum_{j<W} w[c, j] *
// x[r - (W-1) + j, c]) where rows before the sequence start (positions[r] < W-1-j) count as 0.
// x fp32 [rows, C] (row stride x_stride, 0: C), weight fp32 [C, W] (W in [1, 4]); y OutRows
// (must not overlap x).
void short_conv_silu_train_forward(const float* x, const int32_t* positions, int64_t rows,
                                   int64_t C, int64_t x_stride, const float* weight, int64_t W,
                                   OutRows y, cudaStream_t stream);

// Its backward: dy of dy_type (bf16 or fp32) dense [rows, C]; dx OutRows (f32 or bf16, row
// stride dx.stride, 0: C; overwritten; may NOT alias dy or x), e.g. a column block of a wider
// bf16 gradient that one GEMM reads; dweight [C, W] ACCUMULATED (+=), summed over rows in a fixed
// order (deterministic). Recomputes the pre-activation from x; a bf16 dx is the fp32 value
// rounded once (the same bits as converting the fp32 dx). Uses scratch.partials.
void short_conv_silu_train_backward(const float* x, const int32_t* positions, int64_t rows,
                                    int64_t C, int64_t x_stride, const float* weight, int64_t W,
                                    const void* dy, ElementType dy_type, OutRows dx, float* dweight,
                                    TrainScratch& scratch, cudaStream_t stream);
// (dx fp32 dense [rows, C])
void short_conv_silu_train_backward(const float* x, const int32_t* positions, int64_t rows,
                                    int64_t C, int64_t x_stride, const float* weight, int64_t W,
                                    const void* dy, ElementType dy_type, float* dx, float* dweight,
                                    TrainScratch& scratch, cudaStream_t stream);

// Rotary position embedding in place on x [rows, H, D] (row stride x_stride, 0: H D), GPT-NeoX
// layout: pairs (i, i + D/2), angle positions[r] * 10000^(-2i/D); direction +1 rotates, -1
// applies the inverse (the backward). fp32 or bf16 x (type). The angle, its cosine and sine are
// computed in fp64 and rounded to fp32, as the CPU (so cos/sin equal the CPU's at any position);
// the rotation itself is the CPU's fp32 arithmetic without contraction.
void rotary_embedding(void* x, ElementType type, const int32_t* positions, int64_t rows, int64_t H,
                      int64_t D, int64_t x_stride, int direction, cudaStream_t stream);

// y = x / max(|x|, 1e-6) over rows of width D (ops/kda/kda_activations.h l2norm_rows; x fp32
// dense [rows, D]), y OutRows; and its backward (l2norm_rows_backward): dx fp32 dense
// (overwritten; may alias dy when dy is fp32) from dy of dy_type dense [rows, D] and the same x.
void l2norm_rows_forward(const float* x, int64_t rows, int64_t D, OutRows y, cudaStream_t stream);
void l2norm_rows_backward(const float* x, const void* dy, ElementType dy_type, int64_t rows,
                          int64_t D, float* dx, cudaStream_t stream);

// beta = sigmoid(braw) (braw fp32 [n], beta typed dense [n]), and dbraw = dbeta * beta *
// (1 - beta) with dbeta of dbeta_type, beta recomputed from braw; dbraw fp32 (overwritten; may
// alias braw or an fp32 dbeta).
void sigmoid_forward(const float* braw, int64_t n, void* beta, ElementType beta_type,
                     cudaStream_t stream);
void sigmoid_backward(const float* braw, const void* dbeta, ElementType dbeta_type, int64_t n,
                      float* dbraw, cudaStream_t stream);

// Gated DeltaNet's scalar gate: g[r, h] = -exp(A_log[h]) * softplus(graw[r, h] + dt_bias[h])
// (torch softplus, threshold 20) for graw fp32 dense [rows, H]; g typed dense [rows, H].
// Backward: dgraw fp32 (overwritten; may alias graw or an fp32 dg) = -exp(A_log[h]) *
// sigmoid(graw + dt_bias) * dg; dA_log[h] += sum_r g[r,h] dg[r,h] (g recomputed in fp32);
// ddt_bias[h] += sum_r dgraw[r,h] (ACCUMULATED, fixed-order sums, deterministic). Uses
// scratch.partials.
void scalar_gate_forward(const float* graw, const float* A_log, const float* dt_bias, int64_t rows,
                         int64_t H, void* g, ElementType g_type, cudaStream_t stream);
void scalar_gate_backward(const float* graw, const float* A_log, const float* dt_bias,
                          const void* dg, ElementType dg_type, int64_t rows, int64_t H,
                          float* dgraw, float* dA_log, float* ddt_bias, TrainScratch& scratch,
                          cudaStream_t stream);

// positions[r] for B rows of T tokens (r % T; cu_seqlens empty) or for packed documents given
// the HOST cu_seqlens (offsets: first 0, non-decreasing, last B T): writes the int32 device
// array [B T]. Computed on the host and copied; returns after the copy is done (the stream is
// synchronised), so it must not be called while the stream is being captured into a graph.
void sequence_positions(std::span<const int64_t> cu_seqlens, int64_t B, int64_t T,
                        int32_t* positions, cudaStream_t stream);

}  // namespace kda::ops::cuda
