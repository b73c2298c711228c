// Forward and backward of the dense pieces of a training model, fp32, row-major [rows, width].
// Backward functions accumulate into parameter gradients (callers zero them once per step).
#pragma once
#include <cstdint>
#include <vector>

namespace kda::train {

// y = x W^T (W: [out, in]).
void linear_forward(const float* x, int64_t rows, int64_t in, const float* W, int64_t out,
                    float* y);
// dx = dy W (overwritten, or accumulated when accumulate_dx); dW += dy^T x.
void linear_backward(const float* x, const float* dy, int64_t rows, int64_t in, const float* W,
                     int64_t out, float* dx, float* dW, bool accumulate_dx = false);

// y = x * rsqrt(mean(x^2) + eps) * w; inv_rms [rows] is kept for the backward.
void rms_norm_forward(const float* x, int64_t rows, int64_t D, const float* w, float eps, float* y,
                      float* inv_rms);
// dx (overwritten) and dw (accumulated).
void rms_norm_backward(const float* x, const float* dy, int64_t rows, int64_t D, const float* w,
                       const float* inv_rms, float* dx, float* dw);

// The pre-norm residual's backward: x -> x + f(rms_norm(x)). Given d_normed (the gradient at
// the norm's output), dh += the gradient through the norm into x; dw accumulated; scratch
// [rows, D].
void residual_rms_norm_backward(const float* x, const float* d_normed, int64_t rows, int64_t D,
                                const float* w, const float* inv_rms, float* dw, float* dh,
                                float* scratch);

// Token embedding: rows of table [vocab, D] by id (throws kda::Error naming `who` on an id
// outside the vocabulary), and its backward (scatter-add of dy into dtable).
void embedding_forward(const float* table, int64_t vocab, int64_t D, const int32_t* ids,
                       int64_t rows, float* out, const char* who);
void embedding_backward(const int32_t* ids, const float* dy, int64_t rows, int64_t D,
                        float* dtable);

// SwiGLU: h = silu(a) * b, where a = x W1^T, b = x W3^T (kept for the backward).
void swiglu_forward(const float* a, const float* b, int64_t n, float* h);
void swiglu_backward(const float* a, const float* b, const float* dh, int64_t n, float* da,
                     float* db);

// Mean cross-entropy over rows whose target is >= 0; writes dlogits (already divided by the
// count) and returns the loss. `correct` counts argmax hits on scored rows.
double cross_entropy(const float* logits, const int32_t* targets, int64_t rows, int64_t vocab,
                     float* dlogits, int64_t* scored, int64_t* correct);

// The LM head and cross_entropy over the scored rows alone (target >= 0): logits = h W^T (W:
// [vocab, D]) for those rows; when dh is given, dh = dlogits W (overwritten; zero on unscored
// rows) and dW += dlogits^T h. Returns the mean loss, as cross_entropy. Recall tasks score a
// fraction of the positions (MQAR 1/8, Palindrome 1/2) and the head is most of a small model's
// step; when every row is scored (text) it is the plain head.
double lm_head_cross_entropy(const float* h, const int32_t* targets, int64_t rows, int64_t D,
                             const float* W, int64_t vocab, float* dh, float* dW, int64_t* scored,
                             int64_t* correct);

}  // namespace kda::train
