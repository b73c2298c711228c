// Parallel loops over independent work items (sequences x heads). OpenMP underneath;
// OpenBLAS (its OpenMP build) runs single-threaded inside these regions by itself.
#pragma once
#include <cstdint>
#include <exception>
#include <mutex>

namespace kda {

int hardware_threads();

// Calls body(i) for i in [0, n) across threads. The first exception is rethrown after the loop.
template <class Body>
void parallel_for(int64_t n, Body&& body) {
  std::exception_ptr error;
  std::mutex error_mutex;
#pragma omp parallel for schedule(dynamic, 1)
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

}  // namespace kda
