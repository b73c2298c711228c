// gated_rms_norm_sigmoid_train_backward: a warp per row for dx and dgate (fp32 arithmetic, the
// row sums in fp32), and the weight gradient as column sums over fixed row chunks.
#include <cuda_bf16.h>

#include <algorithm>

#include "ops/nn/cuda/gated_norm_train_cuda.h"
#include "ops/nn/cuda/nn_common.cuh"

namespace kda::ops::cuda {
namespace {

using namespace nn_detail;

constexpr int kWarps = 8;
constexpr int kChunkRows = 64;
constexpr int kColumnThreads = 128;

// A warp per row: dx, dgate, and the row's dw terms dy n s into terms [rows, D] (fp32).
template <class X, class DY, class DX, class DG>
__global__ void gated_norm_backward_kernel(const X* x, const float* gate, int64_t rows, int64_t D,
                                           const float* w, float eps, const DY* dy, DX* dx,
                                           int64_t dx_stride, DG* dgate, int64_t dg_stride,
                                           float* terms) {
  const int64_t r = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const X* xr = x + r * D;
  const float* gr = gate + r * D;
  const DY* dyr = dy + r * D;
  float ss = 0.0f;
  for (int64_t i = lane; i < D; i += 32) {
    const float v = load1(xr + i);
    ss += v * v;
  }
  ss = warp_sum(ss);
  const float inv = 1.0f / sqrtf(ss / float(D) + eps);
  float dot = 0.0f;
  for (int64_t i = lane; i < D; i += 32) {
    const float s = 1.0f / (1.0f + expf(-gr[i]));
    const float n = load1(xr + i) * inv;
    const float d = load1(dyr + i);
    const float dn = d * w[i] * s;
    dot += dn * n;
    terms[r * D + i] = d * n * s;
    store1(dgate + r * dg_stride + i, d * w[i] * n * s * (1.0f - s));
  }
  const float mean = warp_sum(dot) / float(D);
  for (int64_t i = lane; i < D; i += 32) {
    const float s = 1.0f / (1.0f + expf(-gr[i]));
    const float n = load1(xr + i) * inv;
    store1(dx + r * dx_stride + i, inv * (load1(dyr + i) * w[i] * s - n * mean));
  }
}

// partials[chunk, col] = sum over the chunk's rows, in order.
__global__ void chunk_column_sums(const float* terms, int64_t rows, int64_t D, float* partials) {
  const int64_t col = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  if (col >= D) return;
  const int64_t first = int64_t(blockIdx.x) * kChunkRows;
  const int64_t end = std::min(rows, first + kChunkRows);
  float s = 0.0f;
  for (int64_t r = first; r < end; ++r) s += terms[r * D + col];
  partials[int64_t(blockIdx.x) * D + col] = s;
}

__global__ void add_chunks(const float* partials, int64_t chunks, int64_t D, float* out) {
  const int64_t col = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= D) return;
  float s = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) s += partials[c * D + col];
  out[col] += s;
}

}  // namespace

void gated_rms_norm_sigmoid_train_backward(const void* x, ElementType x_type, const float* gate,
                                           int64_t rows, int64_t D, const float* weight, float eps,
                                           const void* dy, ElementType dy_type, OutRows dx,
                                           OutRows dgate, float* dweight, DeviceBuffer& partials,
                                           cudaStream_t stream) {
  require(rows >= 0 && D >= 1, "gated_rms_norm_sigmoid_train_backward: bad sizes");
  check_out(dx, D, "gated_rms_norm_sigmoid_train_backward (dx)");
  check_out(dgate, D, "gated_rms_norm_sigmoid_train_backward (dgate)");
  if (rows == 0) return;
  require(rows < (int64_t(1) << 31) && D <= 65535 * kColumnThreads,
          "gated_rms_norm_sigmoid_train_backward: too many rows or columns");
  const int64_t chunks = ceil_div(rows, kChunkRows);
  const size_t need = size_t(rows * D + chunks * D) * 4;
  if (partials.bytes() < need) {
    check_cuda(cudaStreamSynchronize(stream), "gated norm backward: scratch");
    partials.resize(need);
  }
  float* terms = partials.as<float>();
  float* sums = terms + rows * D;
  dispatch_type(x_type, [&](auto* xt) {
    using X = std::remove_pointer_t<decltype(xt)>;
    dispatch_type(dy_type, [&](auto* dyt) {
      using DY = std::remove_pointer_t<decltype(dyt)>;
      dispatch_type(dx.type, [&](auto* dxt) {
        using DX = std::remove_pointer_t<decltype(dxt)>;
        dispatch_type(dgate.type, [&](auto* dgt) {
          using DG = std::remove_pointer_t<decltype(dgt)>;
          gated_norm_backward_kernel<<<unsigned(ceil_div(rows, kWarps)), 32 * kWarps, 0, stream>>>(
              static_cast<const X*>(x), gate, rows, D, weight, eps, static_cast<const DY*>(dy),
              static_cast<DX*>(dx.data), out_stride(dx, D), static_cast<DG*>(dgate.data),
              out_stride(dgate, D), terms);
        });
      });
    });
  });
  check_launch("gated_rms_norm_sigmoid_train_backward");
  const unsigned col_blocks = unsigned(ceil_div(D, kColumnThreads));
  chunk_column_sums<<<dim3(unsigned(chunks), col_blocks), kColumnThreads, 0, stream>>>(terms, rows,
                                                                                       D, sums);
  check_launch("gated_rms_norm_sigmoid_train_backward (dw chunks)");
  add_chunks<<<col_blocks, kColumnThreads, 0, stream>>>(sums, chunks, D, dweight);
  check_launch("gated_rms_norm_sigmoid_train_backward (dw)");
}

}  // namespace kda::ops::cuda
