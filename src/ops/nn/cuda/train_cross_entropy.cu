// Cross-entropy forward and backward on the GPU, train::cross_entropy's formulas: one block per
// row, an fp32 online max / sum of exponentials (one exp per logit) with the first argmax, then
// dlogits = exp(l - max) * (1 / sum) / count - onehot / count in place of the logits when they
// alias (fp32 or bf16, rows read 4 logits at a time when aligned). Three launches: the scored-row
// count (one block), the rows, and the loss / hit sums (one block, a fixed order, fp64) so the loss
// is the same bits every run.
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

// One row per block, VW consecutive logits per thread and step (VW = 4 needs V % 4 == 0 and
// aligned rows: 16-byte fp32 / 8-byte bf16 accesses).
template <class InT, class OutT, int VW>
__global__ void __launch_bounds__(kRowThreads)
    cross_entropy_row_kernel(const InT* logits, const int32_t* targets, int64_t V, OutT* dlogits,
                             const int32_t* count, float* row_loss, int32_t* row_hit) {
  __shared__ Running warp_state[kRowThreads / 32];
  __shared__ float target_logit;
  const int64_t row = blockIdx.x;
  const InT* l = logits + row * V;
  OutT* d = dlogits + row * V;
  const int32_t t = targets[row];
  if (t < 0 || t >= V) {  // not scored: zeros; a target outside the vocabulary: NaN, loudly
    Vec<VW> fill;
#pragma unroll
    for (int i = 0; i < VW; ++i) fill.v[i] = t < 0 ? 0.0f : NAN;
    for (int64_t v = int64_t(threadIdx.x) * VW; v < V; v += int64_t(blockDim.x) * VW)
      store_vec<VW>(d + v, fill);
    if (threadIdx.x == 0) {
      row_loss[row] = t < 0 ? 0.0f : NAN;
      row_hit[row] = 0;
    }
    return;
  }
  // Read before any thread writes d (which may be l).
  if (threadIdx.x == 0) target_logit = to_float(l[t]);
  Running state{-INFINITY, 0.0f, 0};
  for (int64_t v = int64_t(threadIdx.x) * VW; v < V; v += int64_t(blockDim.x) * VW) {
    const Vec<VW> x = load_vec<VW>(l + v);
#pragma unroll
    for (int i = 0; i < VW; ++i) {
      if (x.v[i] > state.m) {
        state.s = state.s * expf(state.m - x.v[i]) + 1.0f;
        state.m = x.v[i];
        state.arg = v + i;
      } else {
        state.s += expf(x.v[i] - state.m);
      }
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
  for (int64_t v = int64_t(threadIdx.x) * VW; v < V; v += int64_t(blockDim.x) * VW) {
    Vec<VW> g = load_vec<VW>(l + v);
#pragma unroll
    for (int i = 0; i < VW; ++i) {
      g.v[i] = expf(g.v[i] - total.m) * scale;
      if (v + i == t) g.v[i] -= inv_n;
    }
    store_vec<VW>(d + v, g);
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
                                    const int32_t* targets, int64_t rows, int64_t V, void* dlogits,
                                    ElementType dlogits_type, float* loss_sum, int32_t* correct,
                                    int32_t* scored, TrainScratch& scratch, cudaStream_t stream) {
  const char* what = "cuda::cross_entropy_forward_backward";
  require(rows >= 1 && V >= 1, std::string(what) + ": sizes must be positive");
  require(rows < (int64_t(1) << 31) && V < (int64_t(1) << 31),
          std::string(what) + ": too many rows or classes");
  require(logits && targets && dlogits && loss_sum, std::string(what) + ": null pointer");
  require(logits_type == dlogits_type || logits != dlogits,
          std::string(what) + ": logits and dlogits share memory but not their element type");
  // Scratch: count, then row losses [rows], then row hits [rows].
  scratch.rows.reserve(size_t(2 * rows + 1) * sizeof(float));
  int32_t* count = scratch.rows.as<int32_t>();
  float* row_loss = scratch.rows.as<float>() + 1;
  int32_t* row_hit = count + 1 + rows;
  count_scored_kernel<<<1, 1024, 0, stream>>>(targets, rows, count);
  check_launch(what);
  const bool vector = V % 4 == 0 && aligned_for(logits, 4, element_bytes(logits_type)) &&
                      aligned_for(dlogits, 4, element_bytes(dlogits_type));
  dispatch_type(logits_type, [&](auto* in_tag) {
    dispatch_type(dlogits_type, [&](auto* out_tag) {
      using InT = std::remove_pointer_t<decltype(in_tag)>;
      using OutT = std::remove_pointer_t<decltype(out_tag)>;
      const auto* in = static_cast<const InT*>(logits);
      auto* out = static_cast<OutT*>(dlogits);
      if (vector)
        cross_entropy_row_kernel<InT, OutT, 4><<<unsigned(rows), kRowThreads, 0, stream>>>(
            in, targets, V, out, count, row_loss, row_hit);
      else
        cross_entropy_row_kernel<InT, OutT, 1><<<unsigned(rows), kRowThreads, 0, stream>>>(
            in, targets, V, out, count, row_loss, row_hit);
    });
  });
  check_launch(what);
  cross_entropy_sums_kernel<<<1, kSumThreads, 0, stream>>>(row_loss, row_hit, rows, count, loss_sum,
                                                           correct, scored);
  check_launch(what);
}

}  // namespace kda::ops::cuda
