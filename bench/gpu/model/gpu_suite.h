// Scaffolding of kda_gpu_model (bench/gpu/model): each *_check.cpp registers a suite (checks
// against the CPU, then optional timings); main.cpp runs the suites named on the command line.
// Every check prints one line "CHECK <name> <PASS|FAIL> rel=<x> tol=<y>"; timings print
// "BENCH <name> <fields>" lines that scripts/gpu_run.sh collects into the table.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/random.h"
#include "core/tensor.h"
#include "ops/common/device_buffer.h"
#include "ops/common/device_types.h"

namespace kda::gpu_check {

using ops::cuda::DeviceBuffer;
using ops::cuda::ElementType;

struct SuiteOptions {
  bool check = true;
  bool bench = false;
  // a few checks of each kind, for compute-sanitizer (suites without a small set run in full)
  bool small = false;
  std::string shared_dir;  // the fixtures' root (models/, ops/)
};

struct Tally {
  int passed = 0, failed = 0;
};

using SuiteFn = std::function<void(const SuiteOptions&, Tally&)>;
// Called from a static initialiser in each *_check.cpp: `static const bool r = register_suite(..)`.
bool register_suite(const std::string& name, SuiteFn fn);

// ||x - ref|| / ||ref||; any non-finite x gives +inf (NaN never passes).
inline double rel_error(const std::vector<double>& x, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x[i])) return INFINITY;
    num += (x[i] - ref[i]) * (x[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

inline void report(Tally& tally, const std::string& name, double rel, double tol) {
  const bool ok = rel <= tol;
  std::printf("CHECK %-60s %s rel=%.3e tol=%.1e\n", name.c_str(), ok ? "PASS" : "FAIL", rel, tol);
  std::fflush(stdout);
  (ok ? tally.passed : tally.failed)++;
}

// Values uniform in [-scale, scale) from a seeded generator.
inline std::vector<float> random_values(size_t n, uint64_t seed, float scale = 1.f) {
  Random rng(seed);
  std::vector<float> v(n);
  rng.fill_uniform(v, -scale, scale);
  return v;
}

// A host array on the device as fp32 or bf16; `rounded` holds what the device sees (for the
// reference computed on the host).
struct DeviceArray {
  DeviceBuffer buffer;
  ElementType type = ElementType::f32;
  std::vector<double> rounded;
  void* data() const { return buffer.data(); }
};

inline DeviceArray to_device(const std::vector<float>& v, ElementType type) {
  DeviceArray a;
  a.type = type;
  a.rounded.resize(v.size());
  if (type == ElementType::bf16) {
    std::vector<uint16_t> bits(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      bits[i] = f32_to_bf16(v[i]);
      a.rounded[i] = bf16_to_f32(bits[i]);
    }
    a.buffer.resize(bits.size() * 2);
    a.buffer.upload(bits.data(), bits.size() * 2);
  } else {
    for (size_t i = 0; i < v.size(); ++i) a.rounded[i] = v[i];
    a.buffer.resize(v.size() * 4);
    a.buffer.upload(v.data(), v.size() * 4);
  }
  return a;
}

// n elements of `type` at a device address, widened to double.
inline std::vector<double> from_device(const void* p, size_t n, ElementType type) {
  std::vector<double> out(n);
  if (type == ElementType::bf16) {
    std::vector<uint16_t> bits(n);
    ops::cuda::check_cuda(cudaMemcpy(bits.data(), p, n * 2, cudaMemcpyDeviceToHost), "download");
    for (size_t i = 0; i < n; ++i) out[i] = bf16_to_f32(bits[i]);
  } else {
    std::vector<float> f(n);
    ops::cuda::check_cuda(cudaMemcpy(f.data(), p, n * 4, cudaMemcpyDeviceToHost), "download");
    for (size_t i = 0; i < n; ++i) out[i] = f[i];
  }
  return out;
}

// NaN bytes everywhere (0xFF..): unwritten outputs show up as NaN.
inline void poison(void* p, size_t bytes) {
  ops::cuda::check_cuda(cudaMemset(p, 0xFF, bytes), "poison");
}

// fp32 values widened for rel_error.
inline std::vector<double> widen(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

inline std::vector<double> widen(const Tensor& t) {
  return std::vector<double>(t.f32(), t.f32() + t.numel());
}

// Host arrays to new device buffers, and fp32 device values back.
inline DeviceBuffer upload(const std::vector<float>& v) {
  DeviceBuffer b(v.size() * sizeof(float));
  b.upload(v.data(), b.bytes());
  return b;
}

inline DeviceBuffer upload_ints(const std::vector<int32_t>& v) {
  DeviceBuffer b(v.size() * sizeof(int32_t));
  b.upload(v.data(), b.bytes());
  return b;
}

inline std::vector<float> download(const void* p, size_t n) {
  std::vector<float> out(n);
  ops::cuda::check_cuda(cudaMemcpy(out.data(), p, n * sizeof(float), cudaMemcpyDeviceToHost),
                        "download");
  return out;
}

inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

inline void report_same(Tally& tally, const std::string& name, bool same) {
  report(tally, name, same ? 0.0 : 1.0, 0.0);
}

// A check that fn throws kda::Error (bad arguments are refused before anything is queued).
template <class Fn>
void report_throws(Tally& tally, const std::string& name, Fn&& fn) {
  bool threw = false;
  try {
    fn();
  } catch (const kda::Error&) {
    threw = true;
  }
  report(tally, name + " throws kda::Error", threw ? 0.0 : 1.0, 0.0);
}

// Median milliseconds of `reps` runs of fn on `stream` after `warmup` runs (CUDA events).
inline double time_ms(cudaStream_t stream, const std::function<void()>& fn, int warmup = 3,
                      int reps = 10) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> ms;
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(start, stream);
    fn();
    cudaEventRecord(stop, stream);
    cudaEventSynchronize(stop);
    float t = 0;
    cudaEventElapsedTime(&t, start, stop);
    ms.push_back(t);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace kda::gpu_check
