// wgmma (sm_90a) building blocks: shared-memory matrix descriptors for 128-byte-swizzled K-major
// tiles, and the products the attention kernels and the delta-rule state walk
// (chunk_state_wgmma.cu) need: m64n64k16 with A and B from shared memory, m64n64k16 and
// m64n128k16 with A from registers. bf16 inputs, fp32 accumulators.
//
// Layout of a K-major tile (rows x 64 bf16 = 128 bytes a row, the K dimension contiguous): the
// 16-byte chunk c of row r sits at r * 128 + ((c ^ (r % 8)) * 16), the tile 1024-byte aligned
// (the swizzle repeats every 8 rows). A K dimension wider than 64 is several such tiles side by
// side. Descriptor: start address, LBO unused (1), SBO = 1024 bytes (from one 8-row group to the
// next), swizzle mode 1 (128 B) in bits 62-63. A k16 step inside a 64-wide tile moves the start
// by 32 bytes (the hardware applies the XOR to the full address, so the offset composes).
//
// Accumulators (per warp w of the warpgroup: rows 16 w .. 16 w + 15): d[4 j + e] holds row
// g + 8 (e >= 2), column 8 j + 2 t + (e & 1) (g = lane / 4, t = lane % 4), the mma.sync C
// layout; a register A fragment is the mma.sync m16k16 A fragment of the warp's rows.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "ops/delta_rule/cuda/device_common.cuh"

namespace kda::ops::cuda_detail {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KDA_WGMMA 1
#endif

// Byte offset of element (row, col) of a K-major 128-byte-swizzled tile of 64 columns.
__host__ __device__ constexpr uint32_t sw128_offset(uint32_t row, uint32_t col) {
  return row * 128 + ((((col >> 3) ^ (row & 7)) << 4) | ((col & 7) << 1));
}

// An MN-major 128-byte-swizzled operand (B of O += P V read from V as stored, [keys][dims]:
// the N dimension contiguous): 64-element swizzle rows along N, `lbo` bytes from one 64-wide N
// block to the next, `sbo` bytes from one 8-row group along K to the next (the assignment the
// TMA probe checks; CUTLASS's canonical MN-major SW128 layout).
__device__ __forceinline__ uint64_t sw128_desc_mn(const void* tile, uint32_t lbo, uint32_t sbo) {
  const uint64_t addr = smem_addr(tile);
  return ((addr & 0x3FFFF) >> 4) | (uint64_t((lbo >> 4) & 0x3FFF) << 16) |
         (uint64_t((sbo >> 4) & 0x3FFF) << 32) | (uint64_t(1) << 62);
}

__device__ __forceinline__ uint64_t sw128_desc(const void* tile) {
  const uint64_t addr = smem_addr(tile);
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}

// Pins a wgmma operand register between the asm statements around it: the compiler may not
// move its reads above a wgmma wait, nor its writes below a wgmma fence (a register written
// inside a wgmma pipeline stage makes ptxas serialize every wgmma of the kernel).
__device__ __forceinline__ void fence_operand(float& x) {
  asm volatile("" : "+f"(x)::"memory");
}
__device__ __forceinline__ void fence_operand(uint32_t& x) {
  asm volatile("" : "+r"(x)::"memory");
}

template <int N>
__device__ __forceinline__ void fence_operands(float (&x)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) fence_operand(x[i]);
}
template <int N>
__device__ __forceinline__ void fence_operands(uint32_t (&x)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) fence_operand(x[i][e]);
}

// `rows` rows of kWidth bf16 (kWidth / 8 chunks of 16 bytes, from src at `stride` elements a
// row) by cp.async into kWidth / 64 128-byte-swizzled column tiles `col_bytes` apart; rows >=
// valid are zero-filled. Every thread of the block (tid of kThreads) takes a share.
template <int kThreads, int kWidth = 128>
__device__ __forceinline__ void load_rows_sw128(unsigned char* dst, uint32_t col_bytes,
                                                const __nv_bfloat16* src, int64_t stride, int rows,
                                                int valid, int tid) {
  static_assert(kWidth % 64 == 0, "whole 64-column tiles");
  constexpr int kPerRow = kWidth / 8;
  constexpr int kRowStep = kThreads / kPerRow;
  if constexpr (kThreads % kPerRow == 0 && kRowStep % 8 == 0) {
    // A thread keeps its 16-byte column and steps down by kRowStep rows, a multiple of the
    // swizzle's 8-row period: its swizzled offset moves by whole rows, so each copy costs two
    // adds instead of the index arithmetic below (session 22: ~30 % of the state walk's
    // instructions were these addresses)
    const int c = tid % kPerRow, r0 = tid / kPerRow;
    unsigned char* d = dst + (c >> 3) * col_bytes + sw128_offset(r0, (c & 7) * 8);
    const __nv_bfloat16* s = src + int64_t(r0) * stride + c * 8;
    const int64_t step = int64_t(kRowStep) * stride;
#pragma unroll 4
    for (int r = r0; r < rows; r += kRowStep, d += kRowStep * 128, s += step) {
      if (r < valid)
        cp_async16(d, s);
      else
        *reinterpret_cast<uint4*>(d) = make_uint4(0u, 0u, 0u, 0u);
    }
  } else {
    for (int idx = tid; idx < rows * kPerRow; idx += kThreads) {
      const int r = idx / kPerRow, c = idx % kPerRow;
      unsigned char* d = dst + (c >> 3) * col_bytes + sw128_offset(r, (c & 7) * 8);
      if (r < valid)
        cp_async16(d, src + int64_t(r) * stride + c * 8);
      else
        *reinterpret_cast<uint4*>(d) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

#ifdef KDA_WGMMA
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Four 8 x 8 bf16 matrices stored transposed: register j holds matrix j in the mma fragment
// layout (row lane / 4, columns 2 (lane % 4) and + 1); lane 8 j + i gives the address of stored
// row i of matrix j (16 bytes: column i of the fragment's matrix).
__device__ __forceinline__ void stmatrix_x4_trans(void* row, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                   smem_addr(row)),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}
// Generic-proxy writes to shared memory (st.shared, cp.async) made visible to wgmma's reads.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// d (64 x 64, fp32) = A (64 x 16, descriptor) B (16 x 64, descriptor, K-major), plus d when
// accumulate != 0
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t a, uint64_t b,
                                                   int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
      "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a), "l"(b), "r"(accumulate));
}

// d (64 x 64, fp32) += A (64 x 16, registers: the m16k16 fragment of each warp's rows)
// B (16 x 64, descriptor, K-major)
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4],
                                                   uint64_t b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
      "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, 1, "
      "1, 1, 0;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// d (64 x 128, fp32) += A (64 x 16, registers: the m16k16 fragment of each warp's rows)
// B (16 x 128, descriptor: K-major, or MN-major with kTransB = 1)
template <int kTransB = 0>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const uint32_t (&a)[4],
                                                    uint64_t b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "
      "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "
      "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "
      "%56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, 1, 1, 1, %69;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]),
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]),
        "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
        "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),
        "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(kTransB));
}
#endif

}  // namespace kda::ops::cuda_detail
