// Suite "nn": the small CUDA kernels of ops/nn/cuda/nn_cuda.h against the CPU fp32 functions of
// the ops library (norms, activations, short conv, KDA gate, embeddings, casts, fill). Outputs are
// poisoned first; fp32 outputs are held to 1e-5, bf16 outputs to 1e-2 (relative). Cases cover
// strided inputs, odd widths (24, 100, 2304), unaligned column slices (the scalar paths), decode
// (T = 1) and T < W - 1 for the conv with a non-zero state, and prefill in two pieces.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "bench/gpu/model/gpu_suite.h"
#include "ops/conv1d/conv1d.h"
#include "ops/kda/kda_activations.h"
#include "ops/nn/cuda/nn_cuda.h"
#include "ops/nn/nn.h"
#include "ops/norm/norm.h"

namespace kda::gpu_check {
namespace {

namespace cu = ops::cuda;

uint64_t fresh_seed() {
  static uint64_t next = 0x6e6e5eedull;
  return next++;
}

double tol_for(ElementType t) {
  return t == ElementType::f32 ? 1e-5 : 1e-2;
}
const char* type_name(ElementType t) {
  return t == ElementType::f32 ? "f32" : "bf16";
}

std::vector<float> narrow(const std::vector<double>& v) {
  return std::vector<float>(v.begin(), v.end());
}

// A poisoned device output [rows, stride] of `type`, and its dense [rows, cols] download.
struct DeviceOut {
  DeviceBuffer buffer;
  ElementType type;
  int64_t rows, cols, stride;
  DeviceOut(int64_t rows_, int64_t cols_, int64_t stride_, ElementType type_)
      : buffer(size_t(rows_ * (stride_ > 0 ? stride_ : cols_)) * cu::element_bytes(type_)),
        type(type_),
        rows(rows_),
        cols(cols_),
        stride(stride_) {
    poison(buffer.data(), buffer.bytes());
  }
  cu::OutRows rows_arg() const { return {buffer.data(), type, stride}; }
  std::vector<double> dense() const {
    const int64_t s = stride > 0 ? stride : cols;
    const std::vector<double> all = from_device(buffer.data(), size_t(rows * s), type);
    std::vector<double> out(size_t(rows * cols));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = all[r * s + c];
    return out;
  }
};

void sync() {
  cu::check_cuda(cudaDeviceSynchronize(), "nn check sync");
}

// Random rows [rows, stride] with the used columns [offset, offset + cols); returns the dense
// [rows, cols] copy the CPU sees.
std::vector<float> dense_columns(const std::vector<float>& wide, int64_t rows, int64_t cols,
                                 int64_t stride, int64_t offset) {
  std::vector<float> out(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = wide[r * stride + offset + c];
  return out;
}

// ---- norms ----

struct NormCase {
  int64_t rows, D, x_stride, x_offset, y_stride;
  bool weight;
  ElementType out;
};

std::string norm_tag(const char* op, const NormCase& c) {
  return std::string(op) + " rows=" + std::to_string(c.rows) + " D=" + std::to_string(c.D) +
         " xs=" + std::to_string(c.x_stride) + " off=" + std::to_string(c.x_offset) +
         " ys=" + std::to_string(c.y_stride) + (c.weight ? "" : " noweight") + " " +
         type_name(c.out);
}

void check_rms_norm(const NormCase& c, Tally& tally) {
  const int64_t xs = c.x_stride > 0 ? c.x_stride : c.D;
  const std::vector<float> xw = random_values(size_t(c.rows * xs + c.x_offset), fresh_seed(), 2.f);
  std::vector<float> w = random_values(size_t(c.D), fresh_seed());
  for (float& v : w) v += 1.0f;
  const DeviceArray dx = to_device(xw, ElementType::f32);
  const DeviceArray dw = to_device(w, ElementType::f32);
  DeviceOut y(c.rows, c.D, c.y_stride, c.out);
  cu::rms_norm(static_cast<const float*>(dx.data()) + c.x_offset, c.rows, c.D, c.x_stride,
               c.weight ? static_cast<const float*>(dw.data()) : nullptr, 1e-6f, y.rows_arg(),
               nullptr);
  sync();
  const std::vector<float> x = dense_columns(xw, c.rows, c.D, xs, c.x_offset);
  std::vector<float> ref(x.size());
  ops::rms_norm(x.data(), c.rows, c.D, c.weight ? w.data() : nullptr, 1e-6f, ref.data());
  report(tally, norm_tag("rms_norm", c), rel_error(y.dense(), widen(ref)), tol_for(c.out));
}

void check_layer_norm(const NormCase& c, Tally& tally) {
  std::vector<float> x = random_values(size_t(c.rows * c.D + c.x_offset), fresh_seed(), 2.f);
  for (float& v : x) v += 0.7f;  // a non-zero mean to subtract
  const std::vector<float> w = random_values(size_t(c.D), fresh_seed());
  const std::vector<float> b = random_values(size_t(c.D), fresh_seed());
  const DeviceArray dx = to_device(x, ElementType::f32);
  const DeviceArray dw = to_device(w, ElementType::f32);
  const DeviceArray db = to_device(b, ElementType::f32);
  DeviceOut y(c.rows, c.D, c.y_stride, c.out);
  cu::layer_norm(static_cast<const float*>(dx.data()) + c.x_offset, c.rows, c.D,
                 c.weight ? static_cast<const float*>(dw.data()) : nullptr,
                 c.weight ? static_cast<const float*>(db.data()) : nullptr, 1e-5f, y.rows_arg(),
                 nullptr);
  sync();
  std::vector<float> ref(size_t(c.rows * c.D));
  ops::layer_norm(x.data() + c.x_offset, c.rows, c.D, c.weight ? w.data() : nullptr,
                  c.weight ? b.data() : nullptr, 1e-5f, ref.data());
  report(tally, norm_tag("layer_norm", c), rel_error(y.dense(), widen(ref)), tol_for(c.out));
}

void check_l2_normalize(const NormCase& c, Tally& tally) {
  const std::vector<float> x = random_values(size_t(c.rows * c.D + c.x_offset), fresh_seed(), 0.5f);
  const DeviceArray dx = to_device(x, ElementType::f32);
  DeviceOut y(c.rows, c.D, c.y_stride, c.out);
  cu::l2_normalize_rows(static_cast<const float*>(dx.data()) + c.x_offset, c.rows, c.D, 1e-6f,
                        y.rows_arg(), nullptr);
  sync();
  std::vector<float> ref(size_t(c.rows * c.D));
  ops::l2_normalize_rows(x.data() + c.x_offset, c.rows, c.D, 1e-6f, ref.data());
  report(tally, norm_tag("l2_normalize_rows", c), rel_error(y.dense(), widen(ref)), tol_for(c.out));
}

void check_gated_norm(int64_t rows, int64_t D, ElementType x_type, ElementType out, bool in_place,
                      Tally& tally) {
  const std::vector<float> x = random_values(size_t(rows * D), fresh_seed(), 2.f);
  const std::vector<float> gate = random_values(size_t(rows * D), fresh_seed(), 4.f);
  std::vector<float> w = random_values(size_t(D), fresh_seed());
  for (float& v : w) v += 1.0f;
  DeviceArray dx = to_device(x, x_type);
  const DeviceArray dg = to_device(gate, ElementType::f32);
  const DeviceArray dw = to_device(w, ElementType::f32);
  DeviceOut y(rows, D, 0, out);
  const cu::OutRows y_arg = in_place ? cu::OutRows{dx.data(), x_type, 0} : y.rows_arg();
  cu::gated_rms_norm_sigmoid(dx.data(), x_type, static_cast<const float*>(dg.data()), rows, D,
                             static_cast<const float*>(dw.data()), 1e-5f, y_arg, nullptr);
  sync();
  const std::vector<float> xr = narrow(dx.rounded);  // what the device read
  std::vector<float> ref(xr.size());
  ops::gated_rms_norm_sigmoid(xr.data(), gate.data(), rows, D, w.data(), 1e-5f, ref.data());
  const std::vector<double> got =
      in_place ? from_device(dx.data(), size_t(rows * D), x_type) : y.dense();
  const std::string tag = std::string("gated_rms_norm_sigmoid rows=") + std::to_string(rows) +
                          " D=" + std::to_string(D) + " x " + type_name(x_type) + " out " +
                          type_name(in_place ? x_type : out) + (in_place ? " in place" : "");
  report(tally, tag, rel_error(got, widen(ref)), tol_for(in_place ? x_type : out));
}

// ---- elementwise ----

void check_gelu(int64_t rows, int64_t cols, int64_t y_stride, ElementType out, Tally& tally) {
  const std::vector<float> x = random_values(size_t(rows * cols), fresh_seed(), 4.f);
  const DeviceArray dx = to_device(x, ElementType::f32);
  DeviceOut y(rows, cols, y_stride, out);
  cu::gelu_tanh(static_cast<const float*>(dx.data()), rows, cols, y.rows_arg(), nullptr);
  sync();
  std::vector<float> ref = x;
  ops::gelu_tanh(ref.data(), int64_t(ref.size()));
  report(tally,
         "gelu_tanh " + std::to_string(rows) + "x" + std::to_string(cols) +
             " ys=" + std::to_string(y_stride) + " " + type_name(out),
         rel_error(y.dense(), widen(ref)), tol_for(out));
}

void check_swiglu(int64_t rows, int64_t I, int64_t y_stride, ElementType out, Tally& tally) {
  const std::vector<float> h = random_values(size_t(rows * 2 * I), fresh_seed(), 4.f);
  const DeviceArray dh = to_device(h, ElementType::f32);
  DeviceOut y(rows, I, y_stride, out);
  cu::swiglu(static_cast<const float*>(dh.data()), rows, I, y.rows_arg(), nullptr);
  sync();
  std::vector<float> ref(size_t(rows * I));
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<float> g(h.begin() + r * 2 * I, h.begin() + r * 2 * I + I);
    ops::silu(g.data(), I);
    for (int64_t i = 0; i < I; ++i) ref[r * I + i] = g[i] * h[r * 2 * I + I + i];
  }
  report(tally,
         "swiglu rows=" + std::to_string(rows) + " I=" + std::to_string(I) +
             " ys=" + std::to_string(y_stride) + " " + type_name(out),
         rel_error(y.dense(), widen(ref)), tol_for(out));
}

void check_sigmoid(int64_t rows, int64_t cols, int64_t x_stride, Tally& tally) {
  const int64_t xs = x_stride > 0 ? x_stride : cols;
  const std::vector<float> xw = random_values(size_t(rows * xs), fresh_seed(), 6.f);
  const DeviceArray dx = to_device(xw, ElementType::f32);
  DeviceOut y(rows, cols, 0, ElementType::f32);
  cu::sigmoid(static_cast<const float*>(dx.data()), rows, cols, x_stride,
              static_cast<float*>(y.buffer.data()), nullptr);
  sync();
  std::vector<float> ref = dense_columns(xw, rows, cols, xs, 0);
  for (float& v : ref) v = ops::sigmoidf(v);
  report(tally,
         "sigmoid " + std::to_string(rows) + "x" + std::to_string(cols) +
             " xs=" + std::to_string(x_stride),
         rel_error(y.dense(), widen(ref)), 1e-5);
}

void check_adds(int64_t rows, int64_t cols, Tally& tally) {
  const int64_t n = rows * cols;
  const std::vector<float> x = random_values(size_t(n), fresh_seed());
  const std::vector<float> y0 = random_values(size_t(n), fresh_seed());
  const std::vector<float> bias = random_values(size_t(cols), fresh_seed());
  const DeviceArray dx = to_device(x, ElementType::f32);
  DeviceArray dy = to_device(y0, ElementType::f32);
  const DeviceArray db = to_device(bias, ElementType::f32);
  cu::add_inplace(static_cast<float*>(dy.data()), static_cast<const float*>(dx.data()), n, nullptr);
  sync();
  std::vector<double> ref(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ref[i] = double(y0[i] + x[i]);
  report(tally, "add_inplace n=" + std::to_string(n),
         rel_error(from_device(dy.data(), size_t(n), ElementType::f32), ref), 1e-6);
  cu::add_bias(static_cast<float*>(dy.data()), rows, cols, static_cast<const float*>(db.data()),
               nullptr);
  sync();
  for (int64_t i = 0; i < n; ++i) ref[i] = double(float(y0[i] + x[i]) + bias[i % cols]);
  report(tally, "add_bias " + std::to_string(rows) + "x" + std::to_string(cols),
         rel_error(from_device(dy.data(), size_t(n), ElementType::f32), ref), 1e-6);
}

void check_kda_gate(int64_t T, int64_t H, int64_t K, int64_t graw_stride, bool bounded, bool params,
                    Tally& tally) {
  const int64_t cols = H * K, gs = graw_stride > 0 ? graw_stride : cols;
  // Scale 30 reaches softplus' linear branch (x > 20) as well as the log1p one.
  const std::vector<float> gw = random_values(size_t(T * gs), fresh_seed(), 30.f);
  std::vector<float> A_log = random_values(size_t(H), fresh_seed(), 1.f);
  std::vector<float> dt_bias = random_values(size_t(cols), fresh_seed(), 2.f);
  const DeviceArray dgraw = to_device(gw, ElementType::f32);
  const DeviceArray dA = to_device(A_log, ElementType::f32);
  const DeviceArray dbias = to_device(dt_bias, ElementType::f32);
  const float lower_bound = bounded ? -5.0f : 0.0f;
  DeviceOut g(T, cols, 0, ElementType::f32);
  cu::kda_gate(static_cast<const float*>(dgraw.data()), T, H, K, graw_stride,
               params ? static_cast<const float*>(dA.data()) : nullptr,
               params ? static_cast<const float*>(dbias.data()) : nullptr, lower_bound,
               static_cast<float*>(g.buffer.data()), nullptr);
  sync();
  if (!params) {
    std::fill(A_log.begin(), A_log.end(), 0.0f);
    std::fill(dt_bias.begin(), dt_bias.end(), 0.0f);
  }
  ops::KdaOptions opt;
  opt.gate = bounded ? ops::KdaGate::lower_bound : ops::KdaGate::softplus;
  opt.lower_bound = lower_bound;
  const std::vector<float> graw = dense_columns(gw, T, cols, gs, 0);
  std::vector<float> ref(size_t(T * cols));
  ops::detail::kda_gate_forward<float>(opt, graw.data(), A_log.data(), dt_bias.data(), T, H, K,
                                       ref.data());
  report(tally,
         std::string("kda_gate ") + (bounded ? "lower_bound" : "softplus") +
             " T=" + std::to_string(T) + " H=" + std::to_string(H) + " K=" + std::to_string(K) +
             " gs=" + std::to_string(graw_stride) + (params ? "" : " no A_log/dt_bias"),
         rel_error(g.dense(), widen(ref)), 1e-5);
}

// ---- short conv ----

// The device conv over T tokens from `state0`, against ops::short_conv_silu_forward (or the
// decode step when T = 1): outputs and the final state.
void check_short_conv(int64_t T, int64_t C, int64_t W, int64_t x_stride, ElementType out,
                      Tally& tally) {
  const int64_t xs = x_stride > 0 ? x_stride : C;
  const std::vector<float> x = random_values(size_t(T * xs), fresh_seed(), 2.f);
  const std::vector<float> w = random_values(size_t(C * W), fresh_seed());
  // (one spare value so W = 1 still has a buffer; the state proper is the first (W - 1) C)
  const std::vector<float> state0 = random_values(size_t((W - 1) * C + 1), fresh_seed(), 2.f);
  const DeviceArray dx = to_device(x, ElementType::f32);
  const DeviceArray dw = to_device(w, ElementType::f32);
  DeviceArray dstate = to_device(state0, ElementType::f32);
  DeviceOut y(T, C, 0, out);
  cu::short_conv_silu(static_cast<const float*>(dx.data()), T, C, x_stride,
                      static_cast<const float*>(dw.data()), W,
                      W > 1 ? static_cast<float*>(dstate.data()) : nullptr, y.rows_arg(), nullptr);
  sync();
  std::vector<float> state = state0, ref(size_t(T * C));
  if (T == 1)
    ops::short_conv_silu_decode_step(x.data(), C, w.data(), W, state.data(), ref.data());
  else
    ops::short_conv_silu_forward(x.data(), T, C, xs, w.data(), W, state.data(), ref.data());
  const std::string tag = "short_conv_silu T=" + std::to_string(T) + " C=" + std::to_string(C) +
                          " W=" + std::to_string(W) + " xs=" + std::to_string(x_stride) + " " +
                          type_name(out);
  report(tally, tag + " y", rel_error(y.dense(), widen(ref)), tol_for(out));
  if (W > 1) {
    report(tally, tag + " state",
           rel_error(from_device(dstate.data(), state.size(), ElementType::f32), widen(state)),
           1e-7);
  }
}

// Prefill in two pieces (T1 then T2 tokens) equals one piece of T1 + T2, outputs and state.
void check_short_conv_pieces(int64_t T1, int64_t T2, int64_t C, int64_t W, Tally& tally) {
  const int64_t T = T1 + T2;
  const std::vector<float> x = random_values(size_t(T * C), fresh_seed(), 2.f);
  const std::vector<float> w = random_values(size_t(C * W), fresh_seed());
  const std::vector<float> state0 = random_values(size_t((W - 1) * C), fresh_seed(), 2.f);
  const DeviceArray dx = to_device(x, ElementType::f32);
  const DeviceArray dw = to_device(w, ElementType::f32);
  DeviceArray one_state = to_device(state0, ElementType::f32);
  DeviceArray two_state = to_device(state0, ElementType::f32);
  DeviceOut one(T, C, 0, ElementType::f32), two(T, C, 0, ElementType::f32);
  const float* xp = static_cast<const float*>(dx.data());
  const float* wp = static_cast<const float*>(dw.data());
  cu::short_conv_silu(xp, T, C, 0, wp, W, static_cast<float*>(one_state.data()), one.rows_arg(),
                      nullptr);
  float* two_y = static_cast<float*>(two.buffer.data());
  cu::short_conv_silu(xp, T1, C, 0, wp, W, static_cast<float*>(two_state.data()),
                      {two_y, ElementType::f32, 0}, nullptr);
  cu::short_conv_silu(xp + T1 * C, T2, C, 0, wp, W, static_cast<float*>(two_state.data()),
                      {two_y + T1 * C, ElementType::f32, 0}, nullptr);
  sync();
  const std::string tag = "short_conv_silu pieces " + std::to_string(T1) + "+" +
                          std::to_string(T2) + " C=" + std::to_string(C) +
                          " W=" + std::to_string(W);
  report(tally, tag + " y", rel_error(two.dense(), one.dense()), 1e-6);
  const size_t ns = size_t((W - 1) * C);
  report(tally, tag + " state",
         rel_error(from_device(two_state.data(), ns, ElementType::f32),
                   from_device(one_state.data(), ns, ElementType::f32)),
         1e-7);
}

// ---- embeddings, casts, copies, fill ----

void check_embedding(int64_t T, int64_t D, bool with_positions, ElementType table_type,
                     Tally& tally) {
  const int64_t V = 50, P = 64, position0 = 5;
  const std::vector<float> table = random_values(size_t(V * D), fresh_seed());
  const std::vector<float> positions = random_values(size_t(P * D), fresh_seed());
  Random rng(fresh_seed());
  std::vector<int32_t> ids(static_cast<size_t>(T));
  for (int32_t& id : ids) id = int32_t(rng.integer(0, V - 1));
  const DeviceArray dt = to_device(table, table_type);
  const DeviceArray dp = to_device(positions, table_type);
  DeviceBuffer dids(ids.size() * sizeof(int32_t));
  dids.upload(ids.data(), ids.size() * sizeof(int32_t));
  DeviceOut out(T, D, 0, ElementType::f32);
  cu::embedding(dids.as<int32_t>(), T, dt.data(), with_positions ? dp.data() : nullptr, position0,
                table_type, D, static_cast<float*>(out.buffer.data()), nullptr);
  sync();
  std::vector<double> ref(size_t(T * D));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < D; ++c) {
      float v = float(dt.rounded[ids[t] * D + c]);
      if (with_positions) v += float(dp.rounded[(position0 + t) * D + c]);
      ref[t * D + c] = v;
    }
  report(tally,
         "embedding T=" + std::to_string(T) + " D=" + std::to_string(D) +
             (with_positions ? " +positions" : "") + " table " + type_name(table_type),
         rel_error(out.dense(), ref), 1e-6);
}

void check_convert(int64_t n, Tally& tally) {
  const std::vector<float> x = random_values(size_t(n), fresh_seed(), 3.f);
  const DeviceArray dx = to_device(x, ElementType::f32);
  DeviceBuffer half(size_t(n) * 2), back(size_t(n) * 4), copy(size_t(n) * 2);
  poison(half.data(), half.bytes());
  poison(back.data(), back.bytes());
  poison(copy.data(), copy.bytes());
  cu::convert(dx.data(), ElementType::f32, half.data(), ElementType::bf16, n, nullptr);
  cu::convert(half.data(), ElementType::bf16, back.data(), ElementType::f32, n, nullptr);
  cu::convert(half.data(), ElementType::bf16, copy.data(), ElementType::bf16, n, nullptr);
  sync();
  std::vector<double> rounded(static_cast<size_t>(n));  // round to nearest even, as the host does
  for (int64_t i = 0; i < n; ++i) rounded[i] = bf16_to_f32(f32_to_bf16(x[i]));
  const std::string tag = "convert n=" + std::to_string(n);
  report(tally, tag + " f32->bf16",
         rel_error(from_device(half.data(), size_t(n), ElementType::bf16), rounded), 0.0);
  report(tally, tag + " bf16->f32",
         rel_error(from_device(back.data(), size_t(n), ElementType::f32), rounded), 0.0);
  report(tally, tag + " bf16->bf16",
         rel_error(from_device(copy.data(), size_t(n), ElementType::bf16), rounded), 0.0);
}

void check_copy_rows(int64_t rows, int64_t cols, int64_t x_stride, int64_t x_offset,
                     int64_t y_stride, ElementType out, Tally& tally) {
  const int64_t xs = x_stride > 0 ? x_stride : cols;
  const std::vector<float> xw = random_values(size_t(rows * xs + x_offset), fresh_seed());
  const DeviceArray dx = to_device(xw, ElementType::f32);
  DeviceOut y(rows, cols, y_stride, out);
  cu::copy_rows(static_cast<const float*>(dx.data()) + x_offset, rows, cols, x_stride, y.rows_arg(),
                nullptr);
  sync();
  std::vector<double> ref = widen(dense_columns(xw, rows, cols, xs, x_offset));
  if (out == ElementType::bf16)
    for (double& v : ref) v = bf16_to_f32(f32_to_bf16(float(v)));
  report(tally,
         "copy_rows " + std::to_string(rows) + "x" + std::to_string(cols) +
             " xs=" + std::to_string(x_stride) + " off=" + std::to_string(x_offset) +
             " ys=" + std::to_string(y_stride) + " " + type_name(out),
         rel_error(y.dense(), ref), 0.0);
}

// Host replica of the device hash (the i-th splitmix64 output from `seed`, top 24 bits).
float uniform_at(uint64_t seed, uint64_t i) {
  uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return 2.0f * (float(z >> 40) * (1.0f / 16777216.0f)) - 1.0f;
}

void check_fill_uniform(int64_t n, ElementType type, Tally& tally) {
  const float scale = 0.25f;
  const uint64_t seed = fresh_seed();
  const size_t bytes = size_t(n) * cu::element_bytes(type);
  DeviceBuffer a(bytes), b(bytes), c(bytes);
  poison(a.data(), bytes);
  poison(b.data(), bytes);
  poison(c.data(), bytes);
  cu::fill_uniform(a.data(), type, n, scale, seed, nullptr);
  cu::fill_uniform(b.data(), type, n, scale, seed, nullptr);
  cu::fill_uniform(c.data(), type, n, scale, seed + 1, nullptr);
  sync();
  const std::vector<double> va = from_device(a.data(), size_t(n), type);
  const std::vector<double> vb = from_device(b.data(), size_t(n), type);
  const std::vector<double> vc = from_device(c.data(), size_t(n), type);
  const std::string tag = "fill_uniform n=" + std::to_string(n) + " " + type_name(type);
  report(tally, tag + " same seed same values", rel_error(vb, va), 0.0);
  size_t differ = 0;
  for (int64_t i = 0; i < n; ++i) differ += va[i] != vc[i];
  report(tally, tag + " other seed differs", differ > size_t(n) / 2 ? 0.0 : 1.0, 0.5);
  double sum = 0, sq = 0;
  bool in_range = true;
  for (double v : va) {
    in_range = in_range && std::isfinite(v) &&
               (type == ElementType::f32 ? (v >= -scale && v < scale) : std::abs(v) <= scale);
    sum += v;
    sq += v * v;
  }
  report(tally, tag + " in [-scale, scale)", in_range ? 0.0 : 1.0, 0.5);
  // Mean near 0 (its std is scale / sqrt(3 n)); variance near scale^2 / 3.
  const double mean = sum / double(n), var = sq / double(n) - mean * mean;
  report(tally, tag + " |mean| / scale", std::abs(mean) / scale, 0.02);
  report(tally, tag + " variance vs scale^2/3", std::abs(var / (scale * scale / 3.0) - 1.0), 0.05);
  std::vector<double> host(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const float v = scale * uniform_at(seed, uint64_t(i));
    host[i] = type == ElementType::f32 ? double(v) : double(bf16_to_f32(f32_to_bf16(v)));
  }
  report(tally, tag + " equals the host hash", rel_error(va, host), 0.0);
}

void run_nn(const SuiteOptions& options, Tally& tally) {
  if (!options.check) return;
  const ElementType f32 = ElementType::f32, bf16 = ElementType::bf16;

  // rows, D, x_stride, x_offset, y_stride, weight, out
  const NormCase rms_cases[] = {
      {7, 24, 0, 0, 0, true, f32},       {37, 128, 0, 0, 0, true, f32},
      {5, 100, 130, 0, 104, true, bf16}, {5, 100, 130, 1, 0, true, f32},
      {3, 2304, 2400, 0, 0, true, f32},  {3, 2304, 2400, 2, 2310, true, bf16},
      {4, 4096, 0, 0, 0, false, bf16},   {2, 8192, 0, 0, 0, true, f32},
      {1, 2048, 0, 0, 0, true, f32},     {3, 1500, 0, 0, 0, true, f32}};
  for (const NormCase& c : rms_cases) check_rms_norm(c, tally);

  const NormCase ln_cases[] = {{6, 24, 0, 0, 0, true, f32},      {33, 768, 0, 0, 0, true, f32},
                               {5, 100, 0, 1, 0, true, f32},     {3, 2304, 0, 0, 0, true, bf16},
                               {2, 8192, 0, 0, 8200, true, f32}, {4, 64, 0, 0, 0, false, f32}};
  for (const NormCase& c : ln_cases) check_layer_norm(c, tally);

  const NormCase l2_cases[] = {{33, 128, 0, 0, 0, true, f32},
                               {10, 100, 0, 0, 112, true, bf16},
                               {7, 24, 0, 3, 0, true, f32},
                               {2, 2304, 0, 0, 0, true, f32}};
  for (const NormCase& c : l2_cases) check_l2_normalize(c, tally);

  check_gated_norm(40, 128, f32, f32, false, tally);
  check_gated_norm(40, 128, bf16, bf16, false, tally);
  check_gated_norm(5, 100, f32, bf16, false, tally);
  check_gated_norm(5, 100, bf16, f32, false, tally);
  check_gated_norm(3, 2304, f32, f32, false, tally);
  check_gated_norm(9, 128, f32, f32, true, tally);

  check_gelu(7, 100, 0, f32, tally);
  check_gelu(5, 3072, 3080, bf16, tally);
  check_gelu(3, 37, 0, f32, tally);
  check_swiglu(6, 100, 0, f32, tally);
  check_swiglu(4, 1024, 1032, bf16, tally);
  check_swiglu(3, 37, 40, f32, tally);
  check_sigmoid(5, 100, 130, tally);
  check_sigmoid(4, 37, 0, tally);
  check_adds(9, 100, tally);
  check_adds(3, 37, tally);

  check_kda_gate(5, 3, 24, 80, false, true, tally);
  check_kda_gate(5, 3, 24, 80, true, true, tally);
  check_kda_gate(4, 2, 128, 0, false, true, tally);
  check_kda_gate(4, 2, 128, 0, true, true, tally);
  check_kda_gate(3, 2, 10, 0, false, false, tally);
  check_kda_gate(3, 2, 10, 23, true, false, tally);

  // T, C, W, x_stride, out
  check_short_conv(37, 100, 4, 130, f32, tally);
  check_short_conv(1, 2304, 4, 0, bf16, tally);  // decode
  check_short_conv(1, 100, 4, 0, f32, tally);
  check_short_conv(2, 100, 4, 300, f32, tally);  // T < W - 1: old state rows shift
  check_short_conv(3, 100, 4, 0, f32, tally);    // T = W - 1
  check_short_conv(1, 64, 3, 0, f32, tally);
  check_short_conv(5, 64, 2, 0, f32, tally);
  check_short_conv(5, 64, 1, 0, f32, tally);
  check_short_conv(4000, 96, 4, 0, bf16, tally);  // many token runs per channel
  check_short_conv(33, 12288, 4, 0, f32, tally);
  check_short_conv_pieces(20, 30, 100, 4, tally);
  check_short_conv_pieces(2, 35, 64, 4, tally);
  check_short_conv_pieces(17, 1, 64, 4, tally);

  check_embedding(7, 100, true, f32, tally);
  check_embedding(9, 128, false, bf16, tally);
  check_embedding(5, 64, true, bf16, tally);
  check_embedding(6, 37, false, f32, tally);

  check_convert(1001, tally);
  check_convert(4096, tally);
  check_copy_rows(5, 100, 130, 0, 136, bf16, tally);
  check_copy_rows(5, 100, 130, 1, 0, f32, tally);
  check_copy_rows(4, 37, 0, 0, 41, bf16, tally);
  check_copy_rows(6, 2304, 6912, 2304, 0, f32, tally);

  check_fill_uniform(100003, f32, tally);
  check_fill_uniform(100000, bf16, tally);
  check_fill_uniform(65536, f32, tally);
}

const bool registered = register_suite("nn", run_nn);

}  // namespace
}  // namespace kda::gpu_check
