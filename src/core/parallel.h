// Parallel loops over independent work items (sequences x heads). OpenMP underneath;
// OpenBLAS (its OpenMP build) runs single-threaded inside these regions by itself.
#pragma once
#include <algorithm>
#include <cstdint>
#include <exception>
#include <mutex>

namespace kda {

int hardware_threads();

// Below this many floating-point operations in total, waking a thread team costs more than it
// saves (decode steps): loops run on the calling thread.
constexpr double kMinParallelFlops = 4e6;

// Calls body(i) for i in [0, n) across threads (serially when n * flops_per_item is below
// kMinParallelFlops). The first exception is rethrown after the loop.
template <class Body>
void parallel_for(int64_t n, Body&& body, double flops_per_item = 1e300) {
  std::exception_ptr error;
  std::mutex error_mutex;
  const bool threaded = n > 1 && double(n) * flops_per_item >= kMinParallelFlops;
#pragma omp parallel for schedule(dynamic, 1) if (threaded)
  for (int64_t i = 0; i < n; ++i) {
    try {
      body(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

// Calls body(first, end) over blocks of 16 rows of [0, rows) in parallel: row-wise work
// (norms, activations) in pieces big enough to be worth a thread, small jobs on the caller.
template <class Body>
void parallel_for_row_blocks(int64_t rows, double flops_per_row, Body&& body) {
  constexpr int64_t kRowsPerBlock = 16;
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  parallel_for(
      blocks,
      [&](int64_t b) {
        const int64_t first = b * kRowsPerBlock;
        body(first, std::min(rows, first + kRowsPerBlock));
      },
      flops_per_row * double(kRowsPerBlock));
}

}  // namespace kda
