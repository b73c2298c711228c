// The embedding backward without atomics on the table: the rows are sorted by id with CUB's stable
// radix sort (so rows of one id stay in row order) and CUB's select lists where each run of one
// id starts. Every run is then added into its table row, one thread a column, starting from the
// table's value and adding in row order: exactly the CPU's sequential scatter-add, every run.
// Short runs (most of them: text spreads its ids) are summed straight from global memory; long
// ones (the recall tasks repeat one id on 1/3 to 5/8 of their rows) go to a second kernel that
// stages their rows in shared memory, because there the chain of in-order adds is as long as
// the run and one global round trip per few rows would set the time.
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_select.cuh>
#include <string>

#include "ops/nn/cuda/nn_common.cuh"
#include "ops/nn/cuda/train_cuda.h"

namespace kda::ops::cuda {
namespace {

using namespace nn_detail;

constexpr int kThreads = 256;
constexpr int64_t kLongRun = 256;  // a run of more rows goes to the staged kernel

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

// flags[p] = 1 where sorted position p starts a run of one id; positions[p] = p (select's input).
// Also empties the list of long runs that the short-run kernel fills.
__global__ void embedding_run_flags_kernel(const uint32_t* keys, int64_t rows, int32_t* flags,
                                           int32_t* positions, int32_t* long_count) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (first == 0) *long_count = 0;
  for (int64_t p = first; p < rows; p += step) {
    flags[p] = p == 0 || keys[p] != keys[p - 1];
    positions[p] = int32_t(p);
  }
}

// Block (b, column block) takes runs b, b + gridDim.x, ...: a short run is summed here, a thread
// a column, loading kAhead rows before adding them in order; a long one is appended to
// long_runs (in any order: each run's sum is its own) for the staged kernel.
constexpr int kAhead = 16;

__global__ void embedding_short_runs_kernel(const uint32_t* keys, const int32_t* order,
                                            const int32_t* run_starts, const int32_t* run_count,
                                            int64_t rows, int64_t D, int64_t vocab, const float* dy,
                                            float* dtable, int32_t* long_runs,
                                            int32_t* long_count) {
  const int64_t runs = *run_count;
  const int64_t col = int64_t(blockIdx.y) * blockDim.x + threadIdx.x;
  for (int64_t j = blockIdx.x; j < runs; j += gridDim.x) {
    const int64_t first = run_starts[j];
    const int64_t end = j + 1 < runs ? run_starts[j + 1] : rows;
    const uint32_t key = keys[first];
    if (key >= uint32_t(vocab)) continue;  // the ids outside the table, sorted last
    if (end - first > kLongRun) {
      if (blockIdx.y == 0 && threadIdx.x == 0) long_runs[atomicAdd(long_count, 1)] = int32_t(j);
      continue;
    }
    if (col >= D) continue;
    float* out = dtable + int64_t(key) * D + col;
    float s = *out;
    int64_t q = first;
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
}

// The staged kernel: one warp of summers (a thread a column) adds a tile of rows from shared
// memory in order while four warps of loaders stage the next tile (double-buffered, 32 loads
// a thread in flight, the next tile's row numbers read a tile ahead).
constexpr int kCols = 32;       // columns a block owns: one summer warp
constexpr int kTileRows = 128;  // rows a tile stages
constexpr int kLoaders = 128;
constexpr int kRunThreads = kCols + kLoaders;
constexpr int kPerLoader = kTileRows * kCols / kLoaders;
constexpr int kRowStep = kLoaders / kCols;
static_assert(kLoaders % kCols == 0 && kTileRows % kRowStep == 0);

// This loader's row numbers in the tile of `count` rows at sorted position `first` (-1: none).
__device__ void tile_sources(const int32_t* order, int64_t first, int64_t count, int loader,
                             int32_t (&source)[kPerLoader]) {
  const int r0 = loader / kCols;
#pragma unroll
  for (int k = 0; k < kPerLoader; ++k) {
    const int r = r0 + k * kRowStep;
    source[k] = r < count ? order[first + r] : -1;
  }
}

// Loader l stages column l % kCols of rows l / kCols, + kRowStep, ... of a tile.
__device__ void stage_tile(const int32_t (&source)[kPerLoader], int64_t col, int64_t D,
                           const float* dy, float (*tile)[kCols], int loader) {
  const int c = loader % kCols, r0 = loader / kCols;
  float value[kPerLoader];
#pragma unroll
  for (int k = 0; k < kPerLoader; ++k)
    value[k] = source[k] >= 0 && col < D ? dy[int64_t(source[k]) * D + col] : 0.0f;
#pragma unroll
  for (int k = 0; k < kPerLoader; ++k) tile[r0 + k * kRowStep][c] = value[k];
}

__global__ void __launch_bounds__(kRunThreads)
    embedding_long_runs_kernel(const uint32_t* keys, const int32_t* order,
                               const int32_t* run_starts, const int32_t* run_count,
                               const int32_t* long_runs, const int32_t* long_count, int64_t rows,
                               int64_t D, const float* dy, float* dtable) {
  __shared__ float tiles[2][kTileRows][kCols];
  const int t = threadIdx.x;
  const bool summer = t < kCols;
  const int loader = t - kCols;
  const int64_t col = int64_t(blockIdx.y) * kCols + (summer ? t : loader % kCols);
  const int64_t runs = *run_count, count = *long_count;
  for (int64_t i = blockIdx.x; i < count; i += gridDim.x) {
    const int64_t j = long_runs[i];
    const int64_t first = run_starts[j];
    const int64_t n = (j + 1 < runs ? run_starts[j + 1] : rows) - first;
    const int64_t tile_count = (n + kTileRows - 1) / kTileRows;
    const auto rows_of = [&](int64_t tile) {
      const int64_t left = n - tile * kTileRows;
      return left < kTileRows ? left : int64_t(kTileRows);
    };
    float* out = dtable + int64_t(keys[first]) * D + col;
    float s = summer && col < D ? *out : 0.0f;
    int32_t source[kPerLoader];
    if (!summer) {
      tile_sources(order, first, rows_of(0), loader, source);
      stage_tile(source, col, D, dy, tiles[0], loader);
      if (tile_count > 1) tile_sources(order, first + kTileRows, rows_of(1), loader, source);
    }
    __syncthreads();
    for (int64_t tile = 0; tile < tile_count; ++tile) {
      if (summer) {
        const int64_t tile_rows = rows_of(tile);
        for (int r = 0; r < tile_rows; ++r) s += tiles[tile & 1][r][t];
      } else if (tile + 1 < tile_count) {
        stage_tile(source, col, D, dy, tiles[(tile + 1) & 1], loader);
        if (tile + 2 < tile_count)
          tile_sources(order, first + (tile + 2) * kTileRows, rows_of(tile + 2), loader, source);
      }
      __syncthreads();  // tile read, the next one staged
    }
    if (summer && col < D) *out = s;
  }
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
  require(ceil_div(D, kCols) < 65536, std::string(what) + ": rows too wide");
  if (rows == 0) return;
  require(ids && dy && dtable, std::string(what) + ": null pointer");
  const int n = int(rows);
  const int bits = key_bits(vocab);
  size_t sort_bytes = 0, select_bytes = 0;
  check_cuda(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, static_cast<uint32_t*>(nullptr),
                                             static_cast<uint32_t*>(nullptr),
                                             static_cast<int32_t*>(nullptr),
                                             static_cast<int32_t*>(nullptr), n, 0, bits, stream),
             what);
  check_cuda(
      cub::DeviceSelect::Flagged(nullptr, select_bytes, static_cast<int32_t*>(nullptr),
                                 static_cast<int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
                                 static_cast<int32_t*>(nullptr), rows, stream),
      what);
  // Scratch: keys in / out, order in / out, run starts, long runs (rows each), the run and
  // long-run counts, then CUB's temporary storage (the sort's, then the select's). The run flags
  // and select's positions reuse keys in and order in, dead after the sort.
  const size_t arrays = (size_t(rows) * 6 + 2) * sizeof(uint32_t);
  const size_t temp_offset = (arrays + 255) / 256 * 256;
  scratch.sort.reserve(temp_offset + std::max(sort_bytes, select_bytes));
  char* base = static_cast<char*>(scratch.sort.data());
  uint32_t* keys_in = reinterpret_cast<uint32_t*>(base);
  uint32_t* keys_out = keys_in + rows;
  int32_t* order_in = reinterpret_cast<int32_t*>(keys_out + rows);
  int32_t* order_out = order_in + rows;
  int32_t* flags = reinterpret_cast<int32_t*>(keys_in);
  int32_t* positions = order_in;
  int32_t* run_starts = order_out + rows;
  int32_t* long_runs = run_starts + rows;
  int32_t* run_count = long_runs + rows;
  int32_t* long_count = run_count + 1;
  void* temp = base + temp_offset;
  embedding_keys_kernel<<<grid_for(rows, kThreads), kThreads, 0, stream>>>(ids, rows, vocab,
                                                                           keys_in, order_in);
  check_launch(what);
  check_cuda(cub::DeviceRadixSort::SortPairs(temp, sort_bytes, keys_in, keys_out, order_in,
                                             order_out, n, 0, bits, stream),
             what);
  embedding_run_flags_kernel<<<grid_for(rows, kThreads), kThreads, 0, stream>>>(
      keys_out, rows, flags, positions, long_count);
  check_launch(what);
  check_cuda(cub::DeviceSelect::Flagged(temp, select_bytes, positions, flags, run_starts, run_count,
                                        rows, stream),
             what);
  // Blocks enough to fill the card with short runs, and one for each long run there can be (up
  // to 1024): the counts are on the device, extra blocks find no run and return.
  const int64_t short_blocks = rows < 4096 ? rows : 4096;
  const dim3 short_grid(unsigned(short_blocks), unsigned(ceil_div(D, kThreads)));
  embedding_short_runs_kernel<<<short_grid, kThreads, 0, stream>>>(keys_out, order_out, run_starts,
                                                                   run_count, rows, D, vocab, dy,
                                                                   dtable, long_runs, long_count);
  check_launch(what);
  const int64_t most_long_runs = rows / (kLongRun + 1);
  if (most_long_runs > 0) {
    const int64_t long_blocks = most_long_runs < 1024 ? most_long_runs : 1024;
    const dim3 long_grid(unsigned(long_blocks), unsigned(ceil_div(D, kCols)));
    embedding_long_runs_kernel<<<long_grid, kRunThreads, 0, stream>>>(
        keys_out, order_out, run_starts, run_count, long_runs, long_count, rows, D, dy, dtable);
    check_launch(what);
  }
}

}  // namespace kda::ops::cuda
