// Attributes of the current CUDA device, queried once per device and cached: the kernels'
// launch planning (grid sizes against the SM count, shared-memory limits, Hopper-only paths)
// asks for them on every call.
#pragma once

namespace kda::ops::cuda_detail {

int device_sm_count();        // multiprocessors
int device_cc_major();        // compute capability, major
int device_max_smem_optin();  // shared memory a block may opt in to, bytes

}  // namespace kda::ops::cuda_detail
