// Cross-entropy forward and backward on the GPU, train::cross_entropy's formulas: one block per
// row, an fp32 online max / sum of exponentials (one exp per logit) with the first argmax, then
// dlogits = exp(l - max) * (1 / sum) / count - onehot / count in place of the logits when they
// alias. Three launches: the scored-row count (one block), the rows, and the loss / hit sums
// (one block, a fixed order, fp64) so the loss is the same bits every run.
#include <cmath>
#include <string>

#include "ops/nn/cuda/nn_common.cuh"
#include "ops/nn/cuda/train_cuda.h"

namespace kda::ops::cuda {
namespace {

using namespace nn_detail;

constexpr int kRowThreads = 512;
constexpr int kSumThreads = 256;

__device__ __forceinline__ float to_float(float v) {
  return v;
}
__device__ __forceinline__ float to_float(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

// A running softmax state: max m, sum s of exp(l - m), and the first index of the max.
struct Running {
  float m;
  float s;
  int64_t arg;
};

__device__ __forceinline__ Running combine(Running a, Running b) {
  if (b.s == 0.0f) return a;  // b saw nothing
  if (a.s == 0.0f) return b;
  Running r;
  if (b.m > a.m || (b.m == a.m && b.arg < a.arg)) {
    r.m = b.m;
    r.arg = b.arg;
  } else {
    r.m = a.m;
    r.arg = a.arg;
  }
  r.s = a.s * expf(a.m - r.m) + b.s * expf(b.m - r.m);
  return r;
}

__device__ __forceinline__ Running warp_combine(Running v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    Running other;
    other.m = __shfl_xor_sync(0xffffffffu, v.m, o);
    other.s = __shfl_xor_sync(0xffffffffu, v.s, o);
    other.arg = __shfl_xor_sync(0xffffffffu, v.arg, o);
    v = combine(v, other);
  }
  return v;
}

__global__ void count_scored_kernel(const int32_t* targets, int64_t rows, int32_t* count) {
  __shared__ int32_t warp_counts[32];
  int32_t c = 0;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) c += targets[r] >= 0;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
  if (threadIdx.x % 32 == 0) warp_counts[threadIdx.x / 32] = c;
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t total = 0;
    for (int w = 0; w < int(blockDim.x / 32); ++w) total += warp_counts[w];
    *count = total;
  }
}

template <class InT>
__global__ void __launch_bounds__(kRowThreads)
    cross_entropy_row_kernel(const InT* logits, const int32_t* targets, int64_t V, float* dlogits,
                             const int32_t* count, float* row_loss, int32_t* row_hit) {
  __shared__ Running warp_state[kRowThreads / 32];
  __shared__ float target_logit;
  const int64_t row = blockIdx.x;
  const InT* l = logits + row * V;
  float* d = dlogits + row * V;
  const int32_t t = targets[row];
  if (t < 0) {
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) d[v] = 0.0f;
    if (threadIdx.x == 0) {
      row_loss[row] = 0.0f;
      row_hit[row] = 0;
    }
    return;
  }
  if (t >= V) {  // a target outside the vocabulary: NaN, loudly
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) d[v] = NAN;
    if (threadIdx.x == 0) {
      row_loss[row] = NAN;
      row_hit[row] = 0;
    }
    return;
  }
  // Read before any thread writes d (which may be l).
  if (threadIdx.x == 0) target_logit = to_float(l[t]);
  Running state{-INFINITY, 0.0f, 0};
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    const float x = to_float(l[v]);
    if (x > state.m) {
      state.s = state.s * expf(state.m - x) + 1.0f;
      state.m = x;
      state.arg = v;
    } else {
      state.s += expf(x - state.m);
    }
  }
  state = warp_combine(state);
  if (threadIdx.x % 32 == 0) warp_state[threadIdx.x / 32] = state;
  __syncthreads();
  if (threadIdx.x < 32) {
    Running s = threadIdx.x < kRowThreads / 32 ? warp_state[threadIdx.x] : Running{-INFINITY, 0, 0};
    s = warp_combine(s);
    if (threadIdx.x == 0) warp_state[0] = s;
  }
  __syncthreads();
  const Running total = warp_state[0];
  const float inv_n = 1.0f / float(*count);
  if (threadIdx.x == 0) {
    row_loss[row] = total.m + logf(total.s) - target_logit;
    row_hit[row] = total.arg == t;
  }
  const float scale = (1.0f / total.s) * inv_n;
  // Each thread rewrites exactly the logits it read above, so aliasing is safe.
  for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
    float g = expf(to_float(l[v]) - total.m) * scale;
    if (v == t) g -= inv_n;
    d[v] = g;
  }
}

__global__ void cross_entropy_sums_kernel(const float* row_loss, const int32_t* row_hit,
                                          int64_t rows, const int32_t* count, float* loss_sum,
                                          int32_t* correct, int32_t* scored) {
  __shared__ double loss[kSumThreads];
  __shared__ int32_t hits[kSumThreads];
  double l = 0.0;
  int32_t h = 0;
  for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    l += row_loss[r];
    h += row_hit[r];
  }
  loss[threadIdx.x] = l;
  hits[threadIdx.x] = h;
  __syncthreads();
  for (int half = kSumThreads / 2; half > 0; half /= 2) {
    if (int(threadIdx.x) < half) {
      loss[threadIdx.x] += loss[threadIdx.x + half];
      hits[threadIdx.x] += hits[threadIdx.x + half];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    *loss_sum = float(loss[0]);
    if (correct) *correct = hits[0];
    if (scored) *scored = *count;
  }
}

}  // namespace

void cross_entropy_forward_backward(const void* logits, ElementType logits_type,
                                    const int32_t* targets, int64_t rows, int64_t V, float* dlogits,
                                    float* loss_sum, int32_t* correct, int32_t* scored,
                                    TrainScratch& scratch, cudaStream_t stream) {
  const char* what = "cuda::cross_entropy_forward_backward";
  require(rows >= 1 && V >= 1, std::string(what) + ": sizes must be positive");
  require(rows < (int64_t(1) << 31) && V < (int64_t(1) << 31),
          std::string(what) + ": too many rows or classes");
  require(logits && targets && dlogits && loss_sum, std::string(what) + ": null pointer");
  require(logits_type == ElementType::f32 || logits != dlogits,
          std::string(what) + ": bf16 logits cannot share memory with the fp32 dlogits");
  // Scratch: count, then row losses [rows], then row hits [rows].
  scratch.rows.reserve(size_t(2 * rows + 1) * sizeof(float));
  int32_t* count = scratch.rows.as<int32_t>();
  float* row_loss = scratch.rows.as<float>() + 1;
  int32_t* row_hit = count + 1 + rows;
  count_scored_kernel<<<1, 1024, 0, stream>>>(targets, rows, count);
  check_launch(what);
  dispatch_type(logits_type, [&](auto* tag) {
    using InT = std::remove_pointer_t<decltype(tag)>;
    cross_entropy_row_kernel<InT><<<unsigned(rows), kRowThreads, 0, stream>>>(
        static_cast<const InT*>(logits), targets, V, dlogits, count, row_loss, row_hit);
  });
  check_launch(what);
  cross_entropy_sums_kernel<<<1, kSumThreads, 0, stream>>>(row_loss, row_hit, rows, count, loss_sum,
                                                           correct, scored);
  check_launch(what);
}

}  // namespace kda::ops::cuda
