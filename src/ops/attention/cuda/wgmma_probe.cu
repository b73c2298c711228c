// A probe of the wgmma building blocks (wgmma.cuh) on their own, for the check suite: one
// warpgroup computes, through the layouts and calls the wgmma attention kernels use,
//   S = A B^T      (A 64 x 128, B 64 x 128; 8 wgmma m64n64k16 from swizzled shared memory)
//   O = P V        (P 64 x 64 held in registers in the accumulator layout, V 64 x 128 stored
//                   transposed; 4 wgmma m64n128k16)
// and writes both back row-major through the accumulator layout it assumes. If the attention
// kernel disagrees with the reference, this says whether the descriptors, the accumulator layout
// or the register-A fragments are at fault.
#include <cuda_bf16.h>

#include <cstdint>

#include "ops/attention/cuda/attention_kernels.cuh"
#include "ops/attention/cuda/tma.cuh"
#include "ops/common/device_attributes.h"
#include "ops/common/wgmma.cuh"

namespace kda::ops::cuda_detail {

namespace {

using bf16 = __nv_bfloat16;

constexpr uint32_t kTile = 64 * 128;  // one column tile: 64 rows of 128 bytes (64 bf16)

#ifdef KDA_WGMMA
// S = A B^T (64 x 64) from two column tiles each of A and B, K-major with the 128-byte swizzle.
__device__ __forceinline__ void probe_s_product(const unsigned char* As, const unsigned char* Bs,
                                                float (&s)[32]) {
  wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
    const uint32_t off = (ks & 3) * 32, col = ks >> 2;
    wgmma_m64n64k16_ss(s, sw128_desc(As + col * kTile + off), sw128_desc(Bs + col * kTile + off),
                       ks > 0);
  }
  wgmma_commit();
  wgmma_wait<0>();
  fence_operands(s);
}

// The accumulators of an m64nN product (this thread's rows `row`, row + 8) into row-major out.
template <int N>
__device__ __forceinline__ void probe_store(float* out, const float (&acc)[N / 2], int row,
                                            int t4) {
#pragma unroll
  for (int n = 0; n < N / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      out[(row + 8 * (e >> 1)) * N + 8 * n + 2 * t4 + (e & 1)] = acc[4 * n + e];
}

// P (64 x 64, row-major in global memory) as the A fragments of O = P V in this thread's rows.
__device__ __forceinline__ void probe_p_fragments(const bf16* pm, int row, int t4,
                                                  uint32_t (&pa)[4][4]) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = row + 8 * (i & 1), c = 16 * kk + 8 * (i >> 1) + 2 * t4;
      pa[kk][i] = pack_bf16(__bfloat162float(pm[r * 64 + c]), __bfloat162float(pm[r * 64 + c + 1]));
    }
}
#endif

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
  probe_s_product(As, Bs, s);
  const int row = wq * 16 + g;
  probe_store<64>(s_out, s, row, t4);

  // P from global into the accumulator layout, packed as A fragments
  uint32_t pa[4][4];
  probe_p_fragments(pm, row, t4, pa);
  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_m64n128k16_rs(o, pa[kk], sw128_desc(Vt + kk * 32));
  wgmma_commit();
  wgmma_wait<0>();
  fence_operands(o);
  probe_store<128>(o_out, o, row, t4);
#else
  __trap();
#endif
}

// The TMA path alone (attention_prefill_tma.cu's building blocks): A, B and V [64][128] loaded
// by TMA (2-D maps, 64 x 64 boxes, 128-byte swizzle) into two column tiles each, completing on
// one mbarrier; S = A B^T through sw128_desc (TMA's swizzle must be sw128_offset's), and O = P V
// with V read as stored, MN-major (sw128_desc_mn, trans-b), once with (LBO, SBO) = (8 KB, 1 KB)
// into o and once with the two swapped into o_swapped.
constexpr uint32_t kTmaTile = kTile;
constexpr size_t kTmaProbeSmem = 6 * size_t(kTmaTile) + 1024 + 1024;

__global__ void __launch_bounds__(128, 1)
    tma_probe_kernel(const __grid_constant__ CUtensorMap map_a,
                     const __grid_constant__ CUtensorMap map_b,
                     const __grid_constant__ CUtensorMap map_v, const bf16* pm, float* s_out,
                     float* o_out, float* o_swapped) {
#ifdef KDA_WGMMA
  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  unsigned char* As = smem;
  unsigned char* Bs = As + 2 * kTmaTile;
  unsigned char* Vs = Bs + 2 * kTmaTile;
  uint64_t* bar = reinterpret_cast<uint64_t*>(Vs + 2 * kTmaTile);
  const int tid = threadIdx.x, lane = tid & 31, wq = tid >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  if (tid == 0) {
    mbar_init(bar, 1);
    mbar_init_fence();
  }
  __syncthreads();
  if (tid == 0) {
    mbar_expect_tx(bar, 6 * kTmaTile);
    for (int col = 0; col < 2; ++col) {
      tma_load_2d(As + col * kTmaTile, &map_a, 64 * col, 0, bar);
      tma_load_2d(Bs + col * kTmaTile, &map_b, 64 * col, 0, bar);
      tma_load_2d(Vs + col * kTmaTile, &map_v, 64 * col, 0, bar);
    }
  }
  mbar_wait(bar, 0);

  float s[32];
  probe_s_product(As, Bs, s);
  const int row = wq * 16 + g;
  probe_store<64>(s_out, s, row, t4);

  uint32_t pa[4][4];
  probe_p_fragments(pm, row, t4, pa);
  for (int variant = 0; variant < 2; ++variant) {
    const uint32_t lbo = variant == 0 ? kTmaTile : 1024, sbo = variant == 0 ? 1024 : kTmaTile;
    float o[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.f;
    fence_operands(o);
    fence_operands(pa);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)  // keys 16 kk ..: 16 rows of V further
      wgmma_m64n128k16_rs<1>(o, pa[kk], sw128_desc_mn(Vs + kk * 16 * 128, lbo, sbo));
    wgmma_commit();
    wgmma_wait<0>();
    fence_operands(o);
    probe_store<128>(variant == 0 ? o_out : o_swapped, o, row, t4);
  }
#else
  __trap();
#endif
}

}  // namespace

bool run_tma_probe(const void* a, const void* b, const void* p, const void* v, float* s, float* o,
                   float* o_swapped, cudaStream_t stream) {
  if (device_cc_major() != 9) return false;
  CUtensorMap maps[3];
  const uint64_t dims[2] = {128, 64}, strides[1] = {256};
  const uint32_t box[2] = {64, 64};
  const void* bases[3] = {a, b, v};
  for (int i = 0; i < 3; ++i)
    if (!encode_tensor_map_bf16(&maps[i], bases[i], 2, dims, strides, box)) return false;
  check_cuda(cudaFuncSetAttribute(tma_probe_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  int(kTmaProbeSmem)),
             "cudaFuncSetAttribute (tma_probe_kernel)");
  tma_probe_kernel<<<1, 128, kTmaProbeSmem, stream>>>(maps[0], maps[1], maps[2],
                                                      static_cast<const bf16*>(p), s, o, o_swapped);
  check_launch("tma_probe_kernel");
  return true;
}

bool run_wgmma_probe(const void* a, const void* b, const void* p, const void* v, float* s, float* o,
                     cudaStream_t stream) {
  if (device_cc_major() != 9) return false;
  wgmma_probe_kernel<<<1, 128, 0, stream>>>(
      static_cast<const bf16*>(a), static_cast<const bf16*>(b), static_cast<const bf16*>(p),
      static_cast<const bf16*>(v), s, o);
  check_launch("wgmma_probe_kernel");
  return true;
}

}  // namespace kda::ops::cuda_detail
