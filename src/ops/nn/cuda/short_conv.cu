// Causal depthwise short convolution + SiLU (ops/conv1d's short_conv_silu_forward on the GPU).
// Two kernels in stream order: the outputs read the OLD state, then the state update shifts in
// the last W - 1 inputs, so no output ever sees an updated state row.
#include <type_traits>

#include "ops/nn/cuda/nn_common.cuh"

namespace kda::ops::cuda {
namespace {

using namespace nn_detail;

constexpr int kConvThreads = 128;         // channels per block
constexpr int64_t kTokensPerThread = 16;  // at least; more when T would overflow grid.y
constexpr int kMaxWidth = 4;

// One thread per (channel, run of tokens): the window of the last W inputs lives in registers.
template <int W, class OutT>
__global__ void short_conv_silu_kernel(const float* x, int64_t T, int64_t C, int64_t x_stride,
                                       const float* weight, const float* state, int64_t tokens,
                                       OutT* y, int64_t y_stride) {
  constexpr int P = W - 1;  // past inputs in the window
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t t0 = int64_t(blockIdx.y) * tokens;
  if (c >= C || t0 >= T) return;
  const int64_t t1 = t0 + tokens < T ? t0 + tokens : T;
  // window[j] = input at time t - P + j; times < 0 read the state (time -1 is its last row).
  float w[W], window[W];
#pragma unroll
  for (int j = 0; j < W; ++j) w[j] = weight[c * W + j];
#pragma unroll
  for (int j = 0; j < P; ++j) {
    const int64_t s = t0 - P + j;
    window[j] = s >= 0 ? x[s * x_stride + c] : state[(P + s) * C + c];
  }
  for (int64_t t = t0; t < t1; ++t) {
    window[P] = x[t * x_stride + c];
    float acc = 0.0f;  // in the CPU's order
#pragma unroll
    for (int j = 0; j < W; ++j) acc += w[j] * window[j];
    const float out = acc / (1.0f + expf(-acc));
    if constexpr (std::is_same_v<OutT, float>)
      y[t * y_stride + c] = out;
    else
      y[t * y_stride + c] = __float2bfloat16_rn(out);
#pragma unroll
    for (int j = 0; j < P; ++j) window[j] = window[j + 1];
  }
}

// state <- the last P inputs: row r is time T - P + r, from x, or (T < P) from the old state row
// r + T; rows go up in order, so each reads its source before that row is overwritten.
__global__ void short_conv_state_kernel(const float* x, int64_t T, int64_t C, int64_t x_stride,
                                        int64_t P, float* state) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= C) return;
  for (int64_t r = 0; r < P; ++r) {
    const int64_t s = T - P + r;
    state[r * C + c] = s >= 0 ? x[s * x_stride + c] : state[(P + s) * C + c];
  }
}

}  // namespace

void short_conv_silu(const float* x, int64_t T, int64_t C, int64_t x_stride, const float* weight,
                     int64_t W, float* state, OutRows y, cudaStream_t stream) {
  require(T >= 0 && C >= 1, "cuda::short_conv_silu: sizes must be positive");
  require(W >= 1 && W <= kMaxWidth, "cuda::short_conv_silu: kernel width W must be in [1, " +
                                        std::to_string(kMaxWidth) + "], got " + std::to_string(W));
  const int64_t xs = x_stride > 0 ? x_stride : C;
  require(xs >= C, "cuda::short_conv_silu: x_stride smaller than C");
  check_out(y, C, "cuda::short_conv_silu");
  if (T == 0) return;
  require(x && weight && y.data, "cuda::short_conv_silu: null pointer");
  require(state != nullptr || W == 1, "cuda::short_conv_silu: null state");
  require(y.data != static_cast<const void*>(x),
          "cuda::short_conv_silu: y must not overlap x (the state update reads x afterwards)");
  const int64_t ys = out_stride(y, C);
  const int64_t tokens = std::max(kTokensPerThread, ceil_div(T, 65535));
  const dim3 grid(unsigned(ceil_div(C, kConvThreads)), unsigned(ceil_div(T, tokens)));
  require(ceil_div(C, kConvThreads) < (int64_t(1) << 31), "cuda::short_conv_silu: C too large");
  dispatch_type(y.type, [&](auto* tag) {
    using OutT = std::remove_pointer_t<decltype(tag)>;
    OutT* yp = static_cast<OutT*>(y.data);
    auto launch = [&](auto width) {
      short_conv_silu_kernel<decltype(width)::value, OutT>
          <<<grid, kConvThreads, 0, stream>>>(x, T, C, xs, weight, state, tokens, yp, ys);
    };
    switch (W) {
      case 1:
        launch(Int<1>{});
        break;
      case 2:
        launch(Int<2>{});
        break;
      case 3:
        launch(Int<3>{});
        break;
      default:
        launch(Int<4>{});
        break;
    }
  });
  check_launch("cuda::short_conv_silu (outputs)");
  if (W > 1) {
    short_conv_state_kernel<<<unsigned(ceil_div(C, kConvThreads)), kConvThreads, 0, stream>>>(
        x, T, C, xs, W - 1, state);
    check_launch("cuda::short_conv_silu (state)");
  }
}

}  // namespace kda::ops::cuda
