// The embedding backward without atomics: the rows are sorted by id with CUB's stable radix sort
// (so rows of one id stay in row order), then a block per run of equal ids adds that run's rows
// of dy into its table row, a thread per column, starting from the table's value and adding in
// row order: exactly the CPU's sequential scatter-add, every run.
#include <cub/device/device_radix_sort.cuh>
#include <string>

#include "ops/nn/cuda/nn_common.cuh"
#include "ops/nn/cuda/train_cuda.h"

namespace kda::ops::cuda {
namespace {

using namespace nn_detail;

constexpr int kThreads = 256;

// keys[r] = ids[r], or vocab (sorted last, then skipped) for an id outside the table.
__global__ void embedding_keys_kernel(const int32_t* ids, int64_t rows, int64_t vocab,
                                      uint32_t* keys, int32_t* order) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < rows; r += step) {
    const int32_t id = ids[r];
    keys[r] = id >= 0 && id < vocab ? uint32_t(id) : uint32_t(vocab);
    order[r] = int32_t(r);
  }
}

// Block (p, column block): when sorted position p starts a run of one id, adds the run's rows.
// A run can be most of the batch (the recall tasks repeat one id on 1/3 to 5/8 of their rows),
// and the adds must stay in row order to equal the CPU. So the run's end is found first (keys are
// sorted: a binary search), and each thread loads kAhead rows' values before adding them one by
// one: the loads overlap, where one load at a time made a chain of run-length round trips.
constexpr int kAhead = 16;

__global__ void embedding_runs_kernel(const uint32_t* keys, const int32_t* order, int64_t rows,
                                      int64_t D, int64_t vocab, const float* dy, float* dtable) {
  const int64_t p = blockIdx.x;
  const uint32_t key = keys[p];
  if (key >= uint32_t(vocab) || (p > 0 && keys[p - 1] == key)) return;
  const int64_t col = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  if (col >= D) return;
  int64_t lo = p + 1, hi = rows;  // the first position past the run lies in [lo, hi]
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (keys[mid] == key)
      lo = mid + 1;
    else
      hi = mid;
  }
  const int64_t end = lo;
  float* out = dtable + int64_t(key) * D + col;
  float s = *out;
  int64_t q = p;
  for (; q + kAhead <= end; q += kAhead) {
    float v[kAhead];
#pragma unroll
    for (int i = 0; i < kAhead; ++i) v[i] = dy[int64_t(order[q + i]) * D + col];
#pragma unroll
    for (int i = 0; i < kAhead; ++i) s += v[i];
  }
  for (; q < end; ++q) s += dy[int64_t(order[q]) * D + col];
  *out = s;
}

int key_bits(int64_t vocab) {
  int bits = 1;
  while (bits < 32 && (int64_t(1) << bits) <= vocab) ++bits;  // vocab itself must fit
  return bits;
}

}  // namespace

void embedding_backward(const int32_t* ids, const float* dy, int64_t rows, int64_t D, int64_t vocab,
                        float* dtable, TrainScratch& scratch, cudaStream_t stream) {
  const char* what = "cuda::embedding_backward";
  require(rows >= 0 && D >= 1 && vocab >= 1, std::string(what) + ": sizes must be positive");
  require(rows < (int64_t(1) << 31) && vocab < (int64_t(1) << 31),
          std::string(what) + ": too many rows or table rows");
  require(ceil_div(D, kThreads) < 65536, std::string(what) + ": rows too wide");
  if (rows == 0) return;
  require(ids && dy && dtable, std::string(what) + ": null pointer");
  const int n = int(rows);
  const int bits = key_bits(vocab);
  size_t sort_bytes = 0;
  check_cuda(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, static_cast<uint32_t*>(nullptr),
                                             static_cast<uint32_t*>(nullptr),
                                             static_cast<int32_t*>(nullptr),
                                             static_cast<int32_t*>(nullptr), n, 0, bits, stream),
             what);
  // Scratch: keys in / out, order in / out (rows each), then CUB's temporary storage.
  const size_t arrays = size_t(rows) * 4 * sizeof(uint32_t);
  const size_t temp_offset = (arrays + 255) / 256 * 256;
  scratch.sort.reserve(temp_offset + sort_bytes);
  char* base = static_cast<char*>(scratch.sort.data());
  uint32_t* keys_in = reinterpret_cast<uint32_t*>(base);
  uint32_t* keys_out = keys_in + rows;
  int32_t* order_in = reinterpret_cast<int32_t*>(keys_out + rows);
  int32_t* order_out = order_in + rows;
  embedding_keys_kernel<<<grid_for(rows, kThreads), kThreads, 0, stream>>>(ids, rows, vocab,
                                                                           keys_in, order_in);
  check_launch(what);
  check_cuda(cub::DeviceRadixSort::SortPairs(base + temp_offset, sort_bytes, keys_in, keys_out,
                                             order_in, order_out, n, 0, bits, stream),
             what);
  const dim3 grid(unsigned(rows), unsigned(ceil_div(D, kThreads)));
  embedding_runs_kernel<<<grid, kThreads, 0, stream>>>(keys_out, order_out, rows, D, vocab, dy,
                                                       dtable);
  check_launch(what);
}

}  // namespace kda::ops::cuda
