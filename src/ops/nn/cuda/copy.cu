// Data movement: strided row copies with a cast, f32 <-> bf16 conversion, embedding lookups and
// the deterministic uniform fill of synthetic weights.
#include <type_traits>

#include "ops/nn/cuda/nn_common.cuh"

namespace kda::ops::cuda {
namespace {

using namespace nn_detail;

template <class T>
using Elem = std::remove_pointer_t<T>;

template <class InT, class OutT>
struct CopyOp {
  const InT* x;
  int64_t x_stride;
  OutT* y;
  int64_t y_stride;
  template <int V>
  __device__ void apply(int64_t r, int64_t c) const {
    store_vec<V>(y + r * y_stride + c, load_vec<V>(x + r * x_stride + c));
  }
};

template <class TableT>
struct EmbeddingOp {
  const int32_t* ids;
  const TableT* table;
  const TableT* positions;  // may be null
  int64_t position0, D;
  float* out;
  template <int V>
  __device__ void apply(int64_t t, int64_t c) const {
    Vec<V> a = load_vec<V>(table + int64_t(ids[t]) * D + c);
    if (positions) {
      const Vec<V> p = load_vec<V>(positions + (position0 + t) * D + c);
#pragma unroll
      for (int k = 0; k < V; ++k) a.v[k] += p.v[k];
    }
    store_vec<V>(out + t * D + c, a);
  }
};

// The i-th output of a splitmix64 generator started at `seed`: a counter hash, so any element
// can be computed on its own.
__device__ __forceinline__ uint64_t splitmix64_at(uint64_t seed, uint64_t i) {
  uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

template <class OutT>
struct FillUniformOp {
  OutT* x;
  float scale;
  uint64_t seed;
  template <int V>
  __device__ void apply(int64_t, int64_t c) const {
    Vec<V> o;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      // The top 24 bits: u in [0, 1) exactly representable, then [-1, 1).
      const float u = float(splitmix64_at(seed, uint64_t(c + k)) >> 40) * (1.0f / 16777216.0f);
      o.v[k] = scale * (2.0f * u - 1.0f);
    }
    store_vec<V>(x + c, o);
  }
};

}  // namespace

void copy_rows(const float* x, int64_t rows, int64_t cols, int64_t x_stride, OutRows y,
               cudaStream_t stream) {
  require(rows >= 0 && cols >= 1, "cuda::copy_rows: sizes must be positive");
  const int64_t xs = x_stride > 0 ? x_stride : cols;
  require(xs >= cols, "cuda::copy_rows: x_stride smaller than cols");
  check_out(y, cols, "cuda::copy_rows");
  if (rows == 0) return;
  require(x && y.data, "cuda::copy_rows: null pointer");
  const int64_t ys = out_stride(y, cols);
  const bool vec4 = cols % 4 == 0 && xs % 4 == 0 && ys % 4 == 0 && aligned_for(x, 4, 4) &&
                    aligned_for(y.data, 4, element_bytes(y.type));
  dispatch_type(y.type, [&](auto* tag) {
    using OutT = Elem<decltype(tag)>;
    map_rows(rows, cols, vec4, CopyOp<float, OutT>{x, xs, static_cast<OutT*>(y.data), ys}, stream,
             "cuda::copy_rows");
  });
}

void convert(const void* x, ElementType from, void* y, ElementType to, int64_t n,
             cudaStream_t stream) {
  require(n >= 0, "cuda::convert: negative size");
  if (n == 0) return;
  require(x && y, "cuda::convert: null pointer");
  if (from == to) {
    check_cuda(
        cudaMemcpyAsync(y, x, size_t(n) * element_bytes(from), cudaMemcpyDeviceToDevice, stream),
        "cuda::convert (copy)");
    return;
  }
  const bool vec4 =
      n % 4 == 0 && aligned_for(x, 4, element_bytes(from)) && aligned_for(y, 4, element_bytes(to));
  dispatch_type(from, [&](auto* in_tag) {
    using InT = Elem<decltype(in_tag)>;
    dispatch_type(to, [&](auto* out_tag) {
      using OutT = Elem<decltype(out_tag)>;
      map_rows(1, n, vec4,
               CopyOp<InT, OutT>{static_cast<const InT*>(x), n, static_cast<OutT*>(y), n}, stream,
               "cuda::convert");
    });
  });
}

void embedding(const int32_t* ids, int64_t T, const void* table, const void* positions,
               int64_t position0, ElementType table_type, int64_t D, float* out,
               cudaStream_t stream) {
  require(T >= 0 && D >= 1, "cuda::embedding: sizes must be positive");
  require(position0 >= 0, "cuda::embedding: negative position0");
  if (T == 0) return;
  require(ids && table && out, "cuda::embedding: null pointer");
  const size_t tb = element_bytes(table_type);
  const bool vec4 = D % 4 == 0 && aligned_for(table, 4, tb) &&
                    (!positions || aligned_for(positions, 4, tb)) && aligned_for(out, 4, 4);
  dispatch_type(table_type, [&](auto* tag) {
    using TableT = Elem<decltype(tag)>;
    map_rows(T, D, vec4,
             EmbeddingOp<TableT>{ids, static_cast<const TableT*>(table),
                                 static_cast<const TableT*>(positions), position0, D, out},
             stream, "cuda::embedding");
  });
}

void fill_uniform(void* x, ElementType type, int64_t n, float scale, uint64_t seed,
                  cudaStream_t stream) {
  require(n >= 0, "cuda::fill_uniform: negative size");
  if (n == 0) return;
  require(x != nullptr, "cuda::fill_uniform: null pointer");
  const bool vec4 = n % 4 == 0 && aligned_for(x, 4, element_bytes(type));
  dispatch_type(type, [&](auto* tag) {
    using OutT = Elem<decltype(tag)>;
    map_rows(1, n, vec4, FillUniformOp<OutT>{static_cast<OutT*>(x), scale, seed}, stream,
             "cuda::fill_uniform");
  });
}

}  // namespace kda::ops::cuda
