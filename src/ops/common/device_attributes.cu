#include "ops/common/device_attributes.h"

#include <cuda_runtime.h>

#include <atomic>

#include "ops/delta_rule/cuda/device_common.cuh"

namespace kda::ops::cuda_detail {
namespace {

constexpr int kMaxDevices = 64;

// The attribute of the current device, at least 1; cached[device] holds 0 until first asked.
int cached_attribute(std::atomic<int> (&cached)[kMaxDevices], cudaDeviceAttr attribute,
                     const char* what) {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  if (device < 0 || device >= kMaxDevices) device = 0;
  int value = cached[device].load(std::memory_order_relaxed);
  if (value == 0) {
    check_cuda(cudaDeviceGetAttribute(&value, attribute, device), what);
    value = value > 0 ? value : 1;
    cached[device].store(value, std::memory_order_relaxed);
  }
  return value;
}

}  // namespace

int device_sm_count() {
  static std::atomic<int> cached[kMaxDevices] = {};
  return cached_attribute(cached, cudaDevAttrMultiProcessorCount,
                          "cudaDeviceGetAttribute (multiprocessors)");
}

int device_cc_major() {
  static std::atomic<int> cached[kMaxDevices] = {};
  return cached_attribute(cached, cudaDevAttrComputeCapabilityMajor,
                          "cudaDeviceGetAttribute (compute capability)");
}

int device_max_smem_optin() {
  static std::atomic<int> cached[kMaxDevices] = {};
  return cached_attribute(cached, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                          "cudaDeviceGetAttribute (shared memory)");
}

}  // namespace kda::ops::cuda_detail
