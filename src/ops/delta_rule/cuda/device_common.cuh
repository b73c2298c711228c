// Small device helpers shared by the delta-rule, attention, MoE and model kernels: bf16/fp32 loads,
// tensor-core fragments (mma.sync m16n8k16 bf16 -> fp32, ldmatrix), cp.async, and the launch error
// check.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/error.h"

namespace kda::ops::cuda_detail {

inline void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw kda::Error(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(status));
}
inline void check_launch(const char* what) {
  check_cuda(cudaGetLastError(), what);
}
// True when p may be read 16 bytes at a time (uint4 / cp.async / bulk copies).
inline bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// ---- element loads/stores (bf16 or fp32 storage, fp32 arithmetic) ----
__device__ __forceinline__ float to_f32(float x) {
  return x;
}
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <class T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Loads 8 consecutive elements (16 bytes of bf16, 32 of fp32) as floats; p must be aligned.
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float out[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void load8(const float* p, float out[8]) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
  out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}
// 1 / max(|row|, 1e-6) of a K-wide bf16 row, two adjacent lanes a row: each passes its half
// (row + half * K / 2) and both get the result (the KDA layer's q / k L2 norm).
template <int K>
__device__ __forceinline__ float pair_row_inv_norm(const __nv_bfloat16* half_row) {
  float s2 = 0.f;
#pragma unroll
  for (int c = 0; c < K / 2; c += 8) {
    float v8[8];
    load8(half_row + c, v8);
#pragma unroll
    for (int e = 0; e < 8; ++e) s2 += v8[e] * v8[e];
  }
  s2 += __shfl_xor_sync(0xffffffffu, s2, 1);
  return 1.f / fmaxf(sqrtf(s2), 1e-6f);
}
__device__ __forceinline__ void load4(const __nv_bfloat16* p, float out[4]) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
  const float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
  out[0] = a.x, out[1] = a.y, out[2] = b.x, out[3] = b.y;
}
__device__ __forceinline__ void load4(const float* p, float out[4]) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
}
__device__ __forceinline__ void store4(__nv_bfloat16* p, const float in[4]) {
  uint2 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
  h[0] = __floats2bfloat162_rn(in[0], in[1]);
  h[1] = __floats2bfloat162_rn(in[2], in[3]);
  *reinterpret_cast<uint2*>(p) = raw;
}
__device__ __forceinline__ void store4(float* p, const float in[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(in[0], in[1], in[2], in[3]);
}
__device__ __forceinline__ void store8_bf16(__nv_bfloat16* p, const float in[8]) {
  uint4 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ float2 unpack_bf16(uint32_t x) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x));
}
// Scales both halves of a packed bf16 pair.
__device__ __forceinline__ uint32_t scale_bf16x2(uint32_t x, float a, float b) {
  const float2 f = unpack_bf16(x);
  return pack_bf16(f.x * a, f.y * b);
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---- tensor cores: D += A(16x16, row) * B(16x8, col), bf16 inputs, fp32 accumulators ----
// Fragment layout (g = lane / 4, t = lane % 4): A regs {(g, 2t), (g+8, 2t), (g, 2t+8),
// (g+8, 2t+8)}; B regs {(k=2t, n=g), (k=2t+8, n=g)}; C {(g, 2t), (g, 2t+1), (g+8, 2t), (g+8,
// 2t+1)}.
__device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- tensor cores on fp32 operands: D += A(16x8, row) * B(8x8, col), tf32 inputs ----
// Fragments (g = lane / 4, t = lane % 4): A {(g, t), (g+8, t), (g, t+4), (g+8, t+4)}; B {(k=t,
// n=g), (k=t+4, n=g)}; C as for mma_bf16.
__device__ __forceinline__ void mma_tf32(float c[4], const uint32_t a[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// x = big + small, both tf32 (big the rounded value, small the rounded rest). Rounded by
// integer arithmetic (add half an ulp of tf32's 10-bit mantissa, clear the 13 bits below it):
// sm_90 has no f32 -> tf32 instruction, and cvt.rna.tf32.f32 became four instructions each
// (with an infinity test our finite operands never need; an inf or NaN still comes out NaN or
// inf).
__device__ __forceinline__ uint32_t round_tf32(float x) {
  return (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
}
__device__ __forceinline__ void split_tf32(float x, uint32_t& big, uint32_t& small) {
  big = round_tf32(x);
  small = round_tf32(x - __uint_as_float(big));
}
// c += A B with about fp32 precision (3xTF32: big*big + big*small + small*big; the dropped
// small*small term is ~2^-22 relative) from fp32 fragments laid out as for mma_tf32
__device__ __forceinline__ void mma_fp32_3xtf32(float c[4], const float a[4], const float b[2]) {
  uint32_t ab[4], as[4], bb[2], bs[2];
#pragma unroll
  for (int i = 0; i < 4; ++i) split_tf32(a[i], ab[i], as[i]);
#pragma unroll
  for (int i = 0; i < 2; ++i) split_tf32(b[i], bb[i], bs[i]);
  mma_tf32(c, as, bb[0], bb[1]);
  mma_tf32(c, ab, bs[0], bs[1]);
  mma_tf32(c, ab, bb[0], bb[1]);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// A fragment (16x16) at (row0, col0) of a row-major bf16 smem tile with row stride `ld`.
__device__ __forceinline__ void load_a(uint32_t a[4], const __nv_bfloat16* base, int ld, int row0,
                                       int col0, int lane) {
  const int r = row0 + (lane & 7) + ((lane >> 3) & 1) * 8, c = col0 + (lane >> 4) * 8;
  ldmatrix_x4(a, base + r * ld + c);
}
// A fragment (16x16) of A = S^T where S is stored row-major [k][m]: A(m, k) = S[k][m].
__device__ __forceinline__ void load_a_trans(uint32_t a[4], const __nv_bfloat16* base, int ld,
                                             int m0, int k0, int lane) {
  const int r = k0 + (lane & 7) + (lane >> 4) * 8, c = m0 + ((lane >> 3) & 1) * 8;
  ldmatrix_x4_trans(a, base + r * ld + c);
}
// Two B fragments (k 16 x n 16 = two n-tiles of 8) where B(k, n) = S[n][k] (S row-major [n][k]).
// b[0], b[1] serve n-tile n0; b[2], b[3] serve n-tile n0 + 8.
__device__ __forceinline__ void load_b_nk(uint32_t b[4], const __nv_bfloat16* base, int ld, int k0,
                                          int n0, int lane) {
  const int r = n0 + (lane & 7) + (lane >> 4) * 8, c = k0 + ((lane >> 3) & 1) * 8;
  ldmatrix_x4(b, base + r * ld + c);
}
// Two B fragments where B(k, n) = S[k][n] (S row-major [k][n]).
__device__ __forceinline__ void load_b_kn(uint32_t b[4], const __nv_bfloat16* base, int ld, int k0,
                                          int n0, int lane) {
  const int r = k0 + (lane & 7) + ((lane >> 3) & 1) * 8, c = n0 + (lane >> 4) * 8;
  ldmatrix_x4_trans(b, base + r * ld + c);
}

// ---- named barriers (ids 1..15; __syncthreads is id 0) for warp-specialised blocks ----
// bar.sync waits for `threads` arrivals (acquire and release); bar.arrive only counts this
// warp's arrival (release): a producer signals, its consumers wait.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- cp.async (16-byte global -> shared copies) ----
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(smem)), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Rows [0, kRows) of a W-wide bf16 tile (shared row stride LD) from global rows `stride`
// elements apart, by cp.async with `threads` threads; rows >= len zero-filled. Each thread keeps
// one 16-byte column and steps down threads / (W / 8) rows: two pointer adds a copy, where a
// flat index loop spent ~10 instructions on its division and 64-bit products (session 22).
template <int W, int LD, int threads, int kRows>
__device__ __forceinline__ void copy_rows_async(__nv_bfloat16* dst, const __nv_bfloat16* src,
                                                int64_t stride, int len, int tid) {
  constexpr int kPerRow = W / 8, kStep = threads / kPerRow;
  static_assert(threads % kPerRow == 0 && kRows % kStep == 0, "whole row steps");
  const int c = (tid % kPerRow) * 8, i0 = tid / kPerRow;
  __nv_bfloat16* d = dst + i0 * LD + c;
  const __nv_bfloat16* g = src + i0 * stride + c;
#pragma unroll
  for (int i = i0; i < kRows; i += kStep, d += kStep * LD, g += kStep * stride) {
    if (i < len)
      cp_async16(d, g);
    else
      *reinterpret_cast<uint4*>(d) = make_uint4(0, 0, 0, 0);
  }
}

}  // namespace kda::ops::cuda_detail
