// AdamW over a fixed set of tensors in three launches (instead of three per tensor): the squared
// gradient norm by chunks (fp64, a fixed order), the clipping factor in one block, then the
// update by chunks, which reads the factor from device memory, so the host never waits between
// them. Chunks are slices of one tensor (kChunk elements at most); a block per chunk. Both
// passes are bound by memory: a tensor whose arrays allow it is read and written 4 elements at a
// time (the few elements past the last multiple of 4 one at a time), each thread loading kUnroll
// vectors before it uses them, so that many loads are in flight.
#include <cmath>
#include <string>
#include <vector>

#include "ops/nn/cuda/nn_common.cuh"
#include "ops/nn/cuda/train_cuda.h"

namespace kda::ops::cuda {
namespace {

using namespace nn_detail;

constexpr int kThreads = 256;
constexpr int kUnroll = 2;  // 4-element vectors per array per thread and round
constexpr int64_t kChunk = int64_t(1) << 15;
static_assert(kChunk % 4 == 0, "a chunk of an aligned tensor must start 16-byte aligned");

struct Slot {
  float* param;
  const float* grad;
  float* m;
  float* v;
  __nv_bfloat16* copy;  // null: no compute copy
  int64_t n;
  int decay;  // 1: weight decay applies
  int vec4;   // 1: every array allows 4-element accesses (16 bytes; the copy 8)
};

struct Chunk {
  int32_t slot;
  int64_t begin, end;
};

struct NormResult {
  double norm;  // sqrt of the sum of squares
  float clip;   // the gradient scale of this step
  int finite;   // 0: nothing is updated
};

// The end of a chunk's 4-wide part (begin is a multiple of 4, as kChunk is; none when the
// tensor's arrays are not aligned for it).
__device__ __forceinline__ int64_t vector_end(const Slot& t, const Chunk& c) {
  return t.vec4 ? c.begin + (c.end - c.begin) / 4 * 4 : c.begin;
}

// Each thread sums its elements' squares in a fixed order (its vectors in index order, then its
// tail elements), then the block adds the threads' sums in a fixed tree.
__global__ void __launch_bounds__(kThreads)
    chunk_squares_kernel(const Slot* slots, const Chunk* chunks, double* partials) {
  __shared__ double shared[kThreads];
  const Chunk c = chunks[blockIdx.x];
  const Slot t = slots[c.slot];
  const float* g = t.grad;
  const int64_t vend = vector_end(t, c);
  double s = 0.0;
  constexpr int64_t kRound = int64_t(4) * kThreads * kUnroll;
  for (int64_t base = c.begin + int64_t(threadIdx.x) * 4; base < vend; base += kRound) {
    Vec<4> a[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (base + u * 4 * kThreads < vend) a[u] = load_vec<4>(g + base + u * 4 * kThreads);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * 4 * kThreads < vend) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const double x = a[u].v[k];
          s += x * x;
        }
      }
    }
  }
  for (int64_t i = vend + threadIdx.x; i < c.end; i += kThreads) {
    const double x = g[i];
    s += x * x;
  }
  s = block_sum_fixed<kThreads>(s, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

__global__ void norm_clip_kernel(const double* partials, int64_t chunks, float clip_norm,
                                 NormResult* out) {
  __shared__ double shared[kThreads];
  double s = 0.0;
  for (int64_t b = threadIdx.x; b < chunks; b += kThreads) s += partials[b];
  s = block_sum_fixed<kThreads>(s, shared);
  if (threadIdx.x == 0) {
    const double norm = sqrt(s);
    out->norm = norm;
    out->finite = isfinite(norm) ? 1 : 0;
    // train::AdamW's rule: scale down to clip_norm when the norm exceeds it
    out->clip = clip_norm > 0 && norm > double(clip_norm) ? float(double(clip_norm) / norm) : 1.0f;
  }
}

// Block b updates chunk (chunks - 1 - b): the last chunks the norm pass read are the ones most
// likely still in L2 when this pass starts. Every element goes through adamw_math, as
// adamw_step's kernel, so the two agree bit for bit.
__global__ void __launch_bounds__(kThreads)
    chunk_adamw_kernel(const Slot* slots, const Chunk* chunks, int64_t num_chunks,
                       const NormResult* norm, float lr, float b1, float b2, float eps,
                       float weight_decay, float c1, float c2) {
  if (!norm->finite) return;
  const float clip = norm->clip;
  const Chunk c = chunks[num_chunks - 1 - int64_t(blockIdx.x)];
  const Slot t = slots[c.slot];
  const float decay = t.decay ? __fmul_rn(lr, weight_decay) : 0.0f;
  const int64_t vend = vector_end(t, c);
  constexpr int64_t kRound = int64_t(4) * kThreads * kUnroll;
  for (int64_t base = c.begin + int64_t(threadIdx.x) * 4; base < vend; base += kRound) {
    Vec<4> w[kUnroll], g[kUnroll], m[kUnroll], v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = base + u * 4 * kThreads;
      if (j < vend) {
        w[u] = load_vec<4>(t.param + j);
        g[u] = load_vec<4>(t.grad + j);
        m[u] = load_vec<4>(t.m + j);
        v[u] = load_vec<4>(t.v + j);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = base + u * 4 * kThreads;
      if (j < vend) {
#pragma unroll
        for (int k = 0; k < 4; ++k)
          adamw_math(w[u].v[k], g[u].v[k], m[u].v[k], v[u].v[k], lr, b1, b2, eps, decay, c1, c2,
                     clip);
        store_vec<4>(t.param + j, w[u]);
        store_vec<4>(t.m + j, m[u]);
        store_vec<4>(t.v + j, v[u]);
        if (t.copy) store_vec<4>(t.copy + j, w[u]);
      }
    }
  }
  for (int64_t j = vend + threadIdx.x; j < c.end; j += kThreads) {
    const float w =
        adamw_update(t.param, t.grad, t.m, t.v, j, lr, b1, b2, eps, decay, c1, c2, clip);
    if (t.copy) t.copy[j] = __float2bfloat16_rn(w);
  }
}

}  // namespace

AdamWMultiTensor::AdamWMultiTensor(const std::vector<AdamWTensor>& tensors) {
  std::vector<Slot> slots;
  std::vector<Chunk> chunks;
  for (const AdamWTensor& t : tensors) {
    require(t.n >= 0, "cuda::AdamWMultiTensor: a tensor has a negative size");
    require(t.n == 0 || (t.param && t.grad && t.m && t.v), "cuda::AdamWMultiTensor: null pointer");
    require(int64_t(slots.size()) < (int64_t(1) << 31), "cuda::AdamWMultiTensor: too many tensors");
    const int32_t index = int32_t(slots.size());
    const bool vec4 = aligned_for(t.param, 4, 4) && aligned_for(t.grad, 4, 4) &&
                      aligned_for(t.m, 4, 4) && aligned_for(t.v, 4, 4) &&
                      aligned_for(t.bf16_copy, 4, 2);
    slots.push_back(Slot{t.param, t.grad, t.m, t.v, static_cast<__nv_bfloat16*>(t.bf16_copy), t.n,
                         t.decay ? 1 : 0, vec4 ? 1 : 0});
    for (int64_t b = 0; b < t.n; b += kChunk)
      chunks.push_back(Chunk{index, b, std::min(t.n, b + kChunk)});
  }
  num_chunks_ = int64_t(chunks.size());
  require(num_chunks_ < (int64_t(1) << 31), "cuda::AdamWMultiTensor: too many chunks");
  slots_.resize(std::max<size_t>(1, slots.size()) * sizeof(Slot));
  chunks_.resize(std::max<size_t>(1, chunks.size()) * sizeof(Chunk));
  partials_.resize(std::max<size_t>(1, chunks.size()) * sizeof(double));
  result_.resize(sizeof(NormResult));
  if (!slots.empty()) slots_.upload(slots.data(), slots.size() * sizeof(Slot));
  if (!chunks.empty()) chunks_.upload(chunks.data(), chunks.size() * sizeof(Chunk));
}

void AdamWMultiTensor::step(const AdamWHyper& hyper, int64_t step, float clip_norm,
                            cudaStream_t stream) {
  const char* what = "cuda::AdamWMultiTensor::step";
  require(step >= 1, std::string(what) + ": step is the 1-based number of this update");
  require(hyper.lr > 0 && hyper.beta1 >= 0 && hyper.beta1 < 1 && hyper.beta2 >= 0 &&
              hyper.beta2 < 1 && hyper.eps > 0 && hyper.weight_decay >= 0,
          std::string(what) + ": bad hyper-parameters");
  // (an empty set still writes a zero norm)
  const unsigned blocks = unsigned(std::max<int64_t>(1, num_chunks_));
  const auto* slots = slots_.as<Slot>();
  const auto* chunks = chunks_.as<Chunk>();
  auto* result = result_.as<NormResult>();
  if (num_chunks_ > 0) {
    chunk_squares_kernel<<<blocks, kThreads, 0, stream>>>(slots, chunks, partials_.as<double>());
    check_launch(what);
  }
  norm_clip_kernel<<<1, kThreads, 0, stream>>>(partials_.as<double>(), num_chunks_, clip_norm,
                                               result);
  check_launch(what);
  if (num_chunks_ == 0) return;
  // The bias corrections as the CPU computes them (float pow of the step).
  const float c1 = 1.0f - std::pow(hyper.beta1, float(step));
  const float c2 = 1.0f - std::pow(hyper.beta2, float(step));
  chunk_adamw_kernel<<<blocks, kThreads, 0, stream>>>(slots, chunks, num_chunks_, result, hyper.lr,
                                                      hyper.beta1, hyper.beta2, hyper.eps,
                                                      hyper.weight_decay, c1, c2);
  check_launch(what);
}

const double* AdamWMultiTensor::norm_device() const {
  return reinterpret_cast<const double*>(result_.data());  // NormResult::norm comes first
}

}  // namespace kda::ops::cuda
