// Internals of the CUDA attention op (attention_cuda.cu dispatches): the parameters every
// kernel reads and the launchers of the three kernel families.
//
// Rows: a query row is (t, h) with index t * Hq + h, the row of o [Tq, Hq, Dv] of its sequence.
// Batch: the direct kernels (prefill, plain with nsplit == 0) run sequence b (blockIdx.z, or
// attention_block_tile's seq for the tiled ones) at
// q + b * q_bstride, ... (elements, resolved: never 0); the split decode path has batch == 1.
// Split partial results (decode) live in the workspace as acc [nsplit][Tq * Hq][Dv]
// (unnormalised, relative to the row's running max), then m [nsplit][Tq * Hq] (natural-log
// units, -inf when the split held no visible key for the row) and l [nsplit][Tq * Hq] (sum of
// exp(score - m)).
// With a device key count (kv_len_device), splits at or past it are empty: their blocks only
// write m = -inf and l = 0 and leave acc unwritten; the combine kernel then never reads the acc
// of a zero-weight split.
#pragma once
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

namespace kda::ops::cuda_detail {

struct AttentionParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  float* o = nullptr;
  void* o_bf16 = nullptr;  // instead of o (direct paths only), same strides
  float* lse = nullptr;    // [Tq, Hq] natural log (direct paths only: nsplit == 0)
  int64_t q_stride = 0, k_stride = 0, v_stride = 0;  // elements between tokens
  // Elements between sequences (resolved; see AttentionArgs): q, k, v in their element type,
  // o (or o_bf16) and lse in theirs. The direct kernels run the batch in grid z, the tiled ones
  // as attention_block_tile says.
  int64_t q_bstride = 0, k_bstride = 0, v_bstride = 0, o_bstride = 0, lse_bstride = 0;
  int batch = 1;
  int64_t Tq = 0, Tk = 0, q_offset = 0;
  int Hq = 1, Hkv = 1, group = 1, Dk = 0, Dv = 0;
  float scale = 0.f;  // natural units (scores are scale * q . k)
  // Split-sequence partials (decode); unused when nsplit == 0.
  float* part_acc = nullptr;
  float* part_m = nullptr;
  float* part_l = nullptr;
  int nsplit = 0;
  int64_t split_len = 0;  // keys per split (a multiple of the decode kernel's key tile)
  // When set, the keys in use (read when the kernels run; Tk is then only the plan's bound) and
  // q_offset = that count - Tq (see AttentionArgs::Tk_device).
  const int32_t* kv_len_device = nullptr;
};

// Keys the last query sees (kv_len) and the first query's position (q_offset) for this launch.
struct KvExtent {
  int64_t kv_len, q_offset;
};

#ifdef __CUDACC__
__device__ __forceinline__ KvExtent kv_extent(const AttentionParams& p) {
  if (p.kv_len_device == nullptr) return {p.q_offset + p.Tq, p.q_offset};
  // Clamped into [Tq, Tk]: an out-of-range count must not read past the cache or leave a query
  // with no visible key.
  const int64_t n = min(max(int64_t(__ldg(p.kv_len_device)), p.Tq), p.Tk);
  return {n, n - p.Tq};
}

// A decode block whose split lies at or past the device key count: m = -inf, l = 0 for its rows
// (query rows r = t * group + head in group of KV head kvh, r in [row0, row0 + rows)); acc is
// left unwritten (see above). Needs blockDim.x >= rows.
__device__ __forceinline__ void write_empty_partial(const AttentionParams& p, int split, int kvh,
                                                    int64_t row0, int rows) {
  const int64_t rr = row0 + threadIdx.x;
  if (int(threadIdx.x) >= rows || rr >= int64_t(p.group) * p.Tq) return;
  const int64_t prow =
      int64_t(split) * p.Tq * p.Hq + (rr / p.group) * p.Hq + int64_t(kvh) * p.group + rr % p.group;
  p.part_m[prow] = -INFINITY;
  p.part_l[prow] = 0.f;
}

// Where a block of the tiled kernels (prefill, backward) sits: its tile's rank in the order the
// kernel walks tiles (0 = heaviest), its head and its sequence. attention_tile_grid puts the
// rank in the slowest part of blockIdx.x (x = rank * heads * batch + seq * heads + head), so the
// heaviest tile of every (head, sequence) launches before any lighter one: longest-processing-
// time order over the whole grid. With the rank alone in x (head in y, sequence in z:
// KDA_ATTENTION_ORDER=heads, kept for side-by-side timing) the last wave holds the heavy tiles
// of the last heads. Decoding both layouts: pairs in x is heads * batch only when y and z are 1.
struct AttentionBlockTile {
  int64_t rank;
  int head;
  int64_t seq;
};
__device__ __forceinline__ AttentionBlockTile attention_block_tile(int heads, int batch) {
  const int64_t pairs = gridDim.y * gridDim.z == 1 ? int64_t(heads) * batch : 1;
  const int64_t rest = int64_t(blockIdx.x) % pairs;
  return {int64_t(blockIdx.x) / pairs, int(rest % heads) + int(blockIdx.y),
          rest / heads + int64_t(blockIdx.z)};
}
#endif

// The grid of a tiled kernel with `tiles` tiles per (head, sequence); see AttentionBlockTile.
dim3 attention_tile_grid(int64_t tiles, int heads, int batch);

constexpr int kAttentionKeyTile = 64;      // keys per tile in the tensor-core kernels
constexpr int kAttentionBulkKeyTile = 32;  // keys per tile of the bulk-copy decode kernel
constexpr int kAttentionMaxDk = 576;       // MLA's latent + rope width
constexpr int kAttentionMaxDv = 512;       // MLA's latent width
constexpr int kAttentionMaxSplits = 256;

// Largest dynamic shared memory a block may opt into on the current device (cached).
// Whether the wgmma (sm_90a) kernels may run: on a compute capability 9 device unless
// KDA_ATTENTION_WGMMA=0 (side-by-side timing and checking of the mma.sync kernels).
bool attention_wgmma_enabled();
// Whether the tensor-core kernels take 32 query rows a warp (128-row blocks) over 16: when
// there are at least 3 blocks of 128 rows per SM (1.5 waves at the two per SM that fit); with
// fewer, the 64-row blocks' better spread wins. Measured on the H200 (forward, causal): D = 128,
// H = 32, T = 8192 (2048 blocks) 3.41 -> 2.71 ms, T = 2048 (512 blocks) 0.284 -> 0.274 ms;
// D = 64, H = 12, T = 2048 (192 blocks) 0.100 -> 0.114 ms. KDA_ATTENTION_ROWS=16 or 32 forces
// one width everywhere (side-by-side timing; checking the wide kernels on small shapes).
bool attention_wide_rows(int64_t Tq, int Hq, int batch);

// fp32-exact kernel (one warp per query row, fp32 FMA, expf): elem_bf16 picks the element type.
// nsplit == 0: writes o directly over keys [0, q_offset + t] (every sequence of the batch); else
// writes the split partials (batch == 1).
void launch_attention_generic(const AttentionParams& p, bool elem_bf16, cudaStream_t stream);

// Tensor-core flash attention for bf16 prefill (every sequence of the batch); returns false
// (launching nothing) when this shape or layout has no instantiation (the caller falls back to
// the generic kernel).
bool launch_attention_prefill(const AttentionParams& p, cudaStream_t stream);
// The wgmma (sm_90a) forward with a TMA producer warp for head dims 128 / 128
// (attention_prefill_tma.cu): launches unless KDA_ATTENTION_TMA_FORWARD=0, when
// attention_wgmma_enabled() and the layout allows, and returns whether it did.
bool launch_attention_prefill_tma(const AttentionParams& p, cudaStream_t stream);
// The wgmma building blocks alone (wgmma_probe.cu): bf16 a [64, 128], b [64, 128], p [64, 64],
// v [64, 128] (device, row-major) -> s = a b^T [64, 64] and o = p v [64, 128] (fp32). False
// (nothing launched) on a device without compute capability 9.
bool run_wgmma_probe(const void* a, const void* b, const void* p, const void* v, float* s, float* o,
                     cudaStream_t stream);
// The TMA building blocks alone (wgmma_probe.cu): a, b, v [64, 128] loaded by TMA with the
// 128-byte swizzle -> s = a b^T; o = p v with v read MN-major (LBO 8 KB, SBO 1 KB), o_swapped
// with the two swapped. False (nothing launched) without compute capability 9 or a tensor-map
// encoder.
bool run_tma_probe(const void* a, const void* b, const void* p, const void* v, float* s, float* o,
                   float* o_swapped, cudaStream_t stream);

// Tensor-core split-sequence decode (bf16): writes the split partials. Returns false (launching
// nothing) when unsupported (the caller falls back to the generic kernel with splits).
bool launch_attention_decode(const AttentionParams& p, cudaStream_t stream);

// Bulk-copy split decode (bf16, sm_90; attention_decode_bulk.cu): blocks of it one SM holds for
// these sizes (rows_per_kv_head = Hq / Hkv * Tq), 0 when it does not take them; the plan then
// uses splits of whole kAttentionBulkKeyTile tiles. The launcher returns false (launching
// nothing) for layouts it does not take (the caller falls back to launch_attention_decode).
int attention_decode_bulk_blocks_per_sm(int64_t Dk, int64_t Dv, int64_t rows_per_kv_head,
                                        bool v_alias);
bool launch_attention_decode_bulk(const AttentionParams& p, cudaStream_t stream);

// Merges the split partials into o.
void launch_attention_combine(const AttentionParams& p, cudaStream_t stream);

}  // namespace kda::ops::cuda_detail
