// Linear attention forward and backward on the GPU (linear_attn_cuda.h), fp32 in and out.
//
// Every walking kernel runs one block of 256 threads per (sequence, head, 32-column tile of V)
// over chunks of C = 64 tokens. A chunk's rows live in shared memory: phi(Q), phi(K) [C, K + 4],
// the tile's V (and the output cotangent E) [C, 36], C x C score matrices [C, 68] and the
// tile's state slice [K, 36] (row strides that are multiples of 4 floats, as WMMA needs, and not
// of 32, to spread banks; every region starts at a multiple of 8 floats, WMMA's pointer
// alignment). Rows past the end of the sequence are zeros, so they add nothing to any sum.
//
// With Qp = phi(Q), Kp = phi(K), M the causal mask (j <= i) and E the cotangent the numerator
// sees (d_o, or d_o / den normalised), per chunk (ops/linear_attn/cpu/linear_attn_chunk*.cpp):
//
//   forward:  O   = scale ((Qp Kp^T) .* M) V + scale Qp S,  S += Kp^T V
//             den = scale Qp . (z + causal prefix of Kp) + 1e-10, O /= den, z += sum Kp
//   dq walk:  dQp = A Kp + scale E S^T + w z_prev            A = M .* (scale E V^T + w 1^T)
//   dk walk:  dKp = A^T Qp + V G^T + Gz,  dV = scale ((Qp Kp^T) .* M)^T E + Kp G
//             G  += scale Qp^T E,  Gz += Qp^T w
//
// where w_i = -scale (o_i . d_o_i) / den_i (zero for the plain form). Folding w into A gives the
// normaliser's terms w_i z_i (z_i inclusive of token i) and sum_{i >= j} w_i Qp_i of the CPU
// backward without a per-row running z. E V^T, E S^T and V G^T sum over V, so a tile holds a
// partial dQp / dKp: the w and Gz terms go to tile 0's partial only, and a reduce kernel adds the
// tiles in order and multiplies by the feature map's slope. The backward walks load E times
// `scale`, so every product that reads E carries that factor.
//
// Every product of a chunk is a WMMA product of shared-memory tiles in 3xTF32: a = a_hi + a_lo
// and b = b_hi + b_lo in TF32, a_hi b_hi + a_hi b_lo + a_lo b_hi accumulated in fp32, which keeps
// fp32's accuracy (the checks hold it to 1e-4 / 1e-3 against float64) at a third of TF32's rate.
// The walks are bound by latency more than by arithmetic, so a thread also issues all of a
// chunk's loads before using the first (one memory round trip a chunk, not one an element): on
// the H200 the tensor cores took the forward from 1.11 to 0.90 ms and the batched loads to 0.59
// (docs/PERF.md, "Linear attention on the GPU").
#include <mma.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/error.h"
#include "ops/common/device_buffer.h"
#include "ops/common/sequences.h"
#include "ops/linear_attn/cuda/linear_attn_cuda.h"

namespace kda::ops::cuda {
namespace {

constexpr int kChunk = 64;             // C: tokens per chunk
constexpr int kTile = 32;              // V columns per block
constexpr int kThreads = 256;          // 8 warps
constexpr int kWarps = kThreads / 32;  // tiles handled in parallel
constexpr int kTS = kTile + 4;         // tile and state rows
constexpr int kSS = kChunk + 4;        // score rows
template <int K>
constexpr int kFS = K + 4;      // feature rows
constexpr size_t kAlign = 256;  // workspace regions

namespace wmma = nvcuda::wmma;

void check_launch(const char* what) {
  check_cuda(cudaGetLastError(), what);
}

size_t align_up(size_t bytes) {
  return (bytes + kAlign - 1) / kAlign * kAlign;
}

__device__ __forceinline__ float feature_map(float x) {
  return x > 0.0f ? x + 1.0f : expf(x);
}
__device__ __forceinline__ float feature_slope(float x) {
  return x > 0.0f ? 1.0f : expf(x);
}

struct Params {
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  const float* d_o = nullptr;        // backward
  const int64_t* offsets = nullptr;  // N + 1 sequence starts (token rows), last = B T; or null:
  int64_t seq_tokens = 0;            // B sequences of seq_tokens tokens
  float* o = nullptr;                // forward output [rows, H, V]
  float* den_out = nullptr;          // forward, normalised: den [rows, H] (tile 0 writes), or null
  const float* den = nullptr;        // backward, normalised: den [rows, H]
  const float* w = nullptr;          // backward, normalised: w [rows, H]
  float* partial = nullptr;          // backward: [tiles, rows, H, K]
  float* dv = nullptr;               // backward: [rows, H, V]
  int64_t rows = 0;                  // B T
  int H = 1, V = 32, tiles = 1;
  float scale = 1.0f;
  bool normalize = false;
};

struct BlockWork {
  int64_t start, length;
  int h, tile, v0;
};

__device__ __forceinline__ BlockWork block_work(const Params& p) {
  const int64_t item = blockIdx.x;
  BlockWork b;
  b.tile = int(item % p.tiles);
  const int64_t nh = item / p.tiles;
  b.h = int(nh % p.H);
  const int64_t n = nh / p.H;
  b.start = p.offsets ? p.offsets[n] : n * p.seq_tokens;
  b.length = p.offsets ? p.offsets[n + 1] - b.start : p.seq_tokens;
  b.v0 = b.tile * kTile;
  return b;
}

using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major>;
using FragAT = wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::col_major>;
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major>;
using FragBT = wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 8, float>;

// hi = tf32(x), lo = tf32(x - hi), element by element (the same mapping in both fragments)
template <class Frag>
__device__ __forceinline__ void split(Frag& hi, Frag& lo) {
#pragma unroll
  for (int t = 0; t < hi.num_elements; ++t) {
    const float x = hi.x[t];
    const float h = wmma::__float_to_tf32(x);
    hi.x[t] = h;
    lo.x[t] = wmma::__float_to_tf32(x - h);
  }
}

// acc += A B over k in [k0, k1) (multiples of 8) for one 16 x 16 output tile. `a` points at the
// tile's A element (row 0, k 0) and `b` at its B element (k 0, column 0); a_step / b_step are
// the distances between k and k + 1 in A and B (1 along a row, the leading dimension across
// rows). LA / LB are the WMMA fragment types of A (FragA: row-major, FragAT: A stored as its
// transpose) and of B.
template <class LA, class LB>
__device__ __forceinline__ void product(FragC& acc, const float* a, int lda, int a_step,
                                        const float* b, int ldb, int b_step, int k0, int k1) {
  for (int k = k0; k < k1; k += 8) {
    LA a_hi, a_lo;
    LB b_hi, b_lo;
    wmma::load_matrix_sync(a_hi, a + k * a_step, lda);
    wmma::load_matrix_sync(b_hi, b + k * b_step, ldb);
    split(a_hi, a_lo);
    split(b_hi, b_lo);
    wmma::mma_sync(acc, a_lo, b_hi, acc);
    wmma::mma_sync(acc, a_hi, b_lo, acc);
    wmma::mma_sync(acc, a_hi, b_hi, acc);
  }
}

// dst[i, c] = phi(src row i) for i < L, zero rows after (stride K + 4). Every load of a thread
// is issued before the first is used: one round trip to memory a chunk, not one an element
// (which is what bound the walks: 56 us a chunk with the loads one after another).
template <int K>
__device__ void load_features(const float* src, int64_t token0, int H, int h, int L, float* dst) {
  constexpr int kRows = kThreads / K, kPerThread = kChunk / kRows;  // rows a pass; passes
  const int c = int(threadIdx.x) % K, i0 = int(threadIdx.x) / K;
  const int64_t step = int64_t(kRows) * H * K;
  const float* from = src + ((token0 + i0) * H + h) * K + c;
  float x[kPerThread];
#pragma unroll
  for (int u = 0; u < kPerThread; ++u, from += step) x[u] = i0 + kRows * u < L ? *from : 0.0f;
#pragma unroll
  for (int u = 0; u < kPerThread; ++u) {
    const int i = i0 + kRows * u;
    dst[i * kFS<K> + c] = i < L ? feature_map(x[u]) : 0.0f;
  }
}

// dst[i, v] = factor * src[row i, v0 + v] (/ den[row i] when den is given) for i < L, zero rows
// after (stride 36); loads issued first, as load_features.
__device__ void load_tile(const float* src, const float* den, float factor, int64_t token0, int H,
                          int h, int V, int v0, int L, float* dst) {
  constexpr int kRows = kThreads / kTile, kPerThread = kChunk / kRows;
  const int v = int(threadIdx.x) % kTile, i0 = int(threadIdx.x) / kTile;
  const int64_t row0 = (token0 + i0) * H + h, row_step = int64_t(kRows) * H;
  float x[kPerThread], d[kPerThread];
#pragma unroll
  for (int u = 0; u < kPerThread; ++u) {
    const bool live = i0 + kRows * u < L;
    const int64_t row = row0 + row_step * u;
    x[u] = live ? src[row * V + v0 + v] : 0.0f;
    d[u] = live && den ? den[row] : 1.0f;
  }
#pragma unroll
  for (int u = 0; u < kPerThread; ++u) dst[(i0 + kRows * u) * kTS + v] = factor * x[u] / d[u];
}

// out[i, j] = a_i . b_j over `width` columns (a, b stride ld) for the 10 tiles on or below the
// diagonal of the 64 x 64 result; the 6 tiles above it are zeroed. Warps take tiles in turn.
__device__ void lower_scores(const float* a, const float* b, int ld, int width, float* out,
                             int first_warp, int warps) {
  const int warp = int(threadIdx.x / 32) - first_warp;
  if (warp < 0 || warp >= warps) return;
  for (int t = warp; t < 16; t += warps) {
    const int ti = t / 4, tj = t % 4;
    FragC acc;
    wmma::fill_fragment(acc, 0.0f);
    if (tj <= ti)
      product<FragA, FragBT>(acc, a + ti * 16 * ld, ld, 1, b + tj * 16 * ld, ld, 1, 0, width);
    wmma::store_matrix_sync(out + ti * 16 * kSS + tj * 16, acc, kSS, wmma::mem_row_major);
  }
}

// state[K, 32] += x^T y over the chunk's 64 rows (x [C, K + 4], y [C, 36], state [K, 36]).
template <int K>
__device__ void add_outer(const float* x, const float* y, float* state) {
  const int warp = threadIdx.x / 32;
  for (int t = warp; t < K / 16 * 2; t += kWarps) {
    const int tc = t / 2, tv = t % 2;
    FragC acc;
    float* s = state + tc * 16 * kTS + tv * 16;
    wmma::load_matrix_sync(acc, s, kTS, wmma::mem_row_major);
    product<FragAT, FragB>(acc, x + tc * 16, kFS<K>, kFS<K>, y + tv * 16, kTS, kTS, 0, kChunk);
    wmma::store_matrix_sync(s, acc, kTS, wmma::mem_row_major);
  }
}

// sum[c] += sum_{i < 64} weight_i x[i, c] (weight null: 1); rows past L are zero.
template <int K>
__device__ void add_column_sums(const float* x, const float* weight, float* sum) {
  for (int c = threadIdx.x; c < K; c += kThreads) {
    float acc = 0.0f;
    for (int i = 0; i < kChunk; ++i) acc = fmaf(weight ? weight[i] : 1.0f, x[i * kFS<K> + c], acc);
    sum[c] += acc;
  }
}

// 111 KB at K = 128: two blocks an SM (O is staged over P, not beside it, for that)
template <int K>
constexpr size_t forward_smem_floats() {  // Qp, Kp, V, P (then O), S, z, 1 / den
  return 2 * kChunk * kFS<K> + kChunk * kTS + kChunk * kSS + K * kTS + K + kChunk;
}

template <int K>
__global__ void __launch_bounds__(kThreads, 2) forward_kernel(Params p) {
  extern __shared__ __align__(128) float smem[];
  float* Qp = smem;                  // [C, K + 4]
  float* Kp = Qp + kChunk * kFS<K>;  // [C, K + 4]
  float* Vs = Kp + kChunk * kFS<K>;  // [C, 36]
  float* P = Vs + kChunk * kTS;      // [C, 68]
  float* Os = P;                     // [C, 36] over P once it is read
  float* S = P + kChunk * kSS;       // [K, 36]
  float* z = S + K * kTS;            // [K]
  float* inv_den = z + K;            // [C]
  const BlockWork b = block_work(p);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

  for (int idx = threadIdx.x; idx < K * kTS; idx += kThreads) S[idx] = 0.0f;
  for (int idx = threadIdx.x; idx < K; idx += kThreads) z[idx] = 0.0f;

  for (int64_t t0 = 0; t0 < b.length; t0 += kChunk) {
    const int L = int(b.length - t0 < kChunk ? b.length - t0 : kChunk);
    const int64_t token0 = b.start + t0;
    __syncthreads();  // the previous chunk's state update is done with the rows
    load_features<K>(p.q, token0, p.H, b.h, L, Qp);
    load_features<K>(p.k, token0, p.H, b.h, L, Kp);
    load_tile(p.v, nullptr, 1.0f, token0, p.H, b.h, p.V, b.v0, L, Vs);
    __syncthreads();
    lower_scores(Qp, Kp, kFS<K>, K, P, 0, kWarps);
    __syncthreads();
    for (int idx = threadIdx.x; idx < kChunk * kChunk; idx += kThreads) {
      const int i = idx / kChunk, j = idx % kChunk;
      if (j > i) P[i * kSS + j] = 0.0f;  // the diagonal tiles' upper parts
    }
    __syncthreads();

    if (p.normalize) {  // den_i = scale (intra + carried) + 1e-10, as the CPU forward
      for (int i = warp; i < kChunk; i += kWarps) {
        float sum = P[i * kSS + lane] + P[i * kSS + lane + 32];
        for (int c = lane; c < K; c += 32) sum = fmaf(Qp[i * kFS<K> + c], z[c], sum);
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2)
          sum += __shfl_xor_sync(0xffffffffu, sum, offset);
        const float den = p.scale * sum + 1e-10f;
        if (lane == 0) {
          inv_den[i] = 1.0f / den;
          if (p.den_out && b.tile == 0 && i < L) p.den_out[(token0 + i) * p.H + b.h] = den;
        }
      }
    }

    // O = P V + Qp S: one 16 x 16 tile a warp
    const int ti = warp / 2, tv = warp % 2;
    FragC acc;
    wmma::fill_fragment(acc, 0.0f);
    product<FragA, FragB>(acc, P + ti * 16 * kSS, kSS, 1, Vs + tv * 16, kTS, kTS, 0, (ti + 1) * 16);
    product<FragA, FragB>(acc, Qp + ti * 16 * kFS<K>, kFS<K>, 1, S + tv * 16, kTS, kTS, 0, K);
    __syncthreads();  // P, S and z read; inv_den written
    wmma::store_matrix_sync(Os + ti * 16 * kTS + tv * 16, acc, kTS, wmma::mem_row_major);
    __syncthreads();

    for (int idx = threadIdx.x; idx < L * kTile; idx += kThreads) {
      const int i = idx / kTile, v = idx % kTile;
      float out = p.scale * Os[i * kTS + v];
      if (p.normalize) out *= inv_den[i];
      p.o[((token0 + i) * p.H + b.h) * p.V + b.v0 + v] = out;
    }
    add_outer<K>(Kp, Vs, S);
    if (p.normalize) add_column_sums<K>(Kp, nullptr, z);
  }
}

template <int K>
constexpr size_t dq_smem_floats() {  // Kp, [A, E, V] (the dQ staging after), S, z, w
  return kChunk * kFS<K> + kChunk * kSS + 2 * kChunk * kTS + K * kTS + K + kChunk;
}

// The forward walk: partial[tile, row, c] = dQp of this tile (tile 0 with the normaliser's term).
template <int K>
__global__ void __launch_bounds__(kThreads, 2) dq_kernel(Params p) {
  constexpr int kOutTiles = 4 * (K / 16), kPerWarp = (kOutTiles + kWarps - 1) / kWarps;
  static_assert(kChunk * kSS + 2 * kChunk * kTS >= kChunk * kFS<K>, "dQ staging fits");
  extern __shared__ __align__(128) float smem[];
  float* Kp = smem;                 // [C, K + 4]
  float* A = Kp + kChunk * kFS<K>;  // [C, 68]
  float* Es = A + kChunk * kSS;     // [C, 36]
  float* Vs = Es + kChunk * kTS;    // [C, 36]
  float* staged = A;                // [C, K + 4] over A, Es, Vs once they are read
  float* S = Vs + kChunk * kTS;     // [K, 36]
  float* z = S + K * kTS;           // [K]
  float* ws = z + K;                // [C]
  const BlockWork b = block_work(p);
  const int warp = threadIdx.x / 32;
  const bool add_norm = p.normalize && b.tile == 0;
  float* partial = p.partial + int64_t(b.tile) * p.rows * p.H * K;

  for (int idx = threadIdx.x; idx < K * kTS; idx += kThreads) S[idx] = 0.0f;
  for (int idx = threadIdx.x; idx < K; idx += kThreads) z[idx] = 0.0f;

  for (int64_t t0 = 0; t0 < b.length; t0 += kChunk) {
    const int L = int(b.length - t0 < kChunk ? b.length - t0 : kChunk);
    const int64_t token0 = b.start + t0;
    __syncthreads();
    load_features<K>(p.k, token0, p.H, b.h, L, Kp);
    load_tile(p.v, nullptr, 1.0f, token0, p.H, b.h, p.V, b.v0, L, Vs);
    load_tile(p.d_o, p.normalize ? p.den : nullptr, p.scale, token0, p.H, b.h, p.V, b.v0, L, Es);
    for (int i = threadIdx.x; i < kChunk; i += kThreads)
      ws[i] = add_norm && i < L ? p.w[(token0 + i) * p.H + b.h] : 0.0f;
    __syncthreads();
    lower_scores(Es, Vs, kTS, kTile, A, 0, kWarps);  // scale E V^T
    __syncthreads();
    for (int idx = threadIdx.x; idx < kChunk * kChunk; idx += kThreads) {
      const int i = idx / kChunk, j = idx % kChunk;
      A[i * kSS + j] = j <= i ? A[i * kSS + j] + ws[i] : 0.0f;
    }
    __syncthreads();

    // dQp = A Kp + scale E S^T (+ w z_prev below)
    FragC acc[kPerWarp];
#pragma unroll
    for (int r = 0; r < kPerWarp; ++r) {
      const int t = warp + kWarps * r;
      wmma::fill_fragment(acc[r], 0.0f);
      if (t >= kOutTiles) continue;
      const int ti = t / (K / 16), tc = t % (K / 16);
      product<FragA, FragB>(acc[r], A + ti * 16 * kSS, kSS, 1, Kp + tc * 16, kFS<K>, kFS<K>, 0,
                            (ti + 1) * 16);
      product<FragA, FragBT>(acc[r], Es + ti * 16 * kTS, kTS, 1, S + tc * 16 * kTS, kTS, 1, 0,
                             kTile);
    }
    __syncthreads();  // A, Es and S read
    add_outer<K>(Kp, Vs, S);
    __syncthreads();  // Vs read: the staging may overwrite A, Es, Vs
#pragma unroll
    for (int r = 0; r < kPerWarp; ++r) {
      const int t = warp + kWarps * r;
      if (t >= kOutTiles) continue;
      const int ti = t / (K / 16), tc = t % (K / 16);
      wmma::store_matrix_sync(staged + ti * 16 * kFS<K> + tc * 16, acc[r], kFS<K>,
                              wmma::mem_row_major);
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < L * K; idx += kThreads) {
      const int i = idx / K, c = idx % K;
      float d = staged[i * kFS<K> + c];
      if (add_norm) d = fmaf(ws[i], z[c], d);
      partial[((token0 + i) * p.H + b.h) * K + c] = d;
    }
    if (add_norm) {
      __syncthreads();  // z read above
      add_column_sums<K>(Kp, nullptr, z);
    }
  }
}

// The backward walk: partial[tile, row, c] = dKp of this tile (tile 0 with the normaliser's
// terms) and the tile's columns of dv. 113 KB of shared memory at K = 128, so that two blocks
// share an SM (a layout with separate P, A and V buffers took 140 KB: one block an SM, and the
// recall shape's 256 blocks in two waves: the backward took 1.28-1.39x as long, session 28). One
// score buffer serves P, then A, then the dV staging; V is loaded into Kp's space once P and
// Kp G are done (one more round trip a chunk), and that space holds the dK staging last.
template <int K>
constexpr size_t dkdv_smem_floats() {  // Qp, Kp (then V, then dK), X (P, A, dV), E, G, Gz, w
  return 2 * kChunk * kFS<K> + kChunk * kSS + kChunk * kTS + K * kTS + K + kChunk;
}

template <int K>
__global__ void __launch_bounds__(kThreads, 2) dkdv_kernel(Params p) {
  constexpr int kOutTiles = 4 * (K / 16), kPerWarp = (kOutTiles + kWarps - 1) / kWarps;
  static_assert(kFS<K> >= kTS, "V fits in Kp's space");
  extern __shared__ __align__(128) float smem[];
  float* Qp = smem;                  // [C, K + 4]
  float* Kp = Qp + kChunk * kFS<K>;  // [C, K + 4]
  float* Vs = Kp;                    // [C, 36] once Kp is read
  float* staged = Kp;                // [C, K + 4] once V is read
  float* X = Kp + kChunk * kFS<K>;   // [C, 68]: P, then A, then dV [C, 36]
  float* Es = X + kChunk * kSS;      // [C, 36]
  float* G = Es + kChunk * kTS;      // [K, 36]
  float* Gz = G + K * kTS;           // [K]
  float* ws = Gz + K;                // [C]
  const BlockWork b = block_work(p);
  const int warp = threadIdx.x / 32;
  const bool add_norm = p.normalize && b.tile == 0;
  float* partial = p.partial + int64_t(b.tile) * p.rows * p.H * K;

  for (int idx = threadIdx.x; idx < K * kTS; idx += kThreads) G[idx] = 0.0f;
  for (int idx = threadIdx.x; idx < K; idx += kThreads) Gz[idx] = 0.0f;
  if (b.length <= 0) return;

  const int64_t last_chunk_start = (b.length - 1) / kChunk * kChunk;
  for (int64_t t0 = last_chunk_start; t0 >= 0; t0 -= kChunk) {
    const int L = int(b.length - t0 < kChunk ? b.length - t0 : kChunk);
    const int64_t token0 = b.start + t0;
    __syncthreads();
    load_features<K>(p.q, token0, p.H, b.h, L, Qp);
    load_features<K>(p.k, token0, p.H, b.h, L, Kp);
    load_tile(p.d_o, p.normalize ? p.den : nullptr, p.scale, token0, p.H, b.h, p.V, b.v0, L, Es);
    for (int i = threadIdx.x; i < kChunk; i += kThreads)
      ws[i] = add_norm && i < L ? p.w[(token0 + i) * p.H + b.h] : 0.0f;
    __syncthreads();
    lower_scores(Qp, Kp, kFS<K>, K, X, 0, kWarps);  // P = Qp Kp^T
    __syncthreads();
    for (int idx = threadIdx.x; idx < kChunk * kChunk; idx += kThreads) {
      const int i = idx / kChunk, j = idx % kChunk;
      if (j > i) X[i * kSS + j] = 0.0f;
    }
    __syncthreads();

    // dV = scale P^T E + Kp G (one tile a warp)
    const int tj = warp / 2, tv = warp % 2;
    FragC dv;
    wmma::fill_fragment(dv, 0.0f);
    product<FragAT, FragB>(dv, X + tj * 16, kSS, kSS, Es + tv * 16, kTS, kTS, tj * 16, kChunk);
    product<FragA, FragB>(dv, Kp + tj * 16 * kFS<K>, kFS<K>, 1, G + tv * 16, kTS, kTS, 0, K);
    __syncthreads();  // P and Kp read
    load_tile(p.v, nullptr, 1.0f, token0, p.H, b.h, p.V, b.v0, L, Vs);
    __syncthreads();
    lower_scores(Es, Vs, kTS, kTile, X, 0, kWarps);  // A = scale E V^T
    __syncthreads();
    for (int idx = threadIdx.x; idx < kChunk * kChunk; idx += kThreads) {
      const int i = idx / kChunk, j = idx % kChunk;
      X[i * kSS + j] = j <= i ? X[i * kSS + j] + ws[i] : 0.0f;
    }
    __syncthreads();

    // dKp = A^T Qp + V G^T (+ Gz below)
    FragC dk[kPerWarp];
#pragma unroll
    for (int r = 0; r < kPerWarp; ++r) {
      const int t = warp + kWarps * r;
      wmma::fill_fragment(dk[r], 0.0f);
      if (t >= kOutTiles) continue;
      const int rj = t / (K / 16), tc = t % (K / 16);
      product<FragAT, FragB>(dk[r], X + rj * 16, kSS, kSS, Qp + tc * 16, kFS<K>, kFS<K>, rj * 16,
                             kChunk);
      product<FragA, FragBT>(dk[r], Vs + rj * 16 * kTS, kTS, 1, G + tc * 16 * kTS, kTS, 1, 0,
                             kTile);
    }
    __syncthreads();  // A, V and G read
#pragma unroll
    for (int r = 0; r < kPerWarp; ++r) {
      const int t = warp + kWarps * r;
      if (t >= kOutTiles) continue;
      const int rj = t / (K / 16), tc = t % (K / 16);
      wmma::store_matrix_sync(staged + rj * 16 * kFS<K> + tc * 16, dk[r], kFS<K>,
                              wmma::mem_row_major);
    }
    wmma::store_matrix_sync(X + tj * 16 * kTS + tv * 16, dv, kTS, wmma::mem_row_major);
    __syncthreads();
    for (int idx = threadIdx.x; idx < L * K; idx += kThreads) {
      const int j = idx / K, c = idx % K;
      float d = staged[j * kFS<K> + c];
      if (add_norm) d += Gz[c];
      partial[((token0 + j) * p.H + b.h) * K + c] = d;
    }
    for (int idx = threadIdx.x; idx < L * kTile; idx += kThreads) {
      const int j = idx / kTile, v = idx % kTile;
      p.dv[((token0 + j) * p.H + b.h) * p.V + b.v0 + v] = X[j * kTS + v];
    }
    add_outer<K>(Qp, Es, G);  // G += scale Qp^T E (E carries the scale)
    if (add_norm) {
      __syncthreads();  // Gz read above
      add_column_sums<K>(Qp, ws, Gz);
    }
  }
}

// w[r] = -scale (o_r . d_o_r) / den_r for every (token, head) row r: a warp per row, lanes over
// V in a fixed order and a fixed shuffle tree (deterministic).
__global__ void normaliser_weight_kernel(const float* o, const float* d_o, const float* den,
                                         int64_t rows, int V, float scale, float* w) {
  const int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  float acc = 0.0f;
  for (int c = lane; c < V; c += 32) acc = fmaf(o[r * V + c], d_o[r * V + c], acc);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  if (lane == 0) w[r] = -scale * acc / den[r];
}

// out[r, c] = phi'(x[r, c]) * sum over tiles (in order) of partial[tile, r, c].
__global__ void reduce_tiles_kernel(const float* partial, int tiles, const float* x, int64_t n,
                                    float* out) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    float sum = partial[i];
    for (int t = 1; t < tiles; ++t) sum += partial[t * n + i];
    out[i] = feature_slope(x[i]) * sum;
  }
}

// ---- host side ----

struct Plan {
  int64_t N = 0, rows = 0, tiles = 1;
  size_t table_bytes = 0, partial_bytes = 0, o_bytes = 0, row_bytes = 0;
  size_t forward_bytes() const { return table_bytes; }
  // normalised: w (and, unless kept from the forward, o and den before it)
  size_t backward_bytes(bool normalize, bool kept) const {
    if (!normalize) return table_bytes + partial_bytes;
    return table_bytes + partial_bytes + (kept ? 0 : o_bytes + row_bytes) + row_bytes;
  }
};

Plan make_plan(const LinearAttnShape& s, const SequenceLayout& layout) {
  Plan plan;
  plan.N = layout.num_sequences();
  plan.rows = s.B * s.T;
  plan.tiles = s.V / kTile;
  plan.table_bytes = align_up(size_t(plan.N + 1) * sizeof(int64_t));
  plan.partial_bytes = align_up(size_t(plan.tiles * plan.rows * s.H * s.K) * sizeof(float));
  plan.o_bytes = align_up(size_t(plan.rows * s.H * s.V) * sizeof(float));
  plan.row_bytes = align_up(size_t(plan.rows * s.H) * sizeof(float));
  return plan;
}

bool supported_width(int64_t x) {
  return x == 32 || x == 64 || x == 128;
}

// Validates the call; returns the sequence layout.
SequenceLayout validate(const LinearAttnDeviceArgs& a, const char* what) {
  const LinearAttnShape& s = a.shape;
  s.validate();
  const std::string name = std::string("linear_attn (cuda ") + what + ")";
  require(supported_width(s.K) && supported_width(s.V),
          name + ": K and V must be 32, 64 or 128, got K = " + std::to_string(s.K) +
              ", V = " + std::to_string(s.V));
  require(a.q && a.k && a.v, name + ": q, k and v are required");
  SequenceLayout layout(s.B, s.T, a.cu_seqlens);
  require(layout.num_sequences() * s.H * (s.V / kTile) < (int64_t(1) << 31),
          name + ": too many sequences and heads for one grid");
  return layout;
}

// Packed sequences: uploads the N + 1 sequence starts into the workspace's first bytes. A copy
// from pageable memory waits for the stream, so B sequences of T tokens (the training batches of
// fixed-length examples) take none: the walks compute their starts (null table).
const int64_t* upload_offsets(const LinearAttnDeviceArgs& args, const SequenceLayout& layout,
                              void* workspace, cudaStream_t stream) {
  if (args.cu_seqlens.empty()) return nullptr;
  const int64_t N = layout.num_sequences();
  std::vector<int64_t> offsets(size_t(N + 1));
  for (int64_t n = 0; n < N; ++n) offsets[size_t(n)] = layout.start(n);
  offsets[size_t(N)] = args.shape.B * args.shape.T;
  check_cuda(cudaMemcpyAsync(workspace, offsets.data(), offsets.size() * sizeof(int64_t),
                             cudaMemcpyHostToDevice, stream),
             "linear_attn (cuda): copy of the sequence table");
  return static_cast<const int64_t*>(workspace);
}

void require_workspace(const void* workspace, size_t have, size_t need, const char* what) {
  require(workspace && have >= need, std::string("linear_attn (cuda ") + what +
                                         "): workspace too small (" + std::to_string(have) + " < " +
                                         std::to_string(need) + " bytes)");
}

template <class KernelFn>
void launch_walk(KernelFn kernel, size_t smem_floats, const Params& p, int64_t blocks,
                 cudaStream_t stream, const char* what) {
  const size_t smem = smem_floats * sizeof(float);
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
             what);
  // all of L1 as shared memory: two forward blocks of 111 KB an SM
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                  cudaSharedmemCarveoutMaxShared),
             what);
  kernel<<<unsigned(blocks), kThreads, smem, stream>>>(p);
  check_launch(what);
}

template <int K>
void launch_forward(const Params& p, int64_t blocks, cudaStream_t stream) {
  launch_walk(forward_kernel<K>, forward_smem_floats<K>(), p, blocks, stream,
              "linear_attn forward kernel");
}
template <int K>
void launch_dq(const Params& p, int64_t blocks, cudaStream_t stream) {
  launch_walk(dq_kernel<K>, dq_smem_floats<K>(), p, blocks, stream, "linear_attn dq kernel");
}
template <int K>
void launch_dkdv(const Params& p, int64_t blocks, cudaStream_t stream) {
  launch_walk(dkdv_kernel<K>, dkdv_smem_floats<K>(), p, blocks, stream, "linear_attn dk dv kernel");
}

// Calls fn.template operator()<K>() for the runtime K (32, 64 or 128; validated before).
template <class Fn>
void dispatch_k(int64_t K, Fn&& fn) {
  if (K == 32)
    fn.template operator()<32>();
  else if (K == 64)
    fn.template operator()<64>();
  else
    fn.template operator()<128>();
}

void run_forward(const Params& p, int64_t K, int64_t blocks, cudaStream_t stream) {
  dispatch_k(K, [&]<int KK>() { launch_forward<KK>(p, blocks, stream); });
}

void reduce_tiles(const float* partial, int tiles, const float* x, int64_t n, float* out,
                  cudaStream_t stream) {
  const int threads = 256;
  const unsigned grid = unsigned(std::clamp<int64_t>((n + threads - 1) / threads, 1, 1 << 20));
  reduce_tiles_kernel<<<grid, threads, 0, stream>>>(partial, tiles, x, n, out);
  check_launch("linear_attn tile reduce kernel");
}

Params base_params(const LinearAttnDeviceArgs& a, const Plan& plan, const int64_t* offsets) {
  Params p;
  p.q = a.q;
  p.k = a.k;
  p.v = a.v;
  p.offsets = offsets;
  p.seq_tokens = a.shape.T;
  p.rows = plan.rows;
  p.H = int(a.shape.H);
  p.V = int(a.shape.V);
  p.tiles = int(plan.tiles);
  p.scale = float(a.shape.effective_scale());
  p.normalize = a.shape.normalize;
  return p;
}

}  // namespace

size_t linear_attn_workspace_bytes(const LinearAttnShape& shape,
                                   std::span<const int64_t> cu_seqlens, bool kept_forward) {
  shape.validate();
  const SequenceLayout layout(shape.B, shape.T, cu_seqlens);
  return make_plan(shape, layout).backward_bytes(shape.normalize, kept_forward);
}

void linear_attn_forward(const LinearAttnDeviceArgs& args, float* o, void* workspace,
                         size_t workspace_bytes, cudaStream_t stream, float* den) {
  const SequenceLayout layout = validate(args, "forward");
  require(o != nullptr, "linear_attn (cuda forward): o is required");
  require(!den || args.shape.normalize,
          "linear_attn (cuda forward): den is the normalised form's (this call is plain)");
  const Plan plan = make_plan(args.shape, layout);
  require_workspace(workspace, workspace_bytes, plan.forward_bytes(), "forward");
  Params p = base_params(args, plan, nullptr);
  p.offsets = upload_offsets(args, layout, workspace, stream);
  p.o = o;
  p.den_out = den;
  run_forward(p, args.shape.K, plan.N * args.shape.H * plan.tiles, stream);
}

void linear_attn_backward(const LinearAttnDeviceArgs& args, const float* d_o, float* dq, float* dk,
                          float* dv, void* workspace, size_t workspace_bytes, cudaStream_t stream,
                          LinearAttnKeptForward kept) {
  const SequenceLayout layout = validate(args, "backward");
  require(d_o != nullptr, "linear_attn (cuda backward): d_o is required");
  require(dq && dk && dv, "linear_attn (cuda backward): dq, dk and dv are required");
  const LinearAttnShape& s = args.shape;
  const bool have_kept = kept.o || kept.den;
  require(!have_kept || (kept.o && kept.den && s.normalize),
          "linear_attn (cuda backward): a kept forward is o and den of the normalised form");
  const Plan plan = make_plan(s, layout);
  require_workspace(workspace, workspace_bytes, plan.backward_bytes(s.normalize, have_kept),
                    "backward");

  char* base = static_cast<char*>(workspace);
  const int64_t* offsets = upload_offsets(args, layout, workspace, stream);
  float* partial = reinterpret_cast<float*>(base + plan.table_bytes);
  const int64_t blocks = plan.N * s.H * plan.tiles;
  Params p = base_params(args, plan, offsets);
  p.d_o = d_o;
  p.partial = partial;
  p.dv = dv;

  if (s.normalize) {  // o and den (kept or recomputed), then w = -scale (o . d_o) / den
    // [o, den,] w after the partial rows
    char* next = base + plan.table_bytes + plan.partial_bytes;
    float* o = have_kept ? nullptr : reinterpret_cast<float*>(next);
    float* den = have_kept ? nullptr : reinterpret_cast<float*>(next + plan.o_bytes);
    float* w = reinterpret_cast<float*>(next + (have_kept ? 0 : plan.o_bytes + plan.row_bytes));
    if (!have_kept) {
      Params f = p;
      f.o = o;
      f.den_out = den;
      run_forward(f, s.K, blocks, stream);
    }
    const float* o_used = have_kept ? kept.o : o;
    const float* den_used = have_kept ? kept.den : den;
    const int64_t head_rows = plan.rows * s.H;
    const int threads = 256;
    normaliser_weight_kernel<<<unsigned((head_rows * 32 + threads - 1) / threads), threads, 0,
                               stream>>>(o_used, d_o, den_used, head_rows, int(s.V), p.scale, w);
    check_launch("linear_attn normaliser weight kernel");
    p.den = den_used;
    p.w = w;
  }

  const int64_t qk_elements = plan.rows * s.H * s.K;
  dispatch_k(s.K, [&]<int KK>() { launch_dq<KK>(p, blocks, stream); });
  reduce_tiles(partial, p.tiles, args.q, qk_elements, dq, stream);
  dispatch_k(s.K, [&]<int KK>() { launch_dkdv<KK>(p, blocks, stream); });
  reduce_tiles(partial, p.tiles, args.k, qk_elements, dk, stream);
}

}  // namespace kda::ops::cuda
