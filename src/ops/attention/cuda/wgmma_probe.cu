// A probe of the wgmma building blocks (wgmma.cuh) on their own, for the check suite: one
// warpgroup computes, through the same layouts and calls as attention_prefill_wgmma.cu,
//   S = A B^T      (A 64 x 128, B 64 x 128; 8 wgmma m64n64k16 from swizzled shared memory)
//   O = P V        (P 64 x 64 held in registers in the accumulator layout, V 64 x 128 stored
//                   transposed; 4 wgmma m64n128k16)
// and writes both back row-major through the accumulator layout it assumes. If the attention
// kernel disagrees with the reference, this says whether the descriptors, the accumulator layout
// or the register-A fragments are at fault.
#include <cuda_bf16.h>

#include <cstdint>

#include "ops/attention/cuda/attention_kernels.cuh"
#include "ops/attention/cuda/wgmma.cuh"

namespace kda::ops::cuda_detail {

namespace {

using bf16 = __nv_bfloat16;

__global__ void __launch_bounds__(128, 1)
    wgmma_probe_kernel(const bf16* a, const bf16* b, const bf16* pm, const bf16* v, float* s_out,
                       float* o_out) {
#ifdef KDA_WGMMA
  __shared__ __align__(1024) unsigned char As[2 * 64 * 128];  // 2 column tiles of 64 rows
  __shared__ __align__(1024) unsigned char Bs[2 * 64 * 128];
  __shared__ __align__(1024) unsigned char Vt[128 * 128];  // 128 dim rows x 64 keys
  const int tid = threadIdx.x, lane = tid & 31, wq = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  for (int idx = tid; idx < 64 * 16; idx += 128) {
    const int r = idx >> 4, c = idx & 15;
    const uint32_t off = (c >> 3) * (64 * 128) + sw128_offset(r, (c & 7) * 8);
    *reinterpret_cast<uint4*>(As + off) = *reinterpret_cast<const uint4*>(a + r * 128 + c * 8);
    *reinterpret_cast<uint4*>(Bs + off) = *reinterpret_cast<const uint4*>(b + r * 128 + c * 8);
  }
  for (int idx = tid; idx < 64 * 128; idx += 128) {  // V^T, element by element
    const int key = idx / 128, dim = idx % 128;
    *reinterpret_cast<bf16*>(Vt + sw128_offset(dim, key)) = v[key * 128 + dim];
  }
  fence_proxy_async();
  __syncthreads();

  float s[32];
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
    const uint32_t off = (ks & 3) * 32, col = ks >> 2;
    wgmma_m64n64k16_ss(s, sw128_desc(As + col * 64 * 128 + off),
                       sw128_desc(Bs + col * 64 * 128 + off), ks > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
  for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(s[i])::"memory");
  const int row = wq * 16 + g;
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      s_out[(row + 8 * (e >> 1)) * 64 + 8 * n + 2 * t4 + (e & 1)] = s[4 * n + e];

  // P from global into the accumulator layout, packed as A fragments
  uint32_t pa[4][4];
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = row + 8 * (i & 1), c = 16 * kk + 8 * (i >> 1) + 2 * t4;
      pa[kk][i] = pack_bf16(__bfloat162float(pm[r * 64 + c]), __bfloat162float(pm[r * 64 + c + 1]));
    }
  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_m64n128k16_rs(o, pa[kk], sw128_desc(Vt + kk * 32));
  wgmma_commit();
  wgmma_wait<0>();
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(o[i])::"memory");
#pragma unroll
  for (int n = 0; n < 16; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      o_out[(row + 8 * (e >> 1)) * 128 + 8 * n + 2 * t4 + (e & 1)] = o[4 * n + e];
#else
  __trap();
#endif
}

}  // namespace

bool run_wgmma_probe(const void* a, const void* b, const void* p, const void* v, float* s, float* o,
                     cudaStream_t stream) {
  if (attention_cc_major() != 9) return false;
  wgmma_probe_kernel<<<1, 128, 0, stream>>>(
      static_cast<const bf16*>(a), static_cast<const bf16*>(b), static_cast<const bf16*>(p),
      static_cast<const bf16*>(v), s, o);
  check_launch("wgmma_probe_kernel");
  return true;
}

}  // namespace kda::ops::cuda_detail
