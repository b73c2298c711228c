// The delta-rule recurrence token by token on the GPU: the fused decode step (one token per
// sequence, or a few for speculative decoding, states updated in place in a slot pool or, with
// token_slots, every token's state kept) and the fp32 prefill path (many tokens).
//
// One block of 128 threads owns a K x 32 column tile of one (sequence, value head) state in
// registers: thread (warp w, lane l) holds rows [R*kg, R*kg + R) with kg = 4w + l / 8 and
// R = K / 16, and columns 4 * (l % 8) .. + 3 of the tile. Columns of the state evolve
// independently, so tiles never talk to each other. Per token one reduction over K gives
// k^T P, q^T P and q.k together (P = decayed state), from which the write and the output follow:
//   d = beta (v - P^T k),   S = P + k d^T,   o = scale (P^T q + (q.k) d).
//
// The decode step (DECODE = true) caps registers at 64 so that 8 blocks share an SM (2048
// tiles of a 16-sequence, 32-head step in 1.94 waves instead of 2.2), and may be launched with
// programmatic dependent launch (DecodeArgs::overlap_launch): the block waits for the previous
// kernel on the stream (griddepcontrol.wait) before its first memory access and lets the next
// one be scheduled as soon as every block has started, which hides the launch gap between
// back-to-back steps. With DecodeArgs::prefetch_state the state loads are issued before that
// wait (only the token's vectors wait), so the state fetch overlaps the previous kernel's tail.
//
// The decode step's head kernel (decode_head_kernel, V = 128) gives one block of 256 threads a
// whole (sequence, value head) state: warp w owns rows [8w, 8w + 8) (registers) and, for
// K = 128, rows 64 + [8w, 8w + 8) (shared memory, brought in by one 32 KB bulk copy issued at
// block start); lane l owns columns 4l .. 4l + 3, so every warp-wide 16-byte access is one
// contiguous 512-byte state row. q, k, the gate and v are loaded once per head (not once per
// column tile) and staged in shared memory (k decay and q decay per row, so registers hold the
// state and little else), one cross-warp reduction serves all 128 columns, and at 64 registers
// and 44.6 KB of shared memory 4 blocks share an SM: the 512 heads of a B = 16, HV = 32 step
// are all resident at once (one wave, every state byte requested at block start) where the tile
// kernel (recurrent_kernel<DECODE>) needs 2048 blocks in 1.94 waves. The new state goes out
// with streaming stores (st.global.cs). decode_step picks it by DecodeArgs::kernel.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "ops/common/async_copy.cuh"
#include "ops/common/device_attributes.h"
#include "ops/common/sequences.h"
#include "ops/delta_rule/cuda/delta_rule_cuda.h"
#include "ops/delta_rule/cuda/device_common.cuh"

namespace kda::ops::cuda {
namespace {

using namespace kda::ops::cuda_detail;

constexpr int kTile = 32;  // state columns per block
constexpr int kThreads = 128;
constexpr float kLog2e = 1.4426950408889634f;

struct RecurrentParams {
  const void *q, *k, *v, *g, *beta;
  void* o;
  const float* h_in;       // states read at start (null: zeros)
  float* h_out;            // states written at end (null: not written)
  const int32_t* slots;    // decode: state index per sequence (in and out); null: sequence index
  const int64_t* seq_bos;  // [N] first token, or null for fixed length
  const int64_t* seq_len;  // [N]
  int64_t fixed_len;       // tokens per sequence when seq_bos is null
  int H, HV, V;
  float scale;
  // decode with token_slots (DecodeArgs): the state after token t of sequence n goes to state
  // index token_slots[n * len + t] (len = fixed_len) instead of the final state to `slots[n]`
  const int32_t* token_slots = nullptr;
  // decode with programmatic dependent launch and DecodeArgs::prefetch_state: the state (and the
  // slot indices) are read before waiting for the previous kernel on the stream
  bool state_before_wait = false;
};

// A state row read once, through L2 only (ld.global.cg): no L1 line is kept, and none that an
// earlier kernel left on this SM is used (the decode step may read before its programmatic wait).
__device__ __forceinline__ void load4_l2(const float* p, float out[4]) {
  asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(out[0]), "=f"(out[1]), "=f"(out[2]), "=f"(out[3])
               : "l"(p));
}

// Programmatic dependent launch (no-ops unless launched with programmatic stream serialization):
// wait for the previous kernel on the stream, then let the next one be scheduled. Triggering only
// after the wait keeps the chain's invariant that when a kernel starts, every kernel before its
// predecessor has completed (what DecodeArgs::prefetch_state relies on).
__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// R consecutive values of one thread's rows (R = K / 16: 8, 4, or 2 for K = 32).
template <int R, class T>
__device__ __forceinline__ void load_rows(const T* p, float out[R]) {
  if constexpr (R == 8) {
    load8(p, out);
  } else if constexpr (R == 4) {
    load4(p, out);
  } else {
#pragma unroll
    for (int r = 0; r < R; ++r) out[r] = to_f32(p[r]);
  }
}

// KEEP (decode with token_slots only): every token's state to its slot, no final store. A
// template flag so that the one-token step's code is the same as without the option (at the
// 64-register cap the runtime branch made the fp32 KDA instantiation spill).
template <class Tin, Gate GATE, int K, bool DECODE, bool KEEP = false>
__global__ void __launch_bounds__(kThreads, DECODE ? 8 : 1)
    recurrent_kernel(const RecurrentParams p) {
  static_assert(DECODE || !KEEP, "token slots are a decode option");
  constexpr int R = K / 16;
  if constexpr (DECODE)
    if (!p.state_before_wait) wait_for_previous_kernel();
  const int tiles = p.V / kTile;
  const int vt = blockIdx.x % tiles;
  const int hv = blockIdx.x / tiles;
  const int64_t n = blockIdx.y;
  const int h = hv / (p.HV / p.H);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int kg = warp * 4 + (lane >> 3);
  const int row0 = kg * R;
  const int col = vt * kTile + (lane & 7) * 4;

  const int64_t bos = p.seq_bos ? p.seq_bos[n] : n * p.fixed_len;
  const int64_t len = p.seq_bos ? p.seq_len[n] : p.fixed_len;
  const int64_t state_index = p.slots ? int64_t(p.slots[n]) : n;
  const size_t state_off = (size_t(state_index) * p.HV + hv) * size_t(K) * p.V;

  float s[R][4];
  if (p.h_in) {
    const float* src = p.h_in + state_off + size_t(row0) * p.V + col;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if constexpr (DECODE)
        load4_l2(src + size_t(r) * p.V, s[r]);
      else
        load4(src + size_t(r) * p.V, s[r]);
    }
  } else {
#pragma unroll
    for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = s[r][2] = s[r][3] = 0.f;
  }
  if constexpr (DECODE)
    if (p.state_before_wait) wait_for_previous_kernel();  // the state is in flight

  const Tin* q = static_cast<const Tin*>(p.q);
  const Tin* k = static_cast<const Tin*>(p.k);
  const Tin* v = static_cast<const Tin*>(p.v);
  const Tin* g = static_cast<const Tin*>(p.g);
  const Tin* beta = static_cast<const Tin*>(p.beta);
  Tin* o = static_cast<Tin*>(p.o);

  __shared__ float partial[2][4][8][9];  // [parity][warp][column group][kP x4, qP x4, q.k]

  for (int64_t t = 0; t < len; ++t) {
    const int64_t tok = bos + t;
    float kr[R], qr[R], vr[4];
    const size_t qk_off = (size_t(tok) * p.H + h) * K + row0;
    load_rows<R>(k + qk_off, kr);
    load_rows<R>(q + qk_off, qr);
    load4(v + (size_t(tok) * p.HV + hv) * p.V + col, vr);
    const float b = to_f32(beta[size_t(tok) * p.HV + hv]);
    if constexpr (GATE == Gate::channel) {
      float gr[R];
      const size_t g_off = (size_t(tok) * p.HV + hv) * K + row0;
      load_rows<R>(g + g_off, gr);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float decay = fast_exp2(gr[r] * kLog2e);
#pragma unroll
        for (int c = 0; c < 4; ++c) s[r][c] *= decay;
      }
    } else if constexpr (GATE == Gate::scalar) {
      const float decay = fast_exp2(to_f32(g[size_t(tok) * p.HV + hv]) * kLog2e);
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c) s[r][c] *= decay;
    }
    float acc[9];
#pragma unroll
    for (int i = 0; i < 9; ++i) acc[i] = 0.f;
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        acc[c] += kr[r] * s[r][c];
        acc[4 + c] += qr[r] * s[r][c];
      }
      acc[8] += qr[r] * kr[r];
    }
    // Sum over the four row groups of the warp (lanes l, l^8, l^16, l^24), then over warps.
#pragma unroll
    for (int i = 0; i < 9; ++i) {
      acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], 8);
      acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], 16);
    }
    const int parity = int(t & 1);
    if (lane < 8) {
#pragma unroll
      for (int i = 0; i < 9; ++i) partial[parity][warp][lane][i] = acc[i];
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < 9; ++i)
      acc[i] = partial[parity][0][lane & 7][i] + partial[parity][1][lane & 7][i] +
               partial[parity][2][lane & 7][i] + partial[parity][3][lane & 7][i];
    float d[4], out[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      d[c] = b * (vr[c] - acc[c]);
      out[c] = p.scale * (acc[4 + c] + acc[8] * d[c]);
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) s[r][c] += kr[r] * d[c];
    if (kg == 0) store4(o + (size_t(tok) * p.HV + hv) * p.V + col, out);
    if constexpr (KEEP) {  // speculative decoding: every token's state kept
      const size_t off = (size_t(p.token_slots[n * len + t]) * p.HV + hv) * size_t(K) * p.V;
      float* dst = p.h_out + off + size_t(row0) * p.V + col;
#pragma unroll
      for (int r = 0; r < R; ++r) store4(dst + size_t(r) * p.V, s[r]);
    }
  }

  if (!KEEP && p.h_out) {
    float* dst = p.h_out + state_off + size_t(row0) * p.V + col;
#pragma unroll
    for (int r = 0; r < R; ++r) store4(dst + size_t(r) * p.V, s[r]);
  }
}

// ---- the decode step's head kernel (see the top of the file) ----

constexpr int kHeadThreads = 256;  // 8 warps
constexpr int kHeadV = 128;        // 32 lanes x 4 columns

template <int K>
struct HeadLayout {
  static constexpr int kRegRows = K < 64 ? K : 64;    // rows held in registers
  static constexpr int kSmemRows = K - kRegRows;      // rows brought into shared memory
  static constexpr int kRegPerWarp = kRegRows / 8;    // a thread's register rows
  static constexpr int kSmemPerWarp = kSmemRows / 8;  // a thread's shared-memory rows
};

// Streaming 16-byte store (evict-first: this step does not read the new state again). No
// "memory" clobber, so loads of other addresses (shared-memory rows, the next row's k) may be
// scheduled across it; callers never read back what they store.
__device__ __forceinline__ void store4_streaming(float* p, const float v[4]) {
  asm volatile("st.global.cs.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(v[0]), "f"(v[1]),
               "f"(v[2]), "f"(v[3]));
}

// LOADS_FIRST (kernel lab, KDA_DECODE_HEAD_LOADS_FIRST=1, K = 128): the register rows' loads go
// out before the mbarrier set-up and its block barrier, so half the state is requested a barrier
// earlier (session 33 on an H100: KDA B = 16 ~1 % faster, Gated DeltaNet ~0.5 % slower).
template <class Tin, Gate GATE, int K, bool LOADS_FIRST = false>
__global__ void __launch_bounds__(kHeadThreads, 4) decode_head_kernel(const RecurrentParams p) {
  using L = HeadLayout<K>;
  constexpr int V = kHeadV, RR = L::kRegPerWarp, RS = L::kSmemPerWarp;
  static_assert(kHeadThreads == 2 * V && kHeadThreads == 8 * 32 && K <= kHeadThreads / 2,
                "the reductions and the staging assume 8 warps, 2 x V threads, K <= 128");
  if (!p.state_before_wait) wait_for_previous_kernel();
  __shared__ alignas(128) float rows_smem[L::kSmemRows > 0 ? L::kSmemRows * V : 4];
  __shared__ alignas(16) float part[2][8][V];  // [k^T P, q^T P][warp][column]
  __shared__ alignas(16) float total[2][V];
  __shared__ alignas(16) float v_s[V];
  // per row: k, k * decay, q * decay, decay
  __shared__ float k_s[K], kd_s[K], qd_s[K], decay_s[K];
  __shared__ float part_qk[8], qk_total, beta_s;
  __shared__ alignas(8) uint64_t bar;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int hv = blockIdx.x;
  const int64_t n = blockIdx.y;
  const int h = hv / (p.HV / p.H);
  const int64_t state_index = p.slots ? int64_t(p.slots[n]) : n;
  const size_t state_off = (size_t(state_index) * p.HV + hv) * size_t(K) * V;
  const float* src = p.h_in + state_off;
  // the new state: in place, or to the token's slot (one token per sequence here)
  const int64_t out_index = p.token_slots ? int64_t(p.token_slots[n]) : state_index;

  // Every state byte is requested first: the shared-memory rows by one bulk copy, then the
  // register rows (RR independent 16-byte loads per thread, one 512-byte row per warp each).
  float s[RR][4];
  if constexpr (LOADS_FIRST) {
#pragma unroll
    for (int r = 0; r < RR; ++r) load4_l2(src + size_t(warp * RR + r) * V + lane * 4, s[r]);
  }
  if constexpr (L::kSmemRows > 0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (tid == 0) {
      mbar_init(&bar, 1);
      mbar_init_fence();
    }
    // publish the initialisation before its first arrival, as CUTLASS's pipelines do: without
    // it racecheck reports the init against the same thread's expect_tx (session 16: the B = 16
    // rows are unchanged with the barrier)
    __syncthreads();
    if (tid == 0) {
      mbar_expect_tx(&bar, uint32_t(sizeof rows_smem));
      bulk_copy(rows_smem, src + size_t(L::kRegRows) * V, uint32_t(sizeof rows_smem), &bar);
    }
#else
    for (int i = tid; i < L::kSmemRows * V / 4; i += kHeadThreads)
      reinterpret_cast<float4*>(rows_smem)[i] =
          reinterpret_cast<const float4*>(src + size_t(L::kRegRows) * V)[i];
#endif
  }
  if constexpr (!LOADS_FIRST) {
#pragma unroll
    for (int r = 0; r < RR; ++r) load4_l2(src + size_t(warp * RR + r) * V + lane * 4, s[r]);
  }
  // prefetch_state: the state is in flight; the token's vectors come from the previous kernel
  if (p.state_before_wait) wait_for_previous_kernel();

  // The token's vectors, staged in shared memory (registers are for the state): thread `row`
  // < K takes q, k and the gate of its row (and q.k, summed per warp); the second half of the
  // block takes v; thread 0 beta.
  const size_t head = size_t(n) * p.HV + hv;
  if (tid < K) {
    const Tin* q = static_cast<const Tin*>(p.q);
    const Tin* k = static_cast<const Tin*>(p.k);
    const Tin* g = static_cast<const Tin*>(p.g);
    const size_t qk_off = (size_t(n) * p.H + h) * K + tid;
    const float qv = to_f32(q[qk_off]), kv = to_f32(k[qk_off]);
    float decay = 1.f;
    if constexpr (GATE == Gate::channel) decay = fast_exp2(to_f32(g[head * K + tid]) * kLog2e);
    if constexpr (GATE == Gate::scalar) decay = fast_exp2(to_f32(g[head]) * kLog2e);
    k_s[tid] = kv;
    kd_s[tid] = kv * decay;
    qd_s[tid] = qv * decay;
    decay_s[tid] = decay;
    float qk = qv * kv;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) qk += __shfl_xor_sync(0xffffffffu, qk, off);
    if (lane == 0) part_qk[warp] = qk;
    if (tid == 0) beta_s = to_f32(static_cast<const Tin*>(p.beta)[head]);
  }
  if (tid >= kHeadThreads / 2)
    v_s[tid - kHeadThreads / 2] =
        to_f32(static_cast<const Tin*>(p.v)[head * V + tid - kHeadThreads / 2]);
  __syncthreads();  // the staged vectors (and the mbarrier's initialisation) visible

  // Partial k^T P and q^T P over this warp's rows, P = diag(decay) S: (k decay)^T S.
  float ak[4] = {0.f, 0.f, 0.f, 0.f}, aq[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int r = 0; r < RR; ++r) {
    const int row = warp * RR + r;
    const float kd = kd_s[row], qd = qd_s[row];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      ak[c] += kd * s[r][c];
      aq[c] += qd * s[r][c];
    }
  }
  if constexpr (RS > 0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    mbar_wait(&bar, 0);
#endif
#pragma unroll 2
    for (int r = 0; r < RS; ++r) {
      const int j = warp * RS + r, row = L::kRegRows + j;
      const float kd = kd_s[row], qd = qd_s[row];
      const float4 x = reinterpret_cast<const float4*>(rows_smem)[j * (V / 4) + lane];
      ak[0] += kd * x.x, ak[1] += kd * x.y, ak[2] += kd * x.z, ak[3] += kd * x.w;
      aq[0] += qd * x.x, aq[1] += qd * x.y, aq[2] += qd * x.z, aq[3] += qd * x.w;
    }
  }
  // Cross-warp sums: thread t adds the 8 warps' partials of one (quantity, column).
  reinterpret_cast<float4*>(part[0][warp])[lane] = make_float4(ak[0], ak[1], ak[2], ak[3]);
  reinterpret_cast<float4*>(part[1][warp])[lane] = make_float4(aq[0], aq[1], aq[2], aq[3]);
  __syncthreads();
  {
    const int which = tid / V, col = tid % V;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) sum += part[which][w][col];
    total[which][col] = sum;
    if (tid == 0) {
      float all = 0.f;
#pragma unroll
      for (int w = 0; w < K / 32; ++w) all += part_qk[w];
      qk_total = all;
    }
  }
  __syncthreads();

  //   d = beta (v - P^T k),   o = scale (P^T q + (q.k) d),   S = P + k d^T (in place)
  float d[4];
  {
    const float4 kp = reinterpret_cast<const float4*>(total[0])[lane];
    const float4 v4 = reinterpret_cast<const float4*>(v_s)[lane];
    const float b = beta_s;
    d[0] = b * (v4.x - kp.x), d[1] = b * (v4.y - kp.y);
    d[2] = b * (v4.z - kp.z), d[3] = b * (v4.w - kp.w);
  }
  if (warp == 0) {
    const float4 qp = reinterpret_cast<const float4*>(total[1])[lane];
    const float qk = qk_total;
    const float out[4] = {p.scale * (qp.x + qk * d[0]), p.scale * (qp.y + qk * d[1]),
                          p.scale * (qp.z + qk * d[2]), p.scale * (qp.w + qk * d[3])};
    store4(static_cast<Tin*>(p.o) + head * V + lane * 4, out);
  }
  float* dst = p.h_out + (size_t(out_index) * p.HV + hv) * size_t(K) * V;
#pragma unroll
  for (int r = 0; r < RR; ++r) {
    const int row = warp * RR + r;
    const float kv = k_s[row], decay = decay_s[row];
#pragma unroll
    for (int c = 0; c < 4; ++c) s[r][c] = s[r][c] * decay + kv * d[c];
    store4_streaming(dst + size_t(row) * V + lane * 4, s[r]);
  }
#pragma unroll 2
  for (int r = 0; r < RS; ++r) {
    const int j = warp * RS + r, row = L::kRegRows + j;
    const float kv = k_s[row], decay = decay_s[row];
    const float4 x = reinterpret_cast<const float4*>(rows_smem)[j * (V / 4) + lane];
    const float y[4] = {x.x * decay + kv * d[0], x.y * decay + kv * d[1], x.z * decay + kv * d[2],
                        x.w * decay + kv * d[3]};
    store4_streaming(dst + size_t(row) * V + lane * 4, y);
  }
}

// ---- the decode step's bandwidth ceiling (decode_state_copy) ----

// Grid-stride over 8 KB chunks (256 threads x two 16-byte vectors) of the B states, as many
// blocks as fit at once: no wave quantisation (a B = 16 step is 4096 chunks over ~1056 blocks).
constexpr int kCopyThreads = 256, kCopyPerThread = 2;

__global__ void __launch_bounds__(kCopyThreads)
    decode_state_copy_kernel(float* pool, const int32_t* slots, int64_t state_vecs,
                             int64_t chunks_per_state, int64_t chunks) {
  wait_for_previous_kernel();
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const int64_t seq = c / chunks_per_state, part = c % chunks_per_state;
    float* base = pool + int64_t(slots[seq]) * state_vecs * 4;
    const int64_t first = part * kCopyThreads * kCopyPerThread + threadIdx.x;
    float x[kCopyPerThread][4];
#pragma unroll
    for (int j = 0; j < kCopyPerThread; ++j) {
      const int64_t i = first + int64_t(j) * kCopyThreads;
      if (i < state_vecs) load4(base + 4 * i, x[j]);
    }
#pragma unroll
    for (int j = 0; j < kCopyPerThread; ++j) {
      const int64_t i = first + int64_t(j) * kCopyThreads;
      if (i < state_vecs) store4_streaming(base + 4 * i, x[j]);  // asm volatile: never elided
    }
  }
}

// ---- launches ----

template <class... Params, class... Args>
void launch_maybe_overlapped(void (*kernel)(Params...), dim3 grid, int threads, bool overlap,
                             cudaStream_t stream, Args... args) {
  if (!overlap) {
    kernel<<<grid, threads, 0, stream>>>(args...);
    return;
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(unsigned(threads));
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  check_cuda(cudaLaunchKernelEx(&cfg, kernel, args...), "delta rule decode launch");
}

template <class Tin, Gate GATE, int K, bool DECODE, bool KEEP>
void launch_kernel(dim3 grid, const RecurrentParams& p, bool overlap, cudaStream_t stream) {
  launch_maybe_overlapped(recurrent_kernel<Tin, GATE, K, DECODE, KEEP>, grid, kThreads, overlap,
                          stream, p);
}

template <class Tin, Gate GATE, int K, bool LOADS_FIRST = false>
void launch_head_kernel(dim3 grid, const RecurrentParams& p, bool overlap, cudaStream_t stream) {
  const auto kernel = decode_head_kernel<Tin, GATE, K, LOADS_FIRST>;
  // 4 blocks x 44.6 KB of static shared memory per SM: left to the driver, whose default
  // carveout is sized to avoid a shared-memory occupancy limit (expected: 196 of the 228 KB,
  // leaving 60 KB of L1 for the register rows' loads). Kernel-lab knob:
  // KDA_DECODE_CARVEOUT=<percent> sets the preference instead (read once per instantiation).
  static const bool configured = [&] {
    if (const char* knob = std::getenv("KDA_DECODE_CARVEOUT"))
      check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                      std::atoi(knob)),
                 "cudaFuncSetAttribute (decode_head_kernel carveout)");
    return true;
  }();
  (void)configured;
  launch_maybe_overlapped(kernel, grid, kHeadThreads, overlap, stream, p);
}

template <class Tin, Gate GATE>
void launch_head_for_k(int K, dim3 grid, const RecurrentParams& p, bool overlap,
                       cudaStream_t stream) {
  // Kernel-lab knob: KDA_DECODE_HEAD_LOADS_FIRST=1 (K = 128; see decode_head_kernel)
  static const bool loads_first = [] {
    const char* knob = std::getenv("KDA_DECODE_HEAD_LOADS_FIRST");
    return knob && knob[0] == '1';
  }();
  if (K == 128 && loads_first)
    launch_head_kernel<Tin, GATE, 128, true>(grid, p, overlap, stream);
  else if (K == 128)
    launch_head_kernel<Tin, GATE, 128>(grid, p, overlap, stream);
  else if (K == 64)
    launch_head_kernel<Tin, GATE, 64>(grid, p, overlap, stream);
  else
    launch_head_kernel<Tin, GATE, 32>(grid, p, overlap, stream);
}

template <class Tin>
void launch_head_for_gate(Gate gate, int K, dim3 grid, const RecurrentParams& p, bool overlap,
                          cudaStream_t stream) {
  switch (gate) {
    case Gate::channel:
      launch_head_for_k<Tin, Gate::channel>(K, grid, p, overlap, stream);
      break;
    case Gate::scalar:
      launch_head_for_k<Tin, Gate::scalar>(K, grid, p, overlap, stream);
      break;
    case Gate::none:
      launch_head_for_k<Tin, Gate::none>(K, grid, p, overlap, stream);
      break;
  }
}

template <class Tin, Gate GATE, bool DECODE, bool KEEP>
void launch_for_k(int K, dim3 grid, const RecurrentParams& p, bool overlap, cudaStream_t stream) {
  if (K == 128)
    launch_kernel<Tin, GATE, 128, DECODE, KEEP>(grid, p, overlap, stream);
  else if (K == 64)
    launch_kernel<Tin, GATE, 64, DECODE, KEEP>(grid, p, overlap, stream);
  else
    launch_kernel<Tin, GATE, 32, DECODE, KEEP>(grid, p, overlap, stream);
}

template <class Tin, bool DECODE, bool KEEP = false>
void launch_for_gate(Gate gate, int K, dim3 grid, const RecurrentParams& p, bool overlap,
                     cudaStream_t stream) {
  switch (gate) {
    case Gate::channel:
      launch_for_k<Tin, Gate::channel, DECODE, KEEP>(K, grid, p, overlap, stream);
      break;
    case Gate::scalar:
      launch_for_k<Tin, Gate::scalar, DECODE, KEEP>(K, grid, p, overlap, stream);
      break;
    case Gate::none:
      launch_for_k<Tin, Gate::none, DECODE, KEEP>(K, grid, p, overlap, stream);
      break;
  }
}

// decode: the DECODE instantiation (64 registers), optionally with the overlapped launch
void launch_recurrent(const DeltaRuleShape& s, ElementType dtype, int64_t num_seqs,
                      const RecurrentParams& p, cudaStream_t stream, bool decode = false,
                      bool overlap = false) {
  require(s.K == 32 || s.K == 64 || s.K == 128,
          "delta rule (cuda recurrent): K must be 32, 64 or 128, got " + std::to_string(s.K));
  require(s.V % kTile == 0 && s.V >= kTile,
          "delta rule (cuda recurrent): V must be a multiple of 32, got " + std::to_string(s.V));
  require(num_seqs <= 65535, "delta rule (cuda recurrent): at most 65535 sequences per call");
  const dim3 grid(unsigned(s.HV * (s.V / kTile)), unsigned(num_seqs));
  if (decode && p.token_slots) {
    if (dtype == ElementType::bf16)
      launch_for_gate<__nv_bfloat16, true, true>(s.gate, int(s.K), grid, p, overlap, stream);
    else
      launch_for_gate<float, true, true>(s.gate, int(s.K), grid, p, overlap, stream);
  } else if (decode) {
    if (dtype == ElementType::bf16)
      launch_for_gate<__nv_bfloat16, true>(s.gate, int(s.K), grid, p, overlap, stream);
    else
      launch_for_gate<float, true>(s.gate, int(s.K), grid, p, overlap, stream);
  } else {
    if (dtype == ElementType::bf16)
      launch_for_gate<__nv_bfloat16, false>(s.gate, int(s.K), grid, p, false, stream);
    else
      launch_for_gate<float, false>(s.gate, int(s.K), grid, p, false, stream);
  }
  check_launch("delta rule recurrent kernel");
}

void require_tokens(const DeltaRuleShape& s, const void* q, const void* k, const void* v,
                    const void* g, const void* beta, const void* o) {
  require(q && k && v && beta && o, "delta rule (cuda): q, k, v, beta and o must be non-null");
  require(s.gate == Gate::none || g, "delta rule (cuda): the gate g is null");
}

}  // namespace

size_t recurrent_forward_workspace_bytes(std::span<const int64_t> cu_seqlens) {
  return cu_seqlens.empty() ? 0 : 2 * sizeof(int64_t) * (cu_seqlens.size() - 1);
}

void recurrent_forward(const DeltaRuleDeviceInputs& in, void* o, float* ht, void* workspace,
                       size_t workspace_bytes, cudaStream_t stream) {
  const DeltaRuleShape& s = in.shape;
  s.validate();
  require_tokens(s, in.q, in.k, in.v, in.g, in.beta, o);
  require(!in.kda_layer.any(),
          "delta rule (cuda recurrent): KDA layer options need the bf16 chunked path");
  const SequenceLayout seqs(s.B, s.T, in.cu_seqlens);
  RecurrentParams p{
      in.q,    in.k,    in.v,    in.g, in.beta,  o,         in.h0,    ht,
      nullptr, nullptr, nullptr, s.T,  int(s.H), int(s.HV), int(s.V), float(s.effective_scale())};
  const int64_t N = seqs.num_sequences();
  if (!in.cu_seqlens.empty()) {
    const size_t need = recurrent_forward_workspace_bytes(in.cu_seqlens);
    require(workspace && workspace_bytes >= need,
            "delta rule (cuda recurrent): workspace too small (" + std::to_string(workspace_bytes) +
                " < " + std::to_string(need) + " bytes)");
    std::vector<int64_t> table(2 * N);
    for (int64_t i = 0; i < N; ++i) table[i] = seqs.start(i), table[N + i] = seqs.length(i);
    check_cuda(cudaMemcpyAsync(workspace, table.data(), need, cudaMemcpyHostToDevice, stream),
               "copy of the sequence table");
    p.seq_bos = static_cast<const int64_t*>(workspace);
    p.seq_len = p.seq_bos + N;
  }
  launch_recurrent(s, in.dtype, N, p, stream);
}

namespace {

bool decode_overlap(const DecodeArgs& a) {
  // Kernel-lab knob: KDA_DECODE_OVERLAP=0|1 overrides DecodeArgs::overlap_launch (timing only).
  if (const char* knob = std::getenv("KDA_DECODE_OVERLAP")) return knob[0] == '1';
  return a.overlap_launch;
}

bool decode_prefetch(const DecodeArgs& a) {
  // Only where the caller vouches for the contract (DecodeArgs::prefetch_state); the kernel-lab
  // knob KDA_DECODE_PREFETCH=0 can turn it off, never on.
  const char* knob = std::getenv("KDA_DECODE_PREFETCH");
  return a.prefetch_state && !(knob && knob[0] == '0');
}

bool use_head_kernel(const DecodeArgs& a, const DeltaRuleShape& s) {
  const bool head_fits = s.V == kHeadV && (s.K == 32 || s.K == 64 || s.K == 128) && a.tokens == 1;
  DecodeKernel kernel = a.kernel;
  if (kernel == DecodeKernel::automatic) {
    // Kernel-lab knob: KDA_DECODE_KERNEL=tile|head|auto replaces `automatic` (timing only; head
    // only where it fits)
    if (const char* knob = std::getenv("KDA_DECODE_KERNEL")) {
      if (std::strcmp(knob, "tile") == 0) kernel = DecodeKernel::tile;
      if (std::strcmp(knob, "head") == 0 && head_fits) kernel = DecodeKernel::head;
    }
  }
  if (kernel == DecodeKernel::head) {
    require(head_fits,
            "delta rule decode (cuda): the head kernel needs V = 128, K in {32, 64, 128} and one "
            "token per sequence, got K = " +
                std::to_string(s.K) + ", V = " + std::to_string(s.V) +
                ", tokens = " + std::to_string(a.tokens));
    return true;
  }
  if (kernel == DecodeKernel::tile || !head_fits) return false;
  // automatic: the head kernel once the tile kernel needs more than one wave (8 blocks per SM)
  return s.B * s.HV * (s.V / kTile) > int64_t(8) * device_sm_count();
}

}  // namespace

void decode_step(const DecodeArgs& a, cudaStream_t stream) {
  require(a.tokens >= 1 && a.tokens <= kMaxDecodeTokens,
          "delta rule decode (cuda): tokens per sequence must be in [1, " +
              std::to_string(kMaxDecodeTokens) + "], got " + std::to_string(a.tokens));
  DeltaRuleShape s = a.shape;
  s.T = a.tokens;
  s.validate();
  require_tokens(s, a.q, a.k, a.v, a.g, a.beta, a.o);
  require(a.state_pool && a.slots, "delta rule decode (cuda): state_pool and slots are required");
  require(a.num_slots >= 1, "delta rule decode (cuda): num_slots must be positive");
  const bool overlap = decode_overlap(a);
  RecurrentParams p{a.q,      a.k,       a.v,          a.g,
                    a.beta,   a.o,       a.state_pool, a.state_pool,
                    a.slots,  nullptr,   nullptr,      a.tokens,
                    int(s.H), int(s.HV), int(s.V),     float(s.effective_scale())};
  p.token_slots = a.token_slots;
  p.state_before_wait = overlap && decode_prefetch(a);
  if (!use_head_kernel(a, s)) {
    launch_recurrent(s, a.dtype, s.B, p, stream, true, overlap);
    return;
  }
  require(s.B <= 65535, "delta rule decode (cuda): at most 65535 sequences per call");
  require(aligned16(a.state_pool),
          "delta rule decode (cuda): the head kernel needs a 16-byte aligned state_pool");
  const dim3 grid(unsigned(s.HV), unsigned(s.B));
  if (a.dtype == ElementType::bf16)
    launch_head_for_gate<__nv_bfloat16>(s.gate, int(s.K), grid, p, overlap, stream);
  else
    launch_head_for_gate<float>(s.gate, int(s.K), grid, p, overlap, stream);
  check_launch("delta rule decode head kernel");
}

void decode_state_copy(const DecodeArgs& a, cudaStream_t stream) {
  const DeltaRuleShape& s = a.shape;
  require(a.state_pool && a.slots, "decode_state_copy: state_pool and slots are required");
  require(s.B >= 1 && s.B <= 65535, "decode_state_copy: B must be in [1, 65535]");
  const int64_t state_floats = s.HV * s.K * s.V;
  require(state_floats % 4 == 0 && aligned16(a.state_pool),
          "decode_state_copy: each state must be a whole number of aligned 16-byte vectors");
  const int64_t state_vecs = state_floats / 4, per_chunk = int64_t(kCopyThreads) * kCopyPerThread;
  const int64_t chunks_per_state = (state_vecs + per_chunk - 1) / per_chunk;
  const int64_t chunks = chunks_per_state * s.B;
  const int64_t resident = int64_t(2048 / kCopyThreads) * device_sm_count();  // 8 of 256 an SM
  const dim3 grid(unsigned(std::min(chunks, resident)));
  launch_maybe_overlapped(decode_state_copy_kernel, grid, kCopyThreads, decode_overlap(a), stream,
                          a.state_pool, a.slots, state_vecs, chunks_per_state, chunks);
  check_launch("decode_state_copy kernel");
}

}  // namespace kda::ops::cuda
