// Routed experts for many tokens: the (token, slot) pairs are sorted by expert on the device
// (a stable counting sort: within an expert, by token then slot), each used expert's rows are
// gathered into one contiguous block and run through two cuBLAS products, and a combine kernel
// adds the weighted rows back into y, each token's slots in order (deterministic, no atomics).
// The per-expert offsets come to the host once per call to size the products.
#include <cuda_bf16.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/error.h"
#include "ops/moe/cuda/moe_common.cuh"
#include "ops/moe/cuda/moe_internal.h"

namespace kda::ops::cuda::moe_detail {
namespace {

constexpr int kChunk = 512;         // pairs per block in the counting sort
constexpr int64_t kRowBucket = 64;  // expert row counts rounded up to this (see experts_prefill)

// chunk_counts[c, e] = how many pairs of chunk c chose expert e. Shared: E ints.
__global__ void __launch_bounds__(kChunk)
    count_chunks_kernel(const int32_t* __restrict__ ids, int64_t pairs, int E,
                        int32_t* __restrict__ chunk_counts) {
  extern __shared__ int hist[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int64_t p = int64_t(blockIdx.x) * kChunk + threadIdx.x;
  if (p < pairs) atomicAdd(&hist[ids[p]], 1);
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    chunk_counts[int64_t(blockIdx.x) * E + e] = hist[e];
}

// One block. Turns chunk_counts into each chunk's first position per expert in the sorted
// order, and writes offsets[E + 1] (expert e's pairs are [offsets[e], offsets[e + 1])).
// Shared: E + 1 ints.
__global__ void scan_counts_kernel(int32_t* __restrict__ chunk_counts, int64_t chunks, int E,
                                   int32_t* __restrict__ offsets) {
  extern __shared__ int start[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int running = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      const int v = chunk_counts[c * E + e];
      chunk_counts[c * E + e] = running;
      running += v;
    }
    start[e] = running;  // the expert's total for now
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int running = 0;
    for (int e = 0; e < E; ++e) {
      const int v = start[e];
      start[e] = running;
      offsets[e] = running;
      running += v;
    }
    offsets[E] = running;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    for (int64_t c = 0; c < chunks; ++c) chunk_counts[c * E + e] += start[e];
}

// order[pos] = pair and position[pair] = pos, pos = the chunk's start for the expert plus the
// pair's rank among the chunk's earlier pairs of the same expert (stable).
__global__ void __launch_bounds__(kChunk)
    scatter_pairs_kernel(const int32_t* __restrict__ ids, int64_t pairs, int E,
                         const int32_t* __restrict__ chunk_start, int32_t* __restrict__ order,
                         int32_t* __restrict__ position) {
  __shared__ int32_t chunk_ids[kChunk];
  const int64_t p = int64_t(blockIdx.x) * kChunk + threadIdx.x;
  chunk_ids[threadIdx.x] = p < pairs ? ids[p] : -1;
  __syncthreads();
  if (p >= pairs) return;
  const int32_t e = chunk_ids[threadIdx.x];
  int rank = 0;
  for (int q = 0; q < int(threadIdx.x); ++q) rank += chunk_ids[q] == e;
  const int32_t pos = chunk_start[int64_t(blockIdx.x) * E + e] + rank;
  order[pos] = int32_t(p);
  position[p] = pos;
}

// rows[pos] = x[token of order[pos]], rows copied in units U. grid (pairs).
template <class U>
__global__ void gather_rows_kernel(const U* __restrict__ x, int64_t units_per_row,
                                   const int32_t* __restrict__ order, int64_t top_k,
                                   U* __restrict__ rows) {
  const int64_t pos = blockIdx.x;
  const int64_t t = order[pos] / top_k;
  const U* src = x + t * units_per_row;
  U* dst = rows + pos * units_per_row;
  for (int64_t u = threadIdx.x; u < units_per_row; u += blockDim.x) dst[u] = src[u];
}

// act[r, i] = silu(h[r, i]) * h[r, I + i] for h [n, 2 I].
template <class T>
__global__ void swiglu_rows_kernel(const T* __restrict__ h, int64_t n, int64_t I,
                                   T* __restrict__ act) {
  const int64_t total = n * I;
  for (int64_t k = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; k < total;
       k += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = k / I, i = k - r * I;
    const float g = to_f32(h[r * 2 * I + i]);
    const float u = to_f32(h[r * 2 * I + I + i]);
    act[k] = from_f32<T>(silu(g) * u);
  }
}

// y[t, d] += sum_j w[t, j] out[position[t, j], d], slots in order. grid (T, ceil(D / 256)).
__global__ void combine_kernel(const float* __restrict__ out, const int32_t* __restrict__ position,
                               const float* __restrict__ weights, int64_t top_k, int64_t D,
                               float* __restrict__ y) {
  const int64_t t = blockIdx.x;
  const int64_t d = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  if (d >= D) return;
  float acc = 0.f;
  for (int64_t j = 0; j < top_k; ++j) {
    const int64_t pair = t * top_k + j;
    acc = fmaf(weights[pair], out[int64_t(position[pair]) * D + d], acc);
  }
  y[t * D + d] += acc;
}

const char* at(const void* base, int64_t elements, size_t element_size) {
  return static_cast<const char*>(base) + size_t(elements) * element_size;
}
char* at(void* base, int64_t elements, size_t element_size) {
  return static_cast<char*>(base) + size_t(elements) * element_size;
}

void gather_rows(const void* x, int64_t D, size_t esize, const int32_t* order, int64_t pairs,
                 int64_t top_k, void* rows, cudaStream_t stream) {
  const size_t row_bytes = size_t(D) * esize;
  const unsigned grid = unsigned(pairs);
  if (row_bytes % 16 == 0 && aligned16(x) && aligned16(rows)) {
    gather_rows_kernel<uint4><<<grid, 128, 0, stream>>>(static_cast<const uint4*>(x),
                                                        int64_t(row_bytes / 16), order, top_k,
                                                        static_cast<uint4*>(rows));
  } else if (row_bytes % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 4 == 0) {
    gather_rows_kernel<uint32_t><<<grid, 256, 0, stream>>>(static_cast<const uint32_t*>(x),
                                                           int64_t(row_bytes / 4), order, top_k,
                                                           static_cast<uint32_t*>(rows));
  } else {
    gather_rows_kernel<uint16_t><<<grid, 256, 0, stream>>>(static_cast<const uint16_t*>(x),
                                                           int64_t(row_bytes / 2), order, top_k,
                                                           static_cast<uint16_t*>(rows));
  }
  check_launch("moe prefill (gather)");
}

}  // namespace

void experts_prefill(const MoeDeviceWeights& w, int64_t num_experts, const void* x, int64_t T,
                     int64_t top_k, const int32_t* ids, const float* weights, float* y,
                     MoeDeviceWorkspace& ws, Gemm& gemm) {
  cudaStream_t stream = gemm.stream();
  const int64_t D = w.D, I = w.I, E = num_experts, pairs = T * top_k;
  const ElementType type = w.expert_type;
  const size_t esize = element_bytes(type);
  require(pairs < (int64_t(1) << 31), "moe prefill: too many (token, expert) pairs");
  require(size_t(E + 1) * sizeof(int) <= 48 * 1024, "moe prefill: too many experts");
  const int64_t chunks = (pairs + kChunk - 1) / kChunk;

  ws.order.reserve(size_t(2 * pairs) * sizeof(int32_t));
  ws.counts.reserve(size_t(chunks * E + E + 1) * sizeof(int32_t));
  // Each expert's products run on its row count rounded up to kRowBucket: cuBLAS picks a
  // kernel per new problem shape (a heuristic query costing ~0.1-1 ms), and exact counts make
  // almost every call of a prefill a new shape. The extra rows read the next expert's rows (or
  // the slack below) and write outputs that the next expert's products overwrite, in stream
  // order; the last expert's land in the slack.
  const int64_t rows_alloc = pairs + kRowBucket;
  ws.rows.reserve(size_t(rows_alloc * D) * esize);
  ws.hidden.reserve(size_t(rows_alloc * 2 * I) * esize);
  ws.act.reserve(size_t(rows_alloc * I) * esize);
  ws.out.reserve(size_t(rows_alloc * D) * sizeof(float));
  int32_t* order = ws.order.as<int32_t>();
  int32_t* position = order + pairs;
  int32_t* chunk_counts = ws.counts.as<int32_t>();
  int32_t* offsets = chunk_counts + chunks * E;

  // Counting sort of the pairs by expert.
  const size_t hist_bytes = size_t(E) * sizeof(int);
  count_chunks_kernel<<<unsigned(chunks), kChunk, hist_bytes, stream>>>(ids, pairs, int(E),
                                                                        chunk_counts);
  check_launch("moe prefill (count)");
  scan_counts_kernel<<<1, 256, hist_bytes + sizeof(int), stream>>>(chunk_counts, chunks, int(E),
                                                                   offsets);
  check_launch("moe prefill (scan)");
  scatter_pairs_kernel<<<unsigned(chunks), kChunk, 0, stream>>>(ids, pairs, int(E), chunk_counts,
                                                                order, position);
  check_launch("moe prefill (scatter)");
  gather_rows(x, D, esize, order, pairs, top_k, ws.rows.data(), stream);

  // The only host wait: how many rows each expert has.
  thread_local std::vector<int32_t> host_offsets;
  host_offsets.resize(size_t(E + 1));
  check_cuda(cudaMemcpyAsync(host_offsets.data(), offsets, size_t(E + 1) * sizeof(int32_t),
                             cudaMemcpyDeviceToHost, stream),
             "moe prefill (offsets to host)");
  check_cuda(cudaStreamSynchronize(stream), "moe prefill (offsets to host)");
  require(host_offsets[size_t(E)] == pairs, "moe prefill: the expert counts do not add up");

  auto bucketed = [](int64_t n) { return (n + kRowBucket - 1) / kRowBucket * kRowBucket; };
  for (int64_t e = 0; e < E; ++e) {
    const int64_t first = host_offsets[size_t(e)], n = host_offsets[size_t(e + 1)] - first;
    if (n == 0) continue;
    gemm.linear(type, bucketed(n), 2 * I, D, {at(ws.rows.data(), first * D, esize), 0},
                {at(w.gate_up, e * 2 * I * D, esize), 0},
                {at(ws.hidden.data(), first * 2 * I, esize), type, 0});
  }
  const int64_t total = pairs * I;
  const unsigned swiglu_grid = unsigned(std::min<int64_t>((total + 255) / 256, 65536));
  if (type == ElementType::bf16)
    swiglu_rows_kernel<__nv_bfloat16><<<swiglu_grid, 256, 0, stream>>>(
        ws.hidden.as<__nv_bfloat16>(), pairs, I, ws.act.as<__nv_bfloat16>());
  else
    swiglu_rows_kernel<float>
        <<<swiglu_grid, 256, 0, stream>>>(ws.hidden.as<float>(), pairs, I, ws.act.as<float>());
  check_launch("moe prefill (swiglu)");
  for (int64_t e = 0; e < E; ++e) {
    const int64_t first = host_offsets[size_t(e)], n = host_offsets[size_t(e + 1)] - first;
    if (n == 0) continue;
    gemm.linear(type, bucketed(n), D, I, {at(ws.act.data(), first * I, esize), 0},
                {at(w.down, e * D * I, esize), 0},
                {at(ws.out.data(), first * D, sizeof(float)), ElementType::f32, 0});
  }
  const dim3 combine_grid(unsigned(T), unsigned((D + 255) / 256));
  combine_kernel<<<combine_grid, 256, 0, stream>>>(ws.out.as<float>(), position, weights, top_k, D,
                                                   y);
  check_launch("moe prefill (combine)");
}

}  // namespace kda::ops::cuda::moe_detail
