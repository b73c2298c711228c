#include "ops/nn/nn.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "core/blas.h"
#include "core/parallel.h"

namespace kda::ops {
namespace {

// Y = X W^T (+ Y) for a few rows of X (one for a decode step, one token of each of T sequences
// for a batched one), Y with row stride ldy: each block of four weight rows read from memory
// once and applied, while it sits in L1, to every row of X (which stays in L2), four rows of X
// at a time (16 sums, 8 loads per 16 multiply-adds), a single row four weight rows at a time
// (each load of x feeds four independent sums). GEMM would first pack all of W: at T = 4 on a
// 550 MB model that packing cost more than the products.
void matmat_rows(const float* X, int64_t T, int64_t in, const float* W, int64_t out,
                 bool accumulate, float* Y, int64_t ldy) {
  int64_t o = 0;
  for (; o + 4 <= out; o += 4) {
    const float *r0 = W + o * in, *r1 = r0 + in, *r2 = r1 + in, *r3 = r2 + in;
    int64_t t = 0;
    // four rows of X against the four weight rows: 16 sums, 8 loads per 16 multiply-adds
    for (; t + 4 <= T; t += 4) {
      const float *x0 = X + t * in, *x1 = x0 + in, *x2 = x1 + in, *x3 = x2 + in;
      float d[4][4] = {};
      float d00 = 0, d01 = 0, d02 = 0, d03 = 0, d10 = 0, d11 = 0, d12 = 0, d13 = 0;
      float d20 = 0, d21 = 0, d22 = 0, d23 = 0, d30 = 0, d31 = 0, d32 = 0, d33 = 0;
#pragma omp simd reduction(+ : d00, d01, d02, d03, d10, d11, d12, d13, d20, d21, d22, d23, d30, \
                               d31, d32, d33)
      for (int64_t i = 0; i < in; ++i) {
        const float a0 = r0[i], a1 = r1[i], a2 = r2[i], a3 = r3[i];
        const float b0 = x0[i], b1 = x1[i], b2 = x2[i], b3 = x3[i];
        d00 += a0 * b0, d01 += a1 * b0, d02 += a2 * b0, d03 += a3 * b0;
        d10 += a0 * b1, d11 += a1 * b1, d12 += a2 * b1, d13 += a3 * b1;
        d20 += a0 * b2, d21 += a1 * b2, d22 += a2 * b2, d23 += a3 * b2;
        d30 += a0 * b3, d31 += a1 * b3, d32 += a2 * b3, d33 += a3 * b3;
      }
      d[0][0] = d00, d[0][1] = d01, d[0][2] = d02, d[0][3] = d03;
      d[1][0] = d10, d[1][1] = d11, d[1][2] = d12, d[1][3] = d13;
      d[2][0] = d20, d[2][1] = d21, d[2][2] = d22, d[2][3] = d23;
      d[3][0] = d30, d[3][1] = d31, d[3][2] = d32, d[3][3] = d33;
      for (int u = 0; u < 4; ++u) {
        float* y = Y + (t + u) * ldy + o;
        for (int j = 0; j < 4; ++j) y[j] = (accumulate ? y[j] : 0.0f) + d[u][j];
      }
    }
    for (; t < T; ++t) {
      const float* x = X + t * in;
      float d0 = 0, d1 = 0, d2 = 0, d3 = 0;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
      for (int64_t i = 0; i < in; ++i) {
        const float xi = x[i];
        d0 += r0[i] * xi;
        d1 += r1[i] * xi;
        d2 += r2[i] * xi;
        d3 += r3[i] * xi;
      }
      float* y = Y + t * ldy + o;
      y[0] = (accumulate ? y[0] : 0.0f) + d0;
      y[1] = (accumulate ? y[1] : 0.0f) + d1;
      y[2] = (accumulate ? y[2] : 0.0f) + d2;
      y[3] = (accumulate ? y[3] : 0.0f) + d3;
    }
  }
  for (; o < out; ++o) {
    const float* row = W + o * in;
    for (int64_t t = 0; t < T; ++t) {
      const float* x = X + t * in;
      float dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < in; ++i) dot += row[i] * x[i];
      float* y = Y + t * ldy + o;
      *y = (accumulate ? *y : 0.0f) + dot;
    }
  }
}

// Helper threads for decode matrix-vector products. An OpenMP region (or BLAS's threaded GEMV)
// waits at its end for every thread of the team to have been scheduled: on the shared 2-core
// machine, with other jobs running, that made decode 7-20x slower than one thread, while on a
// quiet machine two threads stream memory ~1.7x faster than one. Here the calling thread claims
// row blocks itself and waits only for blocks a helper has already claimed; a helper that is
// not running when the job comes simply misses it. One job at a time; callers that find the
// pool busy (or run inside a parallel region) compute alone.
class MatvecPool {
 public:
  static MatvecPool& instance() {
    static MatvecPool pool(hardware_threads() - 1);
    return pool;
  }

  // Runs fn(b) for every b in [0, blocks); false (nothing run) when the pool is busy or has no
  // helpers.
  template <class Fn>
  bool run(int64_t blocks, const Fn& fn) {
    if (threads_.empty() || !busy_.try_lock()) return false;
    call_ = [](const void* f, int64_t b) { (*static_cast<const Fn*>(f))(b); };
    fn_ = &fn;
    blocks_ = blocks;
    next_.store(0);
    done_.store(0);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      generation_.fetch_add(1);  // odd: a job is open
    }
    wake_.notify_all();
    work();
    while (done_.load() < blocks_) _mm_pause();  // only blocks a helper claimed remain
    generation_.fetch_add(1);                    // even: closed; late helpers back off
    while (inside_.load() > 0) _mm_pause();      // helpers that got in leave without work
    busy_.unlock();
    return true;
  }

  ~MatvecPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_.store(true);
    }
    wake_.notify_all();
    for (std::thread& t : threads_) t.join();
  }

 private:
  explicit MatvecPool(int helpers) {
    for (int i = 0; i < helpers; ++i) threads_.emplace_back([this] { helper(); });
  }

  void work() {
    for (int64_t b; (b = next_.fetch_add(1)) < blocks_;) {
      call_(fn_, b);
      done_.fetch_add(1);
    }
  }

  void helper() {
    uint64_t seen = 0;
    for (;;) {
      // Spin briefly (decode issues the next product within microseconds), then sleep.
      auto open = [&] {
        const uint64_t g = generation_.load();
        return (g & 1) && g != seen;
      };
      for (int spin = 0; spin < 20000 && !open() && !stop_.load(); ++spin) _mm_pause();
      if (!open()) {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stop_.load() || open(); });
      }
      if (stop_.load()) return;
      seen = generation_.load();
      if (!(seen & 1)) continue;  // closed meanwhile
      inside_.fetch_add(1);
      if (generation_.load() == seen) work();  // else the job closed before we got in
      inside_.fetch_sub(1);
    }
  }

  std::vector<std::thread> threads_;
  std::mutex busy_, mutex_;
  std::condition_variable wake_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> next_{0}, done_{0};
  std::atomic<int> inside_{0};
  void (*call_)(const void*, int64_t) = nullptr;
  const void* fn_ = nullptr;
  int64_t blocks_ = 0;
};

// Decode (one token, or one of each of T sequences): Y = X W^T (+ Y), bound by streaming W
// from memory. Matrices of at least 256 KiB are split into row blocks of about 64 KiB shared
// with the helper threads.
void matmat(const float* X, int64_t T, int64_t in, const float* W, int64_t out, bool accumulate,
            float* Y) {
  constexpr int64_t kSharedElements = int64_t(1) << 16, kBlockElements = int64_t(1) << 14;
  const int64_t rows = std::max<int64_t>(4, (kBlockElements / std::max<int64_t>(in, 1)) / 4 * 4);
  const int64_t blocks = (out + rows - 1) / rows;
  if (out * in >= kSharedElements && blocks >= 2 && !omp_in_parallel()) {
    const auto block = [&](int64_t b) {
      const int64_t o0 = b * rows;
      matmat_rows(X, T, in, W + o0 * in, std::min(out, o0 + rows) - o0, accumulate, Y + o0, out);
    };
    if (MatvecPool::instance().run(blocks, block)) return;
  }
  matmat_rows(X, T, in, W, out, accumulate, Y, out);
}

// Up to this many rows go through matmat (decode, batched decode), more through GEMM.
constexpr int64_t kMatmatMaxRows = 16;

}  // namespace

void linear(const float* x, int64_t T, int64_t in, const float* W, int64_t out, const float* bias,
            float* y) {
  if (bias) {
    for (int64_t t = 0; t < T; ++t)
      for (int64_t o = 0; o < out; ++o) y[t * out + o] = bias[o];
  }
  if (T <= kMatmatMaxRows) return matmat(x, T, in, W, out, bias != nullptr, y);
  gemm_nt(int(T), int(out), int(in), 1.0f, x, int(in), W, int(in), bias ? 1.0f : 0.0f, y, int(out));
}

void linear_accumulate(const float* x, int64_t T, int64_t in, const float* W, int64_t out,
                       float* y) {
  if (T <= kMatmatMaxRows) return matmat(x, T, in, W, out, true, y);
  gemm_nt(int(T), int(out), int(in), 1.0f, x, int(in), W, int(in), 1.0f, y, int(out));
}

void layer_norm(const float* x, int64_t rows, int64_t D, const float* weight, const float* bias,
                float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    double mean = 0, var = 0;
    for (int64_t i = 0; i < D; ++i) mean += xr[i];
    mean /= double(D);
    for (int64_t i = 0; i < D; ++i) var += (xr[i] - mean) * (xr[i] - mean);
    var /= double(D);
    const float inv = float(1.0 / std::sqrt(var + eps));
    for (int64_t i = 0; i < D; ++i) {
      const float n = float(xr[i] - mean) * inv;
      y[r * D + i] = n * (weight ? weight[i] : 1.0f) + (bias ? bias[i] : 0.0f);
    }
  }
}

void rms_norm(const float* x, int64_t rows, int64_t D, const float* weight, float eps, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    double ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += double(xr[i]) * xr[i];
    const float inv = float(1.0 / std::sqrt(ss / double(D) + eps));
    for (int64_t i = 0; i < D; ++i) y[r * D + i] = xr[i] * inv * (weight ? weight[i] : 1.0f);
  }
}

void gelu_tanh(float* x, int64_t n) {
  const float c = 0.7978845608028654f;  // sqrt(2 / pi)
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    x[i] = 0.5f * v * (1.0f + std::tanh(c * (v + 0.044715f * v * v * v)));
  }
}

void silu(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = x[i] / (1.0f + std::exp(-x[i]));
}

}  // namespace kda::ops
