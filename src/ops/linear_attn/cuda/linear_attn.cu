// Linear attention forward and backward on the GPU (linear_attn_cuda.h). fp32 throughout.
//
// Every walking kernel runs one block of 256 threads per (sequence, head, 32-column tile of V)
// over chunks of C = 64 tokens. A chunk's rows live in shared memory: phi(Q), phi(K) [C, K + 1],
// the tile's V (and the output cotangent E) [C, 33], C x C score matrices [C, 65] (the odd
// strides keep the column reads of a warp in distinct banks) and the tile's state slice
// [K, 33]. Rows past the end of the sequence are zeros, so they add nothing to any sum.
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
// tiles in order and multiplies by the feature map's slope.
#include <algorithm>
#include <string>
#include <vector>

#include "core/error.h"
#include "ops/common/device_buffer.h"
#include "ops/common/sequences.h"
#include "ops/linear_attn/cuda/linear_attn_cuda.h"

namespace kda::ops::cuda {
namespace {

constexpr int kChunk = 64;                // C: tokens per chunk
constexpr int kTile = 32;                 // V columns per block
constexpr int kThreads = 256;             // 8 warps
constexpr int kWarps = kThreads / 32;     // rows handled in parallel
constexpr int kTileStride = kTile + 1;    // [C, 33] and [K, 33] arrays
constexpr int kScoreStride = kChunk + 1;  // [C, 65] arrays
constexpr size_t kAlign = 256;            // workspace regions

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
  const int64_t* offsets = nullptr;  // N + 1 sequence starts (token rows), last = B T
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
  b.start = p.offsets[n];
  b.length = p.offsets[n + 1] - b.start;
  b.v0 = b.tile * kTile;
  return b;
}

// dst[i, c] = phi(src row i) for i < L, zero rows after; dst stride K + 1.
template <int K>
__device__ void load_features(const float* src, int64_t token0, int H, int h, int L, float* dst) {
  for (int idx = threadIdx.x; idx < kChunk * K; idx += kThreads) {
    const int i = idx / K, c = idx % K;
    dst[i * (K + 1) + c] = i < L ? feature_map(src[((token0 + i) * H + h) * K + c]) : 0.0f;
  }
}

// dst[i, v] = src[row i, v0 + v] (times 1 / den[row i] when den is given) for i < L, zero
// rows after; dst stride 33.
__device__ void load_tile(const float* src, const float* den, int64_t token0, int H, int h, int V,
                          int v0, int L, float* dst) {
  for (int idx = threadIdx.x; idx < kChunk * kTile; idx += kThreads) {
    const int i = idx / kTile, v = idx % kTile;
    float x = 0.0f;
    if (i < L) {
      const int64_t row = (token0 + i) * H + h;
      x = src[row * V + v0 + v];
      if (den) x /= den[row];
    }
    dst[i * kTileStride + v] = x;
  }
}

// scores[i, j] = (j <= i) ? scale a_i . b_j + w_i : 0 (w null: 0) for rows of width W (stride
// W + 1): each thread holds an 8 x 2 block (rows warp + 8 a, columns lane + 32 b), so a warp
// reads one a row (broadcast) and 32 b rows (distinct banks thanks to the odd stride).
template <int W>
__device__ void causal_scores(const float* a, const float* b, float scale, const float* w,
                              float* scores) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float acc[kChunk / kWarps][2] = {};
  for (int c = 0; c < W; ++c) {
    float bv[2];
#pragma unroll
    for (int jb = 0; jb < 2; ++jb) bv[jb] = b[(lane + 32 * jb) * (W + 1) + c];
#pragma unroll
    for (int ia = 0; ia < kChunk / kWarps; ++ia) {
      const float av = a[(warp + kWarps * ia) * (W + 1) + c];
#pragma unroll
      for (int jb = 0; jb < 2; ++jb) acc[ia][jb] = fmaf(av, bv[jb], acc[ia][jb]);
    }
  }
#pragma unroll
  for (int ia = 0; ia < kChunk / kWarps; ++ia) {
    const int i = warp + kWarps * ia;
#pragma unroll
    for (int jb = 0; jb < 2; ++jb) {
      const int j = lane + 32 * jb;
      scores[i * kScoreStride + j] = j <= i ? scale * acc[ia][jb] + (w ? w[i] : 0.0f) : 0.0f;
    }
  }
}

// state[c, v] += scale * sum_{i < L} x[i, c] y[i, v] (x stride K + 1, y and state stride 33).
template <int K>
__device__ void add_outer(const float* x, const float* y, int L, float scale, float* state) {
  const int v = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int r = 0; r < K / kWarps; ++r) {
    const int c = warp + kWarps * r;
    float acc = 0.0f;
    for (int i = 0; i < L; ++i) acc = fmaf(x[i * (K + 1) + c], y[i * kTileStride + v], acc);
    state[c * kTileStride + v] += scale * acc;
  }
}

// sum[c] += sum_{i < L} weight_i x[i, c] (weight null: 1).
template <int K>
__device__ void add_column_sums(const float* x, const float* weight, int L, float* sum) {
  for (int c = threadIdx.x; c < K; c += kThreads) {
    float acc = 0.0f;
    for (int i = 0; i < L; ++i) acc = fmaf(weight ? weight[i] : 1.0f, x[i * (K + 1) + c], acc);
    sum[c] += acc;
  }
}

template <int K>
constexpr size_t forward_smem_floats() {
  return 2 * kChunk * (K + 1) + kChunk * kTileStride + kChunk * kScoreStride + K * kTileStride + K +
         kChunk;
}

template <int K>
__global__ void __launch_bounds__(kThreads) forward_kernel(Params p) {
  extern __shared__ float smem[];
  float* Qp = smem;                      // [C, K + 1]
  float* Kp = Qp + kChunk * (K + 1);     // [C, K + 1]
  float* Vs = Kp + kChunk * (K + 1);     // [C, 33]
  float* P = Vs + kChunk * kTileStride;  // [C, 65]
  float* S = P + kChunk * kScoreStride;  // [K, 33]
  float* z = S + K * kTileStride;        // [K]
  float* inv_den = z + K;                // [C]
  const BlockWork b = block_work(p);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

  for (int idx = threadIdx.x; idx < K * kTileStride; idx += kThreads) S[idx] = 0.0f;
  for (int idx = threadIdx.x; idx < K; idx += kThreads) z[idx] = 0.0f;

  for (int64_t t0 = 0; t0 < b.length; t0 += kChunk) {
    const int L = int(b.length - t0 < kChunk ? b.length - t0 : kChunk);
    const int64_t token0 = b.start + t0;
    __syncthreads();  // the previous chunk's state update is done with the rows
    load_features<K>(p.q, token0, p.H, b.h, L, Qp);
    load_features<K>(p.k, token0, p.H, b.h, L, Kp);
    load_tile(p.v, nullptr, token0, p.H, b.h, p.V, b.v0, L, Vs);
    __syncthreads();
    causal_scores<K>(Qp, Kp, 1.0f, nullptr, P);
    __syncthreads();

    if (p.normalize) {  // den_i = scale (intra + carried) + 1e-10, as the CPU forward
      for (int i = threadIdx.x; i < L; i += kThreads) {
        float intra = 0.0f, carried = 0.0f;
        for (int j = 0; j <= i; ++j) intra += P[i * kScoreStride + j];
        for (int c = 0; c < K; ++c) carried = fmaf(Qp[i * (K + 1) + c], z[c], carried);
        const float den = p.scale * (intra + carried) + 1e-10f;
        inv_den[i] = 1.0f / den;
        if (p.den_out && b.tile == 0) p.den_out[(token0 + i) * p.H + b.h] = den;
      }
      __syncthreads();
    }

    // O[i, v] = scale (sum_{j <= i} P[i, j] V[j, v] + sum_c Qp[i, c] S[c, v]) (/ den_i)
    for (int i = warp; i < L; i += kWarps) {
      float intra = 0.0f, carried = 0.0f;
      for (int j = 0; j <= i; ++j)
        intra = fmaf(P[i * kScoreStride + j], Vs[j * kTileStride + lane], intra);
      for (int c = 0; c < K; ++c)
        carried = fmaf(Qp[i * (K + 1) + c], S[c * kTileStride + lane], carried);
      float out = p.scale * (intra + carried);
      if (p.normalize) out *= inv_den[i];
      p.o[((token0 + i) * p.H + b.h) * p.V + b.v0 + lane] = out;
    }
    __syncthreads();  // S and z are read above

    add_outer<K>(Kp, Vs, L, 1.0f, S);
    if (p.normalize) add_column_sums<K>(Kp, nullptr, L, z);
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

template <int K>
constexpr size_t dq_smem_floats() {
  return kChunk * (K + 1) + 2 * kChunk * kTileStride + kChunk * kScoreStride + K * kTileStride + K +
         kChunk;
}

// The forward walk: partial[tile, row, c] = dQp of this tile (tile 0 with the normaliser's term).
template <int K>
__global__ void __launch_bounds__(kThreads) dq_kernel(Params p) {
  extern __shared__ float smem[];
  float* Kp = smem;                       // [C, K + 1]
  float* Vs = Kp + kChunk * (K + 1);      // [C, 33]
  float* Es = Vs + kChunk * kTileStride;  // [C, 33]
  float* A = Es + kChunk * kTileStride;   // [C, 65]
  float* S = A + kChunk * kScoreStride;   // [K, 33]
  float* z = S + K * kTileStride;         // [K]
  float* ws = z + K;                      // [C]
  const BlockWork b = block_work(p);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const bool add_norm = p.normalize && b.tile == 0;
  float* partial = p.partial + int64_t(b.tile) * p.rows * p.H * K;

  for (int idx = threadIdx.x; idx < K * kTileStride; idx += kThreads) S[idx] = 0.0f;
  for (int idx = threadIdx.x; idx < K; idx += kThreads) z[idx] = 0.0f;

  for (int64_t t0 = 0; t0 < b.length; t0 += kChunk) {
    const int L = int(b.length - t0 < kChunk ? b.length - t0 : kChunk);
    const int64_t token0 = b.start + t0;
    __syncthreads();
    load_features<K>(p.k, token0, p.H, b.h, L, Kp);
    load_tile(p.v, nullptr, token0, p.H, b.h, p.V, b.v0, L, Vs);
    load_tile(p.d_o, p.normalize ? p.den : nullptr, token0, p.H, b.h, p.V, b.v0, L, Es);
    for (int i = threadIdx.x; i < kChunk; i += kThreads)
      ws[i] = add_norm && i < L ? p.w[(token0 + i) * p.H + b.h] : 0.0f;
    __syncthreads();
    causal_scores<kTile>(Es, Vs, p.scale, add_norm ? ws : nullptr, A);  // A
    __syncthreads();

    // dQp[i, c] = sum_{j <= i} A[i, j] Kp[j, c] + scale sum_v E[i, v] S[c, v] + w_i z[c]
    for (int i = warp; i < L; i += kWarps) {
      float acc[K / 32] = {}, carried[K / 32] = {};
      for (int j = 0; j <= i; ++j) {
        const float a = A[i * kScoreStride + j];
#pragma unroll
        for (int cb = 0; cb < K / 32; ++cb)
          acc[cb] = fmaf(a, Kp[j * (K + 1) + lane + 32 * cb], acc[cb]);
      }
      for (int v = 0; v < kTile; ++v) {
        const float e = Es[i * kTileStride + v];
#pragma unroll
        for (int cb = 0; cb < K / 32; ++cb)
          carried[cb] = fmaf(e, S[(lane + 32 * cb) * kTileStride + v], carried[cb]);
      }
      float* out = partial + ((token0 + i) * p.H + b.h) * K;
#pragma unroll
      for (int cb = 0; cb < K / 32; ++cb) {
        const int c = lane + 32 * cb;
        float d = acc[cb] + p.scale * carried[cb];
        if (add_norm) d = fmaf(ws[i], z[c], d);
        out[c] = d;
      }
    }
    __syncthreads();

    add_outer<K>(Kp, Vs, L, 1.0f, S);
    if (add_norm) add_column_sums<K>(Kp, nullptr, L, z);
  }
}

template <int K>
constexpr size_t dkdv_smem_floats() {
  return 2 * kChunk * (K + 1) + 2 * kChunk * kTileStride + 2 * kChunk * kScoreStride +
         K * kTileStride + K + kChunk;
}

// The backward walk: partial[tile, row, c] = dKp of this tile (tile 0 with the normaliser's
// terms) and the tile's columns of dv.
template <int K>
__global__ void __launch_bounds__(kThreads) dkdv_kernel(Params p) {
  extern __shared__ float smem[];
  float* Qp = smem;                       // [C, K + 1]
  float* Kp = Qp + kChunk * (K + 1);      // [C, K + 1]
  float* Vs = Kp + kChunk * (K + 1);      // [C, 33]
  float* Es = Vs + kChunk * kTileStride;  // [C, 33]
  float* A = Es + kChunk * kTileStride;   // [C, 65]
  float* P = A + kChunk * kScoreStride;   // [C, 65]
  float* G = P + kChunk * kScoreStride;   // [K, 33]
  float* Gz = G + K * kTileStride;        // [K]
  float* ws = Gz + K;                     // [C]
  const BlockWork b = block_work(p);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const bool add_norm = p.normalize && b.tile == 0;
  float* partial = p.partial + int64_t(b.tile) * p.rows * p.H * K;

  for (int idx = threadIdx.x; idx < K * kTileStride; idx += kThreads) G[idx] = 0.0f;
  for (int idx = threadIdx.x; idx < K; idx += kThreads) Gz[idx] = 0.0f;
  if (b.length <= 0) return;

  const int64_t last_chunk_start = (b.length - 1) / kChunk * kChunk;
  for (int64_t t0 = last_chunk_start; t0 >= 0; t0 -= kChunk) {
    const int L = int(b.length - t0 < kChunk ? b.length - t0 : kChunk);
    const int64_t token0 = b.start + t0;
    __syncthreads();
    load_features<K>(p.q, token0, p.H, b.h, L, Qp);
    load_features<K>(p.k, token0, p.H, b.h, L, Kp);
    load_tile(p.v, nullptr, token0, p.H, b.h, p.V, b.v0, L, Vs);
    load_tile(p.d_o, p.normalize ? p.den : nullptr, token0, p.H, b.h, p.V, b.v0, L, Es);
    for (int i = threadIdx.x; i < kChunk; i += kThreads)
      ws[i] = add_norm && i < L ? p.w[(token0 + i) * p.H + b.h] : 0.0f;
    __syncthreads();
    causal_scores<K>(Qp, Kp, 1.0f, nullptr, P);
    causal_scores<kTile>(Es, Vs, p.scale, add_norm ? ws : nullptr, A);  // A
    __syncthreads();

    for (int j = warp; j < L; j += kWarps) {
      // dKp[j, c] = sum_{i >= j} A[i, j] Qp[i, c] + sum_v V[j, v] G[c, v] + Gz[c]
      float acc[K / 32] = {}, carried[K / 32] = {};
      for (int i = j; i < L; ++i) {
        const float a = A[i * kScoreStride + j];
#pragma unroll
        for (int cb = 0; cb < K / 32; ++cb)
          acc[cb] = fmaf(a, Qp[i * (K + 1) + lane + 32 * cb], acc[cb]);
      }
      for (int v = 0; v < kTile; ++v) {
        const float x = Vs[j * kTileStride + v];
#pragma unroll
        for (int cb = 0; cb < K / 32; ++cb)
          carried[cb] = fmaf(x, G[(lane + 32 * cb) * kTileStride + v], carried[cb]);
      }
      float* out = partial + ((token0 + j) * p.H + b.h) * K;
#pragma unroll
      for (int cb = 0; cb < K / 32; ++cb) {
        const int c = lane + 32 * cb;
        float d = acc[cb] + carried[cb];
        if (add_norm) d += Gz[c];
        out[c] = d;
      }

      // dV[j, v] = scale sum_{i >= j} P[i, j] E[i, v] + sum_c Kp[j, c] G[c, v]
      float intra = 0.0f, state = 0.0f;
      for (int i = j; i < L; ++i)
        intra = fmaf(P[i * kScoreStride + j], Es[i * kTileStride + lane], intra);
      for (int c = 0; c < K; ++c)
        state = fmaf(Kp[j * (K + 1) + c], G[c * kTileStride + lane], state);
      p.dv[((token0 + j) * p.H + b.h) * p.V + b.v0 + lane] = p.scale * intra + state;
    }
    __syncthreads();  // G and Gz are read above

    add_outer<K>(Qp, Es, L, p.scale, G);
    if (add_norm) add_column_sums<K>(Qp, ws, L, Gz);
  }
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
  size_t backward_bytes(bool normalize) const {
    return table_bytes + partial_bytes + (normalize ? o_bytes + 2 * row_bytes : 0);
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

// Uploads the N + 1 sequence starts into the workspace's first bytes.
const int64_t* upload_offsets(const SequenceLayout& layout, const LinearAttnShape& s,
                              void* workspace, cudaStream_t stream) {
  const int64_t N = layout.num_sequences();
  std::vector<int64_t> offsets(size_t(N + 1));
  for (int64_t n = 0; n < N; ++n) offsets[size_t(n)] = layout.start(n);
  offsets[size_t(N)] = s.B * s.T;
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
                                   std::span<const int64_t> cu_seqlens) {
  shape.validate();
  const SequenceLayout layout(shape.B, shape.T, cu_seqlens);
  return make_plan(shape, layout).backward_bytes(shape.normalize);
}

void linear_attn_forward(const LinearAttnDeviceArgs& args, float* o, void* workspace,
                         size_t workspace_bytes, cudaStream_t stream) {
  const SequenceLayout layout = validate(args, "forward");
  require(o != nullptr, "linear_attn (cuda forward): o is required");
  const Plan plan = make_plan(args.shape, layout);
  require_workspace(workspace, workspace_bytes, plan.forward_bytes(), "forward");
  Params p = base_params(args, plan, nullptr);
  p.offsets = upload_offsets(layout, args.shape, workspace, stream);
  p.o = o;
  run_forward(p, args.shape.K, plan.N * args.shape.H * plan.tiles, stream);
}

void linear_attn_backward(const LinearAttnDeviceArgs& args, const float* d_o, float* dq, float* dk,
                          float* dv, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const SequenceLayout layout = validate(args, "backward");
  require(d_o != nullptr, "linear_attn (cuda backward): d_o is required");
  require(dq && dk && dv, "linear_attn (cuda backward): dq, dk and dv are required");
  const LinearAttnShape& s = args.shape;
  const Plan plan = make_plan(s, layout);
  require_workspace(workspace, workspace_bytes, plan.backward_bytes(s.normalize), "backward");

  char* base = static_cast<char*>(workspace);
  const int64_t* offsets = upload_offsets(layout, s, workspace, stream);
  float* partial = reinterpret_cast<float*>(base + plan.table_bytes);
  const int64_t blocks = plan.N * s.H * plan.tiles;
  Params p = base_params(args, plan, offsets);
  p.d_o = d_o;
  p.partial = partial;
  p.dv = dv;

  if (s.normalize) {  // recompute o and den, then w = -scale (o . d_o) / den per (token, head)
    float* o = reinterpret_cast<float*>(base + plan.table_bytes + plan.partial_bytes);
    float* den = reinterpret_cast<float*>(reinterpret_cast<char*>(o) + plan.o_bytes);
    float* w = reinterpret_cast<float*>(reinterpret_cast<char*>(den) + plan.row_bytes);
    Params f = p;
    f.o = o;
    f.den_out = den;
    run_forward(f, s.K, blocks, stream);
    const int64_t head_rows = plan.rows * s.H;
    const int threads = 256;
    normaliser_weight_kernel<<<unsigned((head_rows * 32 + threads - 1) / threads), threads, 0,
                               stream>>>(o, d_o, den, head_rows, int(s.V), p.scale, w);
    check_launch("linear_attn normaliser weight kernel");
    p.den = den;
    p.w = w;
  }

  const int64_t qk_elements = plan.rows * s.H * s.K;
  dispatch_k(s.K, [&]<int KK>() { launch_dq<KK>(p, blocks, stream); });
  reduce_tiles(partial, p.tiles, args.q, qk_elements, dq, stream);
  dispatch_k(s.K, [&]<int KK>() { launch_dkdv<KK>(p, blocks, stream); });
  reduce_tiles(partial, p.tiles, args.k, qk_elements, dk, stream);
}

}  // namespace kda::ops::cuda
