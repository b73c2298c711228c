// The elementwise and reduction kernels of training on the GPU, the device twins of the CPU
// training functions (train/layers.h, train/adamw.cpp, the GPT-2 layer norm and GELU backward of
// train/hf_gpt2.cpp): same formulas, same accumulate-or-overwrite conventions.
//
// All pointers are DEVICE pointers, fp32 unless stated, rows dense [rows, width]. Every result
// is deterministic: no float atomics; sums over rows (weight gradients, the embedding scatter,
// the loss, the squared norm) run in a fixed order, so two runs give the same bits. Functions
// that reduce over rows take a TrainScratch (grown on demand, reused across calls; one per
// stream: two streams must not share one). Bad sizes throw kda::Error before anything is queued;
// every launch is checked.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "ops/common/device_buffer.h"
#include "ops/common/device_types.h"
#include "ops/nn/cuda/nn_cuda.h"

namespace kda::ops::cuda {

// Device scratch of the reducing kernels (partial sums, per-row statistics, sort buffers).
struct TrainScratch {
  DeviceBuffer partials;  // [chunks, columns] partial sums
  DeviceBuffer rows;      // per-row values (statistics, losses)
  DeviceBuffer sort;      // the embedding backward's radix sort
};

// y = x * inv_rms * w with inv_rms[r] = 1 / sqrt(mean(x[r]^2) + eps), kept for the backward.
// x, w fp32 [rows, D], [D]; y fp32 or bf16 (OutRows); inv_rms [rows].
void rms_norm_forward_train(const float* x, int64_t rows, int64_t D, const float* w, float eps,
                            OutRows y, float* inv_rms, cudaStream_t stream);

// dx ([rows, D]: overwritten, or added to with accumulate_dx, the residual stream's add) and dw
// (ACCUMULATED, [D]) of rms_norm_forward_train, given dy and the kept inv_rms. dx may alias dy
// only when overwritten. When dx_bf16 is not null it receives the final dx (after the add)
// rounded to bf16 (round to nearest even, what convert gives), [rows, D] dense: the next GEMM's
// input without a separate cast; it must not overlap x, dy or dx.
void rms_norm_backward(const float* x, const float* dy, int64_t rows, int64_t D, const float* w,
                       const float* inv_rms, float* dx, float* dw, TrainScratch& scratch,
                       cudaStream_t stream, bool accumulate_dx = false, void* dx_bf16 = nullptr);

// GPT-2's LayerNorm backward (mean and rstd recomputed from x with eps, as the forward):
// dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = dy w, written (accumulate_dx false) or
// added (accumulate_dx true, as the CPU trainer's residual stream); dw += sum_r dy xhat,
// db += sum_r dy (accumulated). dx may alias dy only when accumulate_dx is false.
void layer_norm_backward(const float* x, const float* dy, int64_t rows, int64_t D, const float* w,
                         float eps, float* dx, float* dw, float* db, bool accumulate_dx,
                         TrainScratch& scratch, cudaStream_t stream);

// dx = dy * gelu_tanh'(x) over n values (dx may alias dy).
void gelu_tanh_backward(const float* x, const float* dy, int64_t n, float* dx, cudaStream_t stream);

// SwiGLU backward: gate_up rows [a (I) | b (I)], h = silu(a) * b; dh [rows, I];
// d_gate_up rows [da | db] (overwritten; may alias gate_up).
void swiglu_backward(const float* gate_up, const float* dh, int64_t rows, int64_t I,
                     float* d_gate_up, cudaStream_t stream);
// The same with d_gate_up of d_type (f32, or bf16 for the GEMMs that read it next; bf16 must
// not alias gate_up).
void swiglu_backward(const float* gate_up, const float* dh, int64_t rows, int64_t I,
                     void* d_gate_up, ElementType d_type, cudaStream_t stream);
// The general form: gate_up, dh and d_gate_up each fp32 or bf16 (the lineage trainer keeps its
// MLP pre-activations and d(act) in bf16), fp32 arithmetic; d_gate_up may alias gate_up only
// when both have the same type, and must not overlap dh.
void swiglu_backward(const void* gate_up, ElementType gate_up_type, const void* dh,
                     ElementType dh_type, int64_t rows, int64_t I, void* d_gate_up,
                     ElementType d_type, cudaStream_t stream);

// dtable[ids[r], :] += dy[r, :] (dtable [vocab, D]; ids int32 on the device). Rows are sorted
// by id (a stable radix sort), then each used table row adds its rows in row order, so the
// result is the CPU's sequential sum exactly. Rows whose id is outside [0, vocab) add nothing
// (the forward has rejected them).
void embedding_backward(const int32_t* ids, const float* dy, int64_t rows, int64_t D, int64_t vocab,
                        float* dtable, TrainScratch& scratch, cudaStream_t stream);

// Cross-entropy over rows of logits [rows, V] (logits_type f32 or bf16) with targets (int32;
// -1: not scored). count = the number of scored rows (on the device). Writes
//   dlogits [rows, V] (dlogits_type f32 or bf16) = (softmax - onehot(target)) / count on scored
//     rows, 0 on the others (dlogits may alias logits when both have the same type: bf16 logits
//     turned into bf16 gradients in place halve the head's traffic),
//   *loss_sum = sum over scored rows of -log p(target) (written, not accumulated),
//   *correct = the number of scored rows whose argmax (first maximum) is the target,
//   *scored = count when scored is not null.
// A target >= V makes its row's loss and gradient NaN (a loud failure; nothing is checked on
// the host).
void cross_entropy_forward_backward(const void* logits, ElementType logits_type,
                                    const int32_t* targets, int64_t rows, int64_t V, void* dlogits,
                                    ElementType dlogits_type, float* loss_sum, int32_t* correct,
                                    int32_t* scored, TrainScratch& scratch, cudaStream_t stream);

// AdamW's hyper-parameters for one call; weight_decay is what applies to this parameter (0 for
// parameters without decay: norms, biases, gates).
struct AdamWHyper {
  float lr = 1e-3f;
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
  float weight_decay = 0.0f;
};

// One AdamW update of n fp32 master weights, train::AdamW::step's formulas and order:
//   g = grad * grad_scale (the clipping factor); m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
//   param -= lr weight_decay param; param -= lr (m / c1) / (sqrt(v / c2) + eps),
// with c1 = 1 - b1^step, c2 = 1 - b2^step; `step` is the 1-based number of this update (the
// CPU's step count after its increment). When param_copy is not null it receives the updated
// weights as copy_type (bf16: the compute weights, round to nearest even).
void adamw_step(float* param, const float* grad, float* m, float* v, int64_t n,
                const AdamWHyper& hyper, int64_t step, float grad_scale, void* param_copy,
                ElementType copy_type, cudaStream_t stream);

// One tensor of a multi-tensor AdamW step: fp32 weights, gradient and moments (device), an
// optional bf16 compute copy refreshed by the update, and whether weight decay applies.
struct AdamWTensor {
  float* param = nullptr;
  const float* grad = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  void* bf16_copy = nullptr;
  int64_t n = 0;
  bool decay = false;
};

// AdamW over a fixed set of tensors (a model's parameters) in three launches: the global
// gradient norm (fp64, a fixed order: the same bits every run), the clipping factor
// clip_norm / norm when clip_norm > 0 and the norm exceeds it (else 1), then adamw_step's update
// of every tensor (hyper.weight_decay where the tensor decays, 0 elsewhere). Nothing waits on the
// host; when the norm is not finite nothing is updated. The norm (a double) is at norm_device()
// once the stream gets there. The tensors' pointers must stay valid.
class AdamWMultiTensor {
 public:
  explicit AdamWMultiTensor(const std::vector<AdamWTensor>& tensors);
  void step(const AdamWHyper& hyper, int64_t step, float clip_norm, cudaStream_t stream);
  const double* norm_device() const;

 private:
  DeviceBuffer slots_, chunks_, partials_, result_;
  int64_t num_chunks_ = 0;
};

// *out += sum x^2 over n values (a device scalar, accumulated, so a sum over many tensors is
// one call per tensor); a fixed two-pass reduction, fp64 inside.
void sum_of_squares(const float* x, int64_t n, float* out, TrainScratch& scratch,
                    cudaStream_t stream);

// x *= s over n values.
void scale(float* x, int64_t n, float s, cudaStream_t stream);

}  // namespace kda::ops::cuda
