// The squared norm of a gradient, deterministically: a fixed grid (a function of n only) of
// blocks each sums a fixed set of elements in fp64 and reduces in a fixed tree, then one block
// adds the block sums in the same fixed way into the device scalar.
#include "ops/nn/cuda/nn_common.cuh"
#include "ops/nn/cuda/train_cuda.h"

namespace kda::ops::cuda {
namespace {

using namespace nn_detail;

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1024;

__global__ void squares_partials_kernel(const float* x, int64_t n, double* partials) {
  __shared__ double shared[kThreads];
  double s = 0.0;
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    const double v = x[i];
    s += v * v;
  }
  s = block_sum_fixed<kThreads>(s, shared);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

__global__ void squares_finish_kernel(const double* partials, int64_t blocks, float* out) {
  __shared__ double shared[kThreads];
  double s = 0.0;
  for (int64_t b = threadIdx.x; b < blocks; b += blockDim.x) s += partials[b];
  s = block_sum_fixed<kThreads>(s, shared);
  if (threadIdx.x == 0) *out = float(double(*out) + s);
}

}  // namespace

void sum_of_squares(const float* x, int64_t n, float* out, TrainScratch& scratch,
                    cudaStream_t stream) {
  require(n >= 0, "cuda::sum_of_squares: n must not be negative");
  if (n == 0) return;
  require(x && out, "cuda::sum_of_squares: null pointer");
  const int64_t blocks = std::min<int64_t>(kMaxBlocks, ceil_div(n, int64_t(kThreads) * 4));
  scratch.partials.reserve(size_t(blocks) * sizeof(double));
  double* partials = scratch.partials.as<double>();
  squares_partials_kernel<<<unsigned(blocks), kThreads, 0, stream>>>(x, n, partials);
  check_launch("cuda::sum_of_squares (partials)");
  squares_finish_kernel<<<1, kThreads, 0, stream>>>(partials, blocks, out);
  check_launch("cuda::sum_of_squares (finish)");
}

}  // namespace kda::ops::cuda
