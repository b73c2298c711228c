// kda_gpu_check's shared helpers (bench/gpu/check): device buffers, host tensors and their
// upload / download, random inputs and the float64 reference, the CHECK report, the kernel-lab
// knob helpers, and the device-side random inputs of the decode chain check and the benchmarks;
// then what each file of the folder gives the others (main.cpp runs them).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "ops/delta_rule/cuda/delta_rule_cuda.h"
#include "ops/delta_rule/delta_rule.h"
#include "ops/kda/kda.h"

namespace kda_gpu_check {

using namespace kda;
using namespace kda::ops;
using kda::ops::cuda::ElementType;

// Throws kda::Error(what: the CUDA error) unless e is cudaSuccess.
void ck(cudaError_t e, const char* what);

// A device buffer that frees itself.
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : bytes(n) {
    if (n) ck(cudaMalloc(&ptr, n), "cudaMalloc");
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr(o.ptr), bytes(o.bytes) { o.ptr = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr, o.ptr);
    std::swap(bytes, o.bytes);
    return *this;
  }
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
};

// Host values in float, stored on the device as bf16 or fp32; `rounded` is what the device
// sees, widened to double for the reference.
struct HostTensor {
  std::vector<float> values;
  std::vector<double> rounded;
  DeviceBuffer device;
};

HostTensor upload(std::vector<float> v, ElementType t);
std::vector<double> download(const void* dev, size_t n, ElementType t);
void poison(const DeviceBuffer& b);
double rel_rms(const std::vector<double>& x, const std::vector<double>& ref);

// Random inputs for one job: unit-norm q, k rows; log-sigmoid gates; sigmoid betas.
struct Inputs {
  DeltaRuleShape shape;
  std::vector<int64_t> cu;
  int64_t N = 0, tokens = 0;
  std::vector<float> q, k, v, g, beta, h0;
};

Inputs make_inputs(const DeltaRuleShape& s, std::vector<int64_t> cu, bool with_h0, uint64_t seed,
                   int gate_strength = 0);

struct Reference {
  std::vector<double> o, ht;
};

Reference reference(const Inputs& in, const std::vector<double>& q, const std::vector<double>& k,
                    const std::vector<double>& v, const std::vector<double>& g,
                    const std::vector<double>& beta, const std::vector<double>& h0);

// The failed CHECK lines so far (report counts them; main's exit status).
extern int g_failures;
void report(const std::string& name, const char* what, double err, double tol);

struct Uploaded {
  HostTensor q, k, v, g, beta;
  DeviceBuffer h0;
  std::vector<double> h0_rounded;
};

Uploaded upload_all(const Inputs& in, ElementType t);
cuda::DeltaRuleDeviceInputs device_inputs(const Inputs& in, const Uploaded& u, ElementType t);

struct ForwardResult {
  std::vector<double> o, ht;
};

ForwardResult run_forward(const Inputs& in, const Uploaded& u, ElementType t, bool recurrent);

bool prefetch_requested();
const char* gate_name(Gate g);

// Sets an environment variable (a kernel-lab knob) for its lifetime, then restores what the
// caller had: a knob exported for the whole run stays in force around the checks that set it.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_)
      setenv(name_, old_.c_str(), 1);
    else
      unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

std::string knob_tags();

void fill_device_random_bf16(const DeviceBuffer& b, size_t n, uint64_t seed, float lo, float hi,
                             bool normalize_rows = false, int row = 0);

// The decode rows' token inputs for n tokens (bf16, H = HV heads; q, k rows of unit norm, gates
// of gw values a head in [-0.5, -0.01], betas in [0.1, 0.9]), seeds seed .. seed + 4.
struct DecodeBenchTokens {
  DeviceBuffer q, k, v, g, beta, o;
  DecodeBenchTokens(int64_t n, int64_t H, int64_t K, int64_t V, int64_t gw, uint64_t seed)
      : q(n * H * K * 2),
        k(n * H * K * 2),
        v(n * H * V * 2),
        g(n * H * gw * 2),
        beta(n * H * 2),
        o(n * H * V * 2) {
    fill_device_random_bf16(q, n * H * K, seed, -1, 1, true, int(K));
    fill_device_random_bf16(k, n * H * K, seed + 1, -1, 1, true, int(K));
    fill_device_random_bf16(v, n * H * V, seed + 2, -1, 1);
    fill_device_random_bf16(g, n * H * gw, seed + 3, -0.5f, -0.01f);
    fill_device_random_bf16(beta, n * H, seed + 4, 0.1f, 0.9f);
  }
  void bind(cuda::DecodeArgs& a) const {
    a.q = q.ptr, a.k = k.ptr, a.v = v.ptr, a.g = g.ptr, a.beta = beta.ptr, a.o = o.ptr;
  }
};

std::vector<int32_t> rotating_slot_sets(int64_t slots_n, int64_t per_set, int sets, uint64_t seed);

// forward_checks.cpp
void check_forward(Gate gate, int64_t B, int64_t T, int64_t H, int64_t HV, int64_t K, int64_t V,
                   std::vector<int64_t> cu, bool with_h0, ElementType t, bool recurrent,
                   uint64_t seed, int strength = 0);

// backward_checks.cpp
void check_kept_forward(const std::string& name, const cuda::DeltaRuleDeviceInputs& d,
                        const void* d_o, const float* d_ht, const cuda::DeltaRuleDeviceGrads& ref,
                        int64_t tokens, int64_t N);
void check_backward(Gate gate, int64_t B, int64_t T, int64_t H, int64_t HV, int64_t K, int64_t V,
                    std::vector<int64_t> cu, bool with_h0, bool with_dht, uint64_t seed,
                    int strong = 0);

// kda_layer_checks.cpp
void check_kda_layer(int64_t B, int64_t T, int64_t H, int64_t HV, int64_t K, int64_t V,
                     std::vector<int64_t> cu, bool with_h0, bool l2norm, KdaGate gate,
                     uint64_t seed, bool wide = false);
void check_kda_layer_backward(int64_t B, int64_t T, int64_t H, int64_t HV, int64_t K, int64_t V,
                              std::vector<int64_t> cu, bool with_h0, bool with_dht, bool l2norm,
                              KdaGate gate, uint64_t seed, bool wide_decay = false);

// decode_checks.cpp
void check_decode(Gate gate, int64_t H, int64_t HV, int64_t K, int64_t V, ElementType t,
                  uint64_t seed, cuda::DecodeKernel kernel = cuda::DecodeKernel::automatic);
void check_decode_step(Gate gate, int64_t B, int64_t H, int64_t HV, int64_t K, ElementType t,
                       cuda::DecodeKernel kernel, uint64_t seed);
void run_decode_checks();

// main.cpp: --decode (set by main; read by run_checks and run_bench)
extern bool g_decode_only;

// benches.cpp
void run_profile();
void run_bench(const std::string& out_path);

}  // namespace kda_gpu_check
