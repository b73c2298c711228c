// Elementwise kernels: residual add, bias, GELU (tanh), SwiGLU, sigmoid and the KDA forget gate,
// with the CPU paths' formulas (ops/nn, ops/moe/cpu, ops/kda/kda_activations.h).
#include <type_traits>

#include "ops/nn/cuda/nn_common.cuh"

namespace kda::ops::cuda {
namespace {

using namespace nn_detail;

template <class T>
using Elem = std::remove_pointer_t<T>;

struct AddOp {
  float* y;
  const float* x;
  template <int V>
  __device__ void apply(int64_t, int64_t c) const {
    Vec<V> a = load_vec<V>(y + c);
    const Vec<V> b = load_vec<V>(x + c);
#pragma unroll
    for (int k = 0; k < V; ++k) a.v[k] += b.v[k];
    store_vec<V>(y + c, a);
  }
};

struct AddBiasOp {
  float* x;
  int64_t cols;
  const float* bias;
  template <int V>
  __device__ void apply(int64_t r, int64_t c) const {
    float* p = x + r * cols + c;
    Vec<V> a = load_vec<V>(p);
    const Vec<V> b = load_vec<V>(bias + c);
#pragma unroll
    for (int k = 0; k < V; ++k) a.v[k] += b.v[k];
    store_vec<V>(p, a);
  }
};

template <class OutT>
struct GeluOp {
  const float* x;
  int64_t cols;
  OutT* y;
  int64_t y_stride;
  template <int V>
  __device__ void apply(int64_t r, int64_t c) const {
    constexpr float kC = 0.7978845608028654f;  // sqrt(2 / pi)
    Vec<V> a = load_vec<V>(x + r * cols + c);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float v = a.v[k];
      a.v[k] = 0.5f * v * (1.0f + tanhf(kC * (v + 0.044715f * v * v * v)));
    }
    store_vec<V>(y + r * y_stride + c, a);
  }
};

// gate_up fp32 or bf16 (InT), arithmetic fp32.
template <class InT, class OutT>
struct SwigluOp {
  const InT* gate_up;
  int64_t I;
  OutT* y;
  int64_t y_stride;
  template <int V>
  __device__ void apply(int64_t r, int64_t c) const {
    const InT* row = gate_up + r * 2 * I;
    const Vec<V> g = load_vec<V>(row + c);
    const Vec<V> u = load_vec<V>(row + I + c);
    Vec<V> o;
#pragma unroll
    for (int k = 0; k < V; ++k) o.v[k] = g.v[k] / (1.0f + expf(-g.v[k])) * u.v[k];
    store_vec<V>(y + r * y_stride + c, o);
  }
};

struct SigmoidOp {
  const float* x;
  int64_t x_stride;
  float* y;
  int64_t cols;
  template <int V>
  __device__ void apply(int64_t r, int64_t c) const {
    Vec<V> a = load_vec<V>(x + r * x_stride + c);
#pragma unroll
    for (int k = 0; k < V; ++k) a.v[k] = sigmoid_f(a.v[k]);
    store_vec<V>(y + r * cols + c, a);
  }
};

// Rows are tokens, columns the H K gate channels (head c / K).
struct KdaGateOp {
  const float* graw;
  int64_t graw_stride, K, cols;
  const float* A_log;
  const float* dt_bias;
  float lower_bound;
  float* g;
  template <int V>
  __device__ void apply(int64_t r, int64_t c) const {
    const Vec<V> raw = load_vec<V>(graw + r * graw_stride + c);
    Vec<V> o;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int64_t channel = c + k;
      const float a = A_log ? expf(A_log[channel / K]) : 1.0f;
      const float x = raw.v[k] + (dt_bias ? dt_bias[channel] : 0.0f);
      if (lower_bound < 0.0f) {
        o.v[k] = lower_bound * sigmoid_f(a * x);
      } else {
        const float softplus = x > 20.0f ? x : log1pf(expf(x));  // torch's threshold 20
        o.v[k] = -a * softplus;
      }
    }
    store_vec<V>(g + r * cols + c, o);
  }
};

}  // namespace

void add_inplace(float* y, const float* x, int64_t n, cudaStream_t stream) {
  require(n >= 0, "cuda::add_inplace: negative size");
  if (n == 0) return;
  require(x && y, "cuda::add_inplace: null pointer");
  const bool vec4 = n % 4 == 0 && aligned_for(x, 4, 4) && aligned_for(y, 4, 4);
  map_rows(1, n, vec4, AddOp{y, x}, stream, "cuda::add_inplace");
}

void add_bias(float* x, int64_t rows, int64_t cols, const float* bias, cudaStream_t stream) {
  require(rows >= 0 && cols >= 1, "cuda::add_bias: sizes must be positive");
  if (rows == 0) return;
  require(x && bias, "cuda::add_bias: null pointer");
  const bool vec4 = cols % 4 == 0 && aligned_for(x, 4, 4) && aligned_for(bias, 4, 4);
  map_rows(rows, cols, vec4, AddBiasOp{x, cols, bias}, stream, "cuda::add_bias");
}

void gelu_tanh(const float* x, int64_t rows, int64_t cols, OutRows y, cudaStream_t stream) {
  require(rows >= 0 && cols >= 1, "cuda::gelu_tanh: sizes must be positive");
  check_out(y, cols, "cuda::gelu_tanh");
  if (rows == 0) return;
  require(x && y.data, "cuda::gelu_tanh: null pointer");
  const int64_t ys = out_stride(y, cols);
  const bool vec4 = cols % 4 == 0 && ys % 4 == 0 && aligned_for(x, 4, 4) &&
                    aligned_for(y.data, 4, element_bytes(y.type));
  dispatch_type(y.type, [&](auto* tag) {
    using OutT = Elem<decltype(tag)>;
    map_rows(rows, cols, vec4, GeluOp<OutT>{x, cols, static_cast<OutT*>(y.data), ys}, stream,
             "cuda::gelu_tanh");
  });
}

void swiglu(const void* gate_up, ElementType gate_up_type, int64_t rows, int64_t I, OutRows y,
            cudaStream_t stream) {
  require(rows >= 0 && I >= 1, "cuda::swiglu: sizes must be positive");
  check_out(y, I, "cuda::swiglu");
  if (rows == 0) return;
  require(gate_up && y.data, "cuda::swiglu: null pointer");
  const int64_t ys = out_stride(y, I);
  const bool vec4 = I % 4 == 0 && ys % 4 == 0 &&
                    aligned_for(gate_up, 4, element_bytes(gate_up_type)) &&
                    aligned_for(y.data, 4, element_bytes(y.type));
  dispatch_type(gate_up_type, [&](auto* in_tag) {
    using InT = Elem<decltype(in_tag)>;
    dispatch_type(y.type, [&](auto* tag) {
      using OutT = Elem<decltype(tag)>;
      map_rows(
          rows, I, vec4,
          SwigluOp<InT, OutT>{static_cast<const InT*>(gate_up), I, static_cast<OutT*>(y.data), ys},
          stream, "cuda::swiglu");
    });
  });
}

void swiglu(const float* gate_up, int64_t rows, int64_t I, OutRows y, cudaStream_t stream) {
  swiglu(gate_up, ElementType::f32, rows, I, y, stream);
}

void sigmoid(const float* x, int64_t rows, int64_t cols, int64_t x_stride, float* y,
             cudaStream_t stream) {
  require(rows >= 0 && cols >= 1, "cuda::sigmoid: sizes must be positive");
  const int64_t xs = x_stride > 0 ? x_stride : cols;
  require(xs >= cols, "cuda::sigmoid: x_stride smaller than cols");
  if (rows == 0) return;
  require(x && y, "cuda::sigmoid: null pointer");
  const bool vec4 = cols % 4 == 0 && xs % 4 == 0 && aligned_for(x, 4, 4) && aligned_for(y, 4, 4);
  map_rows(rows, cols, vec4, SigmoidOp{x, xs, y, cols}, stream, "cuda::sigmoid");
}

void kda_gate(const float* graw, int64_t T, int64_t H, int64_t K, int64_t graw_stride,
              const float* A_log, const float* dt_bias, float lower_bound, float* g,
              cudaStream_t stream) {
  require(T >= 0 && H >= 1 && K >= 1, "cuda::kda_gate: sizes must be positive");
  const int64_t cols = H * K;
  const int64_t gs = graw_stride > 0 ? graw_stride : cols;
  require(gs >= cols, "cuda::kda_gate: graw_stride smaller than H K");
  if (T == 0) return;
  require(graw && g, "cuda::kda_gate: null pointer");
  const bool vec4 = K % 4 == 0 && gs % 4 == 0 && aligned_for(graw, 4, 4) && aligned_for(g, 4, 4);
  map_rows(T, cols, vec4, KdaGateOp{graw, gs, K, cols, A_log, dt_bias, lower_bound, g}, stream,
           "cuda::kda_gate");
}

}  // namespace kda::ops::cuda
