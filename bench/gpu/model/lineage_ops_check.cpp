// Suite "lineage_ops": the lineage mixers' training kernels of ops/nn/cuda/train_mixer_cuda.h
// against float64 host references written here from the CPU formulas (ops/conv1d,
// ops/kda/kda_activations.h in double, train/mixer_layer.cpp's rotary), plus the GPU short conv
// against the CPU ops::short_conv_silu_forward / _backward run per sequence from a zero state.
// Fresh random inputs per check, poisoned outputs, accumulated gradients starting from random
// values; fp32 outputs to 1e-5, gradients to 1e-4, bf16 outputs to 1e-2 (relative). Rows are
// packed sequences of unequal lengths (one of length 1, one shorter than the conv width), B x T
// batches and a single row; the reducing kernels run twice and must give the same bits.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "bench/gpu/model/gpu_suite.h"
#include "core/error.h"
#include "ops/conv1d/conv1d.h"
#include "ops/kda/kda_activations.h"
#include "ops/nn/cuda/train_mixer_cuda.h"

namespace kda::gpu_check {
namespace {

namespace cu = ops::cuda;
namespace act = ops::detail;

uint64_t fresh_seed() {
  static uint64_t next = 0x11e46e5eedull;
  return next++;
}

constexpr double kTol = 1e-5, kGradTol = 1e-4, kBf16Tol = 1e-2;
constexpr ElementType f32 = ElementType::f32, bf16 = ElementType::bf16;

const char* type_name(ElementType t) {
  return t == f32 ? "f32" : "bf16";
}
double out_tol(ElementType t) {
  return t == f32 ? kTol : kBf16Tol;
}

void sync() {
  cu::check_cuda(cudaDeviceSynchronize(), "lineage_ops check sync");
}

DeviceBuffer poisoned(size_t bytes) {
  DeviceBuffer b(bytes);
  poison(b.data(), b.bytes());
  return b;
}

// ---- sequence layouts ----

struct Layout {
  std::string name;
  int64_t B, T;
  std::vector<int64_t> cu_seqlens;  // empty: B rows of T tokens
  int64_t rows() const { return B * T; }
};

// Several unequal sequences: lengths 5, 1, 2 (< W), 37, 1, 20.
Layout packed_small() {
  return {"packed 5,1,2,37,1,20", 1, 66, {0, 5, 6, 8, 45, 46, 66}};
}
// Longer packed rows (the weight-gradient sums span many row chunks); lengths 3, 697, 1, 3, 1296.
Layout packed_long() {
  return {"packed 3,697,1,3,1296", 1, 2000, {0, 3, 700, 701, 704, 2000}};
}
Layout batch(int64_t B, int64_t T) {
  return {"B=" + std::to_string(B) + " T=" + std::to_string(T), B, T, {}};
}

// Each token's position inside its sequence, written independently of the kernel under test.
std::vector<int32_t> host_positions(const Layout& l) {
  std::vector<int32_t> p(size_t(l.rows()));
  if (l.cu_seqlens.empty()) {
    for (int64_t b = 0; b < l.B; ++b)
      for (int64_t t = 0; t < l.T; ++t) p[size_t(b * l.T + t)] = int32_t(t);
  } else {
    for (size_t n = 0; n + 1 < l.cu_seqlens.size(); ++n)
      for (int64_t t = 0; t < l.cu_seqlens[n + 1] - l.cu_seqlens[n]; ++t)
        p[size_t(l.cu_seqlens[n] + t)] = int32_t(t);
  }
  return p;
}

// [start, end) of every sequence.
std::vector<std::pair<int64_t, int64_t>> sequences(const Layout& l) {
  std::vector<std::pair<int64_t, int64_t>> s;
  if (l.cu_seqlens.empty()) {
    for (int64_t b = 0; b < l.B; ++b) s.push_back({b * l.T, (b + 1) * l.T});
  } else {
    for (size_t n = 0; n + 1 < l.cu_seqlens.size(); ++n)
      s.push_back({l.cu_seqlens[n], l.cu_seqlens[n + 1]});
  }
  return s;
}

void check_sequence_positions(const Layout& l, Tally& tally) {
  const std::vector<int32_t> ref = host_positions(l);
  DeviceBuffer d = poisoned(ref.size() * sizeof(int32_t));
  cu::sequence_positions(l.cu_seqlens, l.B, l.T, d.as<int32_t>(), nullptr);
  std::vector<int32_t> got(ref.size());
  d.download(got.data(), got.size() * sizeof(int32_t));
  int64_t wrong = 0;
  for (size_t i = 0; i < ref.size(); ++i) wrong += got[i] != ref[i];
  report(tally, "sequence_positions " + l.name + " (wrong entries)", double(wrong), 0.0);
}

// ---- short convolution ----

// x [rows, C] seen with row stride xs (the host array holds rows x xs values).
struct ConvCase {
  Layout layout;
  int64_t C, W, xs;
  std::vector<float> x, w;
  std::vector<int32_t> pos;
};

ConvCase make_conv_case(const Layout& l, int64_t C, int64_t W, int64_t x_extra) {
  ConvCase k{l, C, W, C + x_extra, {}, {}, host_positions(l)};
  k.x = random_values(size_t(l.rows() * k.xs), fresh_seed(), 2.f);
  k.w = random_values(size_t(C * W), fresh_seed(), 0.8f);
  return k;
}

// float64 pre-activations a [rows, C] (inputs before a sequence's start are 0).
std::vector<double> conv_preactivation(const ConvCase& k) {
  const int64_t rows = k.layout.rows(), P = k.W - 1;
  std::vector<double> a(size_t(rows * k.C));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < k.C; ++c) {
      double acc = 0;
      for (int64_t j = 0; j < k.W; ++j) {
        const int64_t back = P - j;
        if (back <= k.pos[r]) acc += double(k.w[c * k.W + j]) * k.x[(r - back) * k.xs + c];
      }
      a[r * k.C + c] = acc;
    }
  return a;
}

std::string conv_tag(const ConvCase& k) {
  return k.layout.name + " C=" + std::to_string(k.C) + " W=" + std::to_string(k.W) +
         (k.xs != k.C ? " x_stride=" + std::to_string(k.xs) : "");
}

void check_conv_forward(const Layout& l, int64_t C, int64_t W, int64_t x_extra, ElementType out,
                        int64_t y_extra, Tally& tally) {
  const ConvCase k = make_conv_case(l, C, W, x_extra);
  const int64_t rows = l.rows(), ys = y_extra > 0 ? C + y_extra : 0, ysd = ys > 0 ? ys : C;
  const std::vector<double> a = conv_preactivation(k);
  std::vector<double> ref(a.size());
  for (size_t i = 0; i < a.size(); ++i) ref[i] = a[i] / (1.0 + std::exp(-a[i]));
  const DeviceBuffer d_x = upload(k.x), d_w = upload(k.w), d_pos = upload_ints(k.pos);
  DeviceBuffer d_y = poisoned(size_t(rows * ysd) * cu::element_bytes(out));
  cu::short_conv_silu_train_forward(d_x.as<float>(), d_pos.as<int32_t>(), rows, C,
                                    k.xs != C ? k.xs : 0, d_w.as<float>(), W, {d_y.data(), out, ys},
                                    nullptr);
  sync();
  const std::vector<double> all = from_device(d_y.data(), size_t(rows * ysd), out);
  std::vector<double> got(size_t(rows * C));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < C; ++c) got[r * C + c] = all[r * ysd + c];
  report(tally,
         "short_conv_silu_train_forward " + conv_tag(k) + " y " + type_name(out) +
             (ys > 0 ? " y_stride=" + std::to_string(ys) : ""),
         rel_error(got, ref), out_tol(out));
}

void check_conv_backward(const Layout& l, int64_t C, int64_t W, int64_t x_extra,
                         ElementType dy_type, Tally& tally) {
  const ConvCase k = make_conv_case(l, C, W, x_extra);
  const int64_t rows = l.rows(), P = W - 1;
  const DeviceArray d_dy = to_device(random_values(size_t(rows * C), fresh_seed()), dy_type);
  const std::vector<double>& dy = d_dy.rounded;
  const std::vector<float> dw0 = random_values(size_t(C * W), fresh_seed());

  const std::vector<double> a = conv_preactivation(k);
  std::vector<double> da(a.size()), dx_ref(a.size()), dw_ref(dw0.begin(), dw0.end());
  for (size_t i = 0; i < a.size(); ++i) {
    const double s = 1.0 / (1.0 + std::exp(-a[i]));
    da[i] = dy[i] * s * (1.0 + a[i] * (1.0 - s));
  }
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t j = 0; j < W; ++j) {
        const int64_t back = P - j;
        if (back > k.pos[t]) continue;  // input before t's sequence start
        dx_ref[(t - back) * C + c] += double(k.w[c * W + j]) * da[t * C + c];
        dw_ref[c * W + j] += da[t * C + c] * k.x[(t - back) * k.xs + c];
      }

  const DeviceBuffer d_x = upload(k.x), d_w = upload(k.w), d_pos = upload_ints(k.pos);
  cu::TrainScratch scratch;
  std::vector<float> dx_runs[2], dw_runs[2];
  for (int run = 0; run < 2; ++run) {
    DeviceBuffer d_dx = poisoned(size_t(rows * C) * sizeof(float)), d_dw = upload(dw0);
    cu::short_conv_silu_train_backward(
        d_x.as<float>(), d_pos.as<int32_t>(), rows, C, k.xs != C ? k.xs : 0, d_w.as<float>(), W,
        d_dy.data(), dy_type, d_dx.as<float>(), d_dw.as<float>(), scratch, nullptr);
    sync();
    dx_runs[run] = download(d_dx.data(), size_t(rows * C));
    dw_runs[run] = download(d_dw.data(), size_t(C * W));
  }
  const std::string tag =
      "short_conv_silu_train_backward " + conv_tag(k) + " dy " + type_name(dy_type);
  report(tally, tag + " dx", rel_error(widen(dx_runs[0]), dx_ref), kGradTol);
  report(tally, tag + " dweight (accumulated)", rel_error(widen(dw_runs[0]), dw_ref), kGradTol);
  report_same(tally, tag + " deterministic",
              same_bits(dx_runs[0], dx_runs[1]) && same_bits(dw_runs[0], dw_runs[1]));
}

// The GPU kernels against the CPU ops run per sequence from a zero state (mixer_layer.cpp's use).
void check_conv_against_cpu(const Layout& l, int64_t C, int64_t x_extra, Tally& tally) {
  const int64_t W = 4;
  const ConvCase k = make_conv_case(l, C, W, x_extra);
  const int64_t rows = l.rows();
  const std::vector<float> dy = random_values(size_t(rows * C), fresh_seed());
  const std::vector<float> dw0 = random_values(size_t(C * W), fresh_seed());
  std::vector<float> y_cpu(size_t(rows * C)), dx_cpu(size_t(rows * C)), dw_cpu = dw0;
  std::vector<float> state(size_t((W - 1) * C));
  for (const auto& [t0, t1] : sequences(l)) {
    std::fill(state.begin(), state.end(), 0.0f);
    ops::short_conv_silu_forward(k.x.data() + t0 * k.xs, t1 - t0, C, k.xs, k.w.data(), W,
                                 state.data(), y_cpu.data() + t0 * C);
    ops::short_conv_silu_backward(k.x.data() + t0 * k.xs, t1 - t0, C, k.xs, k.w.data(), W,
                                  dy.data() + t0 * C, dx_cpu.data() + t0 * C, C, dw_cpu.data());
  }
  const DeviceBuffer d_x = upload(k.x), d_w = upload(k.w), d_dy = upload(dy), d_dw = upload(dw0);
  DeviceBuffer d_y = poisoned(size_t(rows * C) * sizeof(float));
  DeviceBuffer d_dx = poisoned(size_t(rows * C) * sizeof(float));
  DeviceBuffer d_pos = poisoned(size_t(rows) * sizeof(int32_t));
  cu::sequence_positions(l.cu_seqlens, l.B, l.T, d_pos.as<int32_t>(), nullptr);
  cu::TrainScratch scratch;
  const int64_t xs = k.xs != C ? k.xs : 0;
  cu::short_conv_silu_train_forward(d_x.as<float>(), d_pos.as<int32_t>(), rows, C, xs,
                                    d_w.as<float>(), W, {d_y.data(), f32, 0}, nullptr);
  cu::short_conv_silu_train_backward(d_x.as<float>(), d_pos.as<int32_t>(), rows, C, xs,
                                     d_w.as<float>(), W, d_dy.data(), f32, d_dx.as<float>(),
                                     d_dw.as<float>(), scratch, nullptr);
  sync();
  const std::string tag = "short_conv GPU vs CPU per sequence " + conv_tag(k);
  report(tally, tag + " y", rel_error(widen(download(d_y.data(), y_cpu.size())), widen(y_cpu)),
         kTol);
  report(tally, tag + " dx", rel_error(widen(download(d_dx.data(), dx_cpu.size())), widen(dx_cpu)),
         kGradTol);
  report(tally, tag + " dweight",
         rel_error(widen(download(d_dw.data(), dw_cpu.size())), widen(dw_cpu)), kGradTol);
}

// The backward writing dx typed into a column block of a wider row buffer (the trainer's bf16
// [dq | dk | dv | dg] rows, one GEMM's input): against the float64 reference, bit for bit the
// dense fp32 call's dx (rounded once to bf16) and its dweight, the columns outside the block
// untouched (still poison), and the same bits twice.
void check_conv_backward_into_block(const Layout& l, int64_t C, int64_t W, int64_t x_extra,
                                    ElementType dy_type, ElementType dx_type, int64_t col0,
                                    int64_t dx_width, Tally& tally) {
  const ConvCase k = make_conv_case(l, C, W, x_extra);
  const int64_t rows = l.rows(), P = W - 1;
  const DeviceArray d_dy = to_device(random_values(size_t(rows * C), fresh_seed()), dy_type);
  const std::vector<float> dw0 = random_values(size_t(C * W), fresh_seed());
  const std::vector<double> a = conv_preactivation(k);
  std::vector<double> dx_ref(a.size()), dw_ref(dw0.begin(), dw0.end());
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t c = 0; c < C; ++c) {
      const double s = 1.0 / (1.0 + std::exp(-a[t * C + c]));
      const double da = d_dy.rounded[t * C + c] * s * (1.0 + a[t * C + c] * (1.0 - s));
      for (int64_t j = 0; j < W; ++j) {
        const int64_t back = P - j;
        if (back > k.pos[t]) continue;  // input before t's sequence start
        dx_ref[(t - back) * C + c] += double(k.w[c * W + j]) * da;
        dw_ref[c * W + j] += da * k.x[(t - back) * k.xs + c];
      }
    }
  const DeviceBuffer d_x = upload(k.x), d_w = upload(k.w), d_pos = upload_ints(k.pos);
  const int64_t xs = k.xs != C ? k.xs : 0;
  cu::TrainScratch scratch;
  // the dense fp32 call
  DeviceBuffer d_dx32 = poisoned(size_t(rows * C) * sizeof(float)), d_dw32 = upload(dw0);
  cu::short_conv_silu_train_backward(d_x.as<float>(), d_pos.as<int32_t>(), rows, C, xs,
                                     d_w.as<float>(), W, d_dy.data(), dy_type, d_dx32.as<float>(),
                                     d_dw32.as<float>(), scratch, nullptr);
  sync();
  const std::vector<float> dx32 = download(d_dx32.data(), size_t(rows * C));
  const std::vector<float> dw32 = download(d_dw32.data(), size_t(C * W));
  // the typed call into columns [col0, col0 + C) of rows dx_width wide, twice
  const size_t elem = cu::element_bytes(dx_type), row_bytes = size_t(dx_width) * elem;
  std::vector<uint8_t> wide_runs[2];
  std::vector<float> dw_runs[2];
  for (int run = 0; run < 2; ++run) {
    DeviceBuffer d_wide = poisoned(size_t(rows) * row_bytes), d_dw = upload(dw0);
    cu::short_conv_silu_train_backward(
        d_x.as<float>(), d_pos.as<int32_t>(), rows, C, xs, d_w.as<float>(), W, d_dy.data(), dy_type,
        cu::OutRows{static_cast<uint8_t*>(d_wide.data()) + col0 * elem, dx_type, dx_width},
        d_dw.as<float>(), scratch, nullptr);
    sync();
    wide_runs[run].resize(size_t(rows) * row_bytes);
    d_wide.download(wide_runs[run].data(), wide_runs[run].size());
    dw_runs[run] = download(d_dw.data(), size_t(C * W));
  }
  const std::vector<uint8_t>& wide = wide_runs[0];
  std::vector<double> got(size_t(rows * C));
  int64_t bits_differ = 0, outside_written = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = wide.data() + size_t(r) * row_bytes;
    for (int64_t c = 0; c < dx_width; ++c) {
      const uint8_t* e = row + size_t(c) * elem;
      if (c < col0 || c >= col0 + C) {
        for (size_t b = 0; b < elem; ++b) outside_written += e[b] != 0xFF;
        continue;
      }
      const float dense = dx32[size_t(r * C + c - col0)];
      if (dx_type == bf16) {
        uint16_t v;
        std::memcpy(&v, e, 2);
        got[size_t(r * C + c - col0)] = bf16_to_f32(v);
        bits_differ += v != f32_to_bf16(dense);
      } else {
        float v;
        std::memcpy(&v, e, 4);
        got[size_t(r * C + c - col0)] = v;
        bits_differ += std::memcmp(&v, &dense, 4) != 0;
      }
    }
  }
  const std::string tag = "short_conv_silu_train_backward " + conv_tag(k) + " dy " +
                          type_name(dy_type) + " dx " + type_name(dx_type) + " columns [" +
                          std::to_string(col0) + ", " + std::to_string(col0 + C) + ") of " +
                          std::to_string(dx_width);
  report(tally, tag + " dx", rel_error(got, dx_ref), dx_type == f32 ? kGradTol : kBf16Tol);
  report(tally, tag + " dx = dense fp32 dx rounded (differing entries)", double(bits_differ), 0.0);
  report(tally, tag + " bytes written outside the block", double(outside_written), 0.0);
  report(tally, tag + " dweight (accumulated)", rel_error(widen(dw_runs[0]), dw_ref), kGradTol);
  report_same(tally, tag + " dweight = dense call's", same_bits(dw_runs[0], dw32));
  report_same(tally, tag + " deterministic",
              wide_runs[0] == wide_runs[1] && same_bits(dw_runs[0], dw_runs[1]));
}

void check_conv_backward_block_errors(Tally& tally) {
  cu::TrainScratch scratch;
  float* bogus = reinterpret_cast<float*>(uintptr_t(256));  // never dereferenced
  const int32_t* bogus_pos = reinterpret_cast<const int32_t*>(bogus);
  float* other = bogus + 64;
  report_throws(tally, "short_conv_silu_train_backward typed dx stride < C", [&] {
    cu::short_conv_silu_train_backward(bogus, bogus_pos, 4, 8, 0, bogus, 4, bogus, f32,
                                       cu::OutRows{other, bf16, 6}, other + 64, scratch, nullptr);
  });
  report_throws(tally, "short_conv_silu_train_backward typed dx aliasing x", [&] {
    cu::short_conv_silu_train_backward(bogus, bogus_pos, 4, 8, 0, bogus, 4, other, f32,
                                       cu::OutRows{bogus, bf16, 0}, other + 64, scratch, nullptr);
  });
  report_throws(tally, "short_conv_silu_train_backward typed dx aliasing dy", [&] {
    cu::short_conv_silu_train_backward(bogus, bogus_pos, 4, 8, 0, bogus, 4, other, f32,
                                       cu::OutRows{other, bf16, 0}, other + 64, scratch, nullptr);
  });
}

// ---- rotary ----

// mixer_layer.cpp's rotary in float64 (angle, cosine and sine not rounded).
void rotary_reference(std::vector<double>& x, const std::vector<int32_t>& pos, int64_t H, int64_t D,
                      int64_t xs, int direction) {
  const int64_t half = D / 2;
  for (size_t r = 0; r < pos.size(); ++r)
    for (int64_t i = 0; i < half; ++i) {
      const double angle = double(pos[r]) * std::pow(10000.0, -2.0 * double(i) / double(D));
      const double c = std::cos(angle), s = direction * std::sin(angle);
      for (int64_t h = 0; h < H; ++h) {
        double* row = x.data() + int64_t(r) * xs + h * D;
        const double x0 = row[i], x1 = row[i + half];
        row[i] = x0 * c - x1 * s;
        row[i + half] = x0 * s + x1 * c;
      }
    }
}

// positions: the layout's, or (far) random positions up to 65535, where an fp32 angle would be
// off by ~1e-3 radians.
void check_rotary(const Layout& l, int64_t H, int64_t D, int64_t x_extra, ElementType type,
                  bool far_positions, Tally& tally) {
  const int64_t rows = l.rows(), xs = H * D + x_extra;
  std::vector<int32_t> pos = host_positions(l);
  if (far_positions) {
    Random rng(fresh_seed());
    for (int32_t& p : pos) p = int32_t(rng.integer(0, 65535));
    pos[0] = 65535;
  }
  const DeviceArray d_x = to_device(random_values(size_t(rows * xs), fresh_seed(), 2.f), type);
  const std::vector<double> x0 = d_x.rounded;
  std::vector<double> ref = x0;
  rotary_reference(ref, pos, H, D, xs, 1);
  const DeviceBuffer d_pos = upload_ints(pos);
  const std::string tag =
      "rotary_embedding " +
      (far_positions ? "positions<=65535 rows=" + std::to_string(rows) : l.name) +
      " H=" + std::to_string(H) + " D=" + std::to_string(D) +
      (x_extra ? " x_stride=" + std::to_string(xs) : "") + " " + type_name(type);
  cu::rotary_embedding(d_x.data(), type, d_pos.as<int32_t>(), rows, H, D, x_extra ? xs : 0, 1,
                       nullptr);
  sync();
  const std::vector<double> fwd = from_device(d_x.data(), size_t(rows * xs), type);
  // The columns past H D (another tensor's) must be untouched.
  std::vector<double> got, want, pad_got, pad_want;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < xs; ++i) {
      const size_t at = size_t(r * xs + i);
      if (i < H * D) {
        got.push_back(fwd[at]);
        want.push_back(ref[at]);
      } else {
        pad_got.push_back(fwd[at]);
        pad_want.push_back(x0[at]);
      }
    }
  report(tally, tag + " forward", rel_error(got, want), out_tol(type));
  if (x_extra)
    report(tally, tag + " columns past H D untouched", rel_error(pad_got, pad_want), 0.0);

  // Backward (direction -1) of the forward's output: the input again.
  cu::rotary_embedding(d_x.data(), type, d_pos.as<int32_t>(), rows, H, D, x_extra ? xs : 0, -1,
                       nullptr);
  sync();
  report(tally, tag + " backward(forward(x)) = x",
         rel_error(from_device(d_x.data(), size_t(rows * xs), type), x0), out_tol(type));

  // The backward on its own: the transpose of the rotation applied to a fresh gradient.
  const DeviceArray d_g = to_device(random_values(size_t(rows * xs), fresh_seed()), type);
  std::vector<double> g_ref = d_g.rounded;
  rotary_reference(g_ref, pos, H, D, xs, -1);
  cu::rotary_embedding(d_g.data(), type, d_pos.as<int32_t>(), rows, H, D, x_extra ? xs : 0, -1,
                       nullptr);
  sync();
  report(tally, tag + " backward",
         rel_error(from_device(d_g.data(), size_t(rows * xs), type), g_ref), out_tol(type));
}

// ---- L2 row norm ----

// x values uniform in [-scale, scale): scale 1e-9 puts every row below the 1e-6 norm floor.
void check_l2norm(int64_t rows, int64_t D, float scale, ElementType y_type, ElementType dy_type,
                  bool dx_aliases_dy, Tally& tally) {
  const std::vector<float> x = random_values(size_t(rows * D), fresh_seed(), scale);
  const std::vector<double> xd = widen(x);
  std::vector<double> y_ref(xd.size());
  act::l2norm_rows<double>(xd.data(), rows, D, y_ref.data());
  const DeviceBuffer d_x = upload(x);
  DeviceBuffer d_y = poisoned(size_t(rows * D) * cu::element_bytes(y_type));
  cu::l2norm_rows_forward(d_x.as<float>(), rows, D, {d_y.data(), y_type, 0}, nullptr);
  sync();
  const std::string dims = " rows=" + std::to_string(rows) + " D=" + std::to_string(D) +
                           (scale < 1e-6f ? " |x|<eps" : "");
  report(tally, "l2norm_rows_forward" + dims + " y " + type_name(y_type),
         rel_error(from_device(d_y.data(), y_ref.size(), y_type), y_ref), out_tol(y_type));

  DeviceArray d_dy = to_device(random_values(size_t(rows * D), fresh_seed()), dy_type);
  std::vector<double> dx_ref(xd.size());
  act::l2norm_rows_backward<double>(xd.data(), d_dy.rounded.data(), rows, D, dx_ref.data());
  DeviceBuffer d_dx = poisoned(size_t(rows * D) * sizeof(float));
  float* dx = dx_aliases_dy ? static_cast<float*>(d_dy.data()) : d_dx.as<float>();
  cu::l2norm_rows_backward(d_x.as<float>(), d_dy.data(), dy_type, rows, D, dx, nullptr);
  sync();
  report(
      tally,
      "l2norm_rows_backward" + dims + " dy " + type_name(dy_type) + (dx_aliases_dy ? " dx=dy" : ""),
      rel_error(widen(download(dx, dx_ref.size())), dx_ref), kGradTol);
}

// ---- sigmoid ----

void check_sigmoid(int64_t n, ElementType beta_type, ElementType dbeta_type, Tally& tally) {
  const std::vector<float> braw = random_values(size_t(n), fresh_seed(), 6.f);
  std::vector<double> beta_ref(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) beta_ref[i] = act::sigmoid<double>(braw[i]);
  const DeviceBuffer d_braw = upload(braw);
  DeviceBuffer d_beta = poisoned(size_t(n) * cu::element_bytes(beta_type));
  cu::sigmoid_forward(d_braw.as<float>(), n, d_beta.data(), beta_type, nullptr);
  const DeviceArray d_dbeta = to_device(random_values(size_t(n), fresh_seed()), dbeta_type);
  std::vector<double> dbraw_ref(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    dbraw_ref[i] = d_dbeta.rounded[i] * beta_ref[i] * (1.0 - beta_ref[i]);
  DeviceBuffer d_dbraw = poisoned(size_t(n) * sizeof(float));
  cu::sigmoid_backward(d_braw.as<float>(), d_dbeta.data(), dbeta_type, n, d_dbraw.as<float>(),
                       nullptr);
  sync();
  const std::string tag = "sigmoid n=" + std::to_string(n);
  report(tally, tag + " forward beta " + type_name(beta_type),
         rel_error(from_device(d_beta.data(), size_t(n), beta_type), beta_ref), out_tol(beta_type));
  report(tally, tag + " backward dbeta " + type_name(dbeta_type),
         rel_error(widen(download(d_dbraw.data(), size_t(n))), dbraw_ref), kGradTol);
}

// ---- Gated DeltaNet's scalar gate ----

void check_scalar_gate(int64_t rows, int64_t H, ElementType g_type, ElementType dg_type,
                       Tally& tally) {
  std::vector<float> graw = random_values(size_t(rows * H), fresh_seed(), 4.f);
  for (size_t i = 3; i < graw.size(); i += 7) graw[i] = 25.f;  // softplus's linear branch
  const std::vector<float> A_log = random_values(size_t(H), fresh_seed());
  const std::vector<float> dt_bias = random_values(size_t(H), fresh_seed());
  const std::vector<float> dA0 = random_values(size_t(H), fresh_seed());
  const std::vector<float> ddt0 = random_values(size_t(H), fresh_seed());
  const DeviceArray d_dg = to_device(random_values(size_t(rows * H), fresh_seed()), dg_type);
  const std::vector<double>& dg = d_dg.rounded;

  std::vector<double> g_ref(size_t(rows * H)), dgraw_ref(size_t(rows * H));
  std::vector<double> dA_ref(dA0.begin(), dA0.end()), ddt_ref(ddt0.begin(), ddt0.end());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < H; ++h) {
      const size_t i = size_t(r * H + h);
      const double a = std::exp(double(A_log[h])), xg = double(graw[i]) + dt_bias[h];
      g_ref[i] = -a * act::softplus<double>(xg);
      dgraw_ref[i] = -a * act::sigmoid<double>(xg) * dg[i];
      dA_ref[h] += g_ref[i] * dg[i];
      ddt_ref[h] += dgraw_ref[i];
    }

  const DeviceBuffer d_graw = upload(graw), d_A = upload(A_log), d_dt = upload(dt_bias);
  DeviceBuffer d_g = poisoned(size_t(rows * H) * cu::element_bytes(g_type));
  cu::scalar_gate_forward(d_graw.as<float>(), d_A.as<float>(), d_dt.as<float>(), rows, H,
                          d_g.data(), g_type, nullptr);
  sync();
  const std::string tag = "scalar_gate rows=" + std::to_string(rows) + " H=" + std::to_string(H);
  report(tally, tag + " forward g " + type_name(g_type),
         rel_error(from_device(d_g.data(), g_ref.size(), g_type), g_ref), out_tol(g_type));

  cu::TrainScratch scratch;
  std::vector<float> runs[2][3];
  for (int run = 0; run < 2; ++run) {
    DeviceBuffer d_dgraw = poisoned(size_t(rows * H) * sizeof(float));
    DeviceBuffer d_dA = upload(dA0), d_ddt = upload(ddt0);
    cu::scalar_gate_backward(d_graw.as<float>(), d_A.as<float>(), d_dt.as<float>(), d_dg.data(),
                             dg_type, rows, H, d_dgraw.as<float>(), d_dA.as<float>(),
                             d_ddt.as<float>(), scratch, nullptr);
    sync();
    runs[run][0] = download(d_dgraw.data(), size_t(rows * H));
    runs[run][1] = download(d_dA.data(), size_t(H));
    runs[run][2] = download(d_ddt.data(), size_t(H));
  }
  const std::string btag = tag + " backward dg " + type_name(dg_type);
  report(tally, btag + " dgraw", rel_error(widen(runs[0][0]), dgraw_ref), kGradTol);
  report(tally, btag + " dA_log (accumulated)", rel_error(widen(runs[0][1]), dA_ref), kGradTol);
  report(tally, btag + " ddt_bias (accumulated)", rel_error(widen(runs[0][2]), ddt_ref), kGradTol);
  bool same = true;
  for (int k = 0; k < 3; ++k) same = same && same_bits(runs[0][k], runs[1][k]);
  report_same(tally, btag + " deterministic", same);
}

void check_argument_errors(Tally& tally) {
  cu::TrainScratch scratch;
  float* bogus = reinterpret_cast<float*>(uintptr_t(256));  // never dereferenced
  const int32_t* bogus_pos = reinterpret_cast<const int32_t*>(bogus);
  DeviceBuffer y(64);
  report_throws(tally, "short_conv_silu_train_forward W=5", [&] {
    cu::short_conv_silu_train_forward(bogus, bogus_pos, 4, 8, 0, bogus, 5, {y.data(), f32, 0},
                                      nullptr);
  });
  report_throws(tally, "short_conv_silu_train_forward x_stride < C", [&] {
    cu::short_conv_silu_train_forward(bogus, bogus_pos, 4, 8, 6, bogus, 4, {y.data(), f32, 0},
                                      nullptr);
  });
  report_throws(tally, "short_conv_silu_train_backward dx aliasing dy", [&] {
    cu::short_conv_silu_train_backward(bogus, bogus_pos, 4, 8, 0, bogus, 4, bogus, f32, bogus,
                                       bogus, scratch, nullptr);
  });
  report_throws(tally, "rotary_embedding odd D",
                [&] { cu::rotary_embedding(bogus, f32, bogus_pos, 4, 2, 7, 0, 1, nullptr); });
  report_throws(tally, "rotary_embedding direction 0",
                [&] { cu::rotary_embedding(bogus, f32, bogus_pos, 4, 2, 8, 0, 0, nullptr); });
  report_throws(tally, "scalar_gate_forward H=0",
                [&] { cu::scalar_gate_forward(bogus, bogus, bogus, 4, 0, bogus, f32, nullptr); });
  report_throws(tally, "l2norm_rows_forward D=0", [&] {
    cu::l2norm_rows_forward(bogus, 4, 0, {y.data(), f32, 0}, nullptr);
  });
  const std::vector<int64_t> bad_start = {1, 4, 6}, bad_end = {0, 4, 5}, decreasing = {0, 4, 2, 6};
  report_throws(tally, "sequence_positions cu_seqlens not starting at 0", [&] {
    cu::sequence_positions(bad_start, 1, 6, reinterpret_cast<int32_t*>(bogus), nullptr);
  });
  report_throws(tally, "sequence_positions cu_seqlens not ending at B T", [&] {
    cu::sequence_positions(bad_end, 1, 6, reinterpret_cast<int32_t*>(bogus), nullptr);
  });
  report_throws(tally, "sequence_positions decreasing cu_seqlens", [&] {
    cu::sequence_positions(decreasing, 1, 6, reinterpret_cast<int32_t*>(bogus), nullptr);
  });
}

void run_lineage_ops(const SuiteOptions& options, Tally& tally) {
  if (!options.check) return;
  const Layout small = packed_small(), longer = packed_long(), bt = batch(3, 7), one = batch(1, 1);

  for (const Layout& l : {small, longer, bt, one, batch(4, 33)}) check_sequence_positions(l, tally);

  // layout, C, W, extra x columns (a slice of a wider projection), y type, extra y columns
  check_conv_forward(small, 64, 4, 0, f32, 0, tally);
  check_conv_forward(small, 128, 4, 64, bf16, 0, tally);
  check_conv_forward(small, 64, 3, 0, f32, 32, tally);
  check_conv_forward(small, 64, 2, 0, f32, 0, tally);
  check_conv_forward(small, 64, 1, 0, f32, 0, tally);
  check_conv_forward(bt, 128, 4, 0, f32, 0, tally);
  check_conv_forward(one, 64, 4, 0, f32, 0, tally);
  check_conv_forward(longer, 128, 4, 128, f32, 0, tally);
  check_conv_forward(small, 37, 4, 3, f32, 0, tally);

  // layout, C, W, extra x columns, dy type
  check_conv_backward(small, 64, 4, 0, f32, tally);
  check_conv_backward(small, 128, 4, 64, bf16, tally);
  check_conv_backward(small, 64, 3, 0, f32, tally);
  check_conv_backward(small, 64, 2, 0, bf16, tally);
  check_conv_backward(small, 64, 1, 0, f32, tally);
  check_conv_backward(bt, 128, 4, 0, f32, tally);
  check_conv_backward(one, 64, 4, 0, f32, tally);
  check_conv_backward(longer, 128, 4, 256, f32, tally);
  check_conv_backward(longer, 64, 4, 0, bf16, tally);
  check_conv_backward(small, 37, 4, 3, f32, tally);

  check_conv_against_cpu(small, 64, 0, tally);
  check_conv_against_cpu(longer, 128, 256, tally);
  check_conv_against_cpu(bt, 128, 0, tally);
  check_conv_against_cpu(one, 64, 0, tally);

  // layout, C, W, extra x columns, dy type, dx type, dx column offset and row width: the trainer's
  // KDA use (x a block of [q | k | v] rows, dx a bf16 block of [dq | dk | dv | dg] rows; 8192 rows
  // of 768 columns: row chunks of 24), packed rows over many chunks, every width, one row
  check_conv_backward_into_block(batch(2, 4096), 768, 4, 2 * 768, bf16, bf16, 768, 4 * 768, tally);
  check_conv_backward_into_block(longer, 64, 4, 128, bf16, bf16, 128, 256, tally);
  check_conv_backward_into_block(longer, 64, 4, 0, f32, bf16, 0, 192, tally);
  check_conv_backward_into_block(small, 64, 3, 0, bf16, bf16, 64, 128, tally);
  check_conv_backward_into_block(small, 64, 2, 0, f32, f32, 32, 160, tally);
  check_conv_backward_into_block(small, 37, 1, 3, f32, bf16, 5, 50, tally);
  check_conv_backward_into_block(bt, 128, 4, 0, bf16, f32, 128, 256, tally);
  check_conv_backward_into_block(one, 64, 4, 0, bf16, bf16, 64, 192, tally);
  check_conv_backward_block_errors(tally);

  // layout, H, D, extra x columns, type, far positions
  check_rotary(small, 2, 64, 0, f32, false, tally);
  check_rotary(small, 6, 128, 0, f32, false, tally);
  check_rotary(small, 6, 64, 0, bf16, false, tally);
  check_rotary(bt, 2, 128, 2 * 2 * 128, f32, false, tally);  // q of a [q | k | v] projection
  check_rotary(bt, 6, 64, 0, bf16, false, tally);
  check_rotary(one, 2, 64, 0, f32, false, tally);
  check_rotary(longer, 6, 128, 0, f32, false, tally);
  check_rotary(longer, 2, 64, 0, f32, true, tally);
  check_rotary(small, 6, 128, 0, bf16, true, tally);
  // the scalar kernel (D / 2 not a multiple of 8; a row stride not a multiple of 4), and the
  // trainer's layout: q and k side by side (2 H heads) in [q | k | v] rows
  check_rotary(small, 3, 12, 0, f32, false, tally);
  check_rotary(bt, 2, 64, 2, bf16, false, tally);
  check_rotary(bt, 4, 128, 2 * 128, bf16, false, tally);

  // rows (tokens x heads), D, x scale, y type, dy type, dx aliasing dy
  check_l2norm(66 * 2, 64, 1.f, f32, f32, false, tally);
  check_l2norm(66 * 6, 128, 1.f, bf16, bf16, false, tally);
  check_l2norm(21 * 6, 128, 1.f, f32, f32, true, tally);
  check_l2norm(1, 64, 1.f, f32, f32, false, tally);
  check_l2norm(2000 * 2, 64, 1.f, bf16, f32, false, tally);
  check_l2norm(7, 100, 1.f, f32, bf16, false, tally);   // the scalar path
  check_l2norm(3, 2048, 1.f, f32, f32, false, tally);   // a block per row
  check_l2norm(12, 64, 1e-9f, f32, f32, false, tally);  // below the norm floor

  // n (tokens x heads), beta type, dbeta type
  check_sigmoid(66 * 2, f32, f32, tally);
  check_sigmoid(66 * 6, bf16, bf16, tally);
  check_sigmoid(1, f32, bf16, tally);
  check_sigmoid(2000 * 6, f32, f32, tally);

  // rows, H, g type, dg type
  check_scalar_gate(66, 2, f32, f32, tally);
  check_scalar_gate(66, 6, bf16, bf16, tally);
  check_scalar_gate(1, 2, f32, f32, tally);
  check_scalar_gate(21, 6, f32, bf16, tally);
  check_scalar_gate(2000, 6, f32, f32, tally);
  check_scalar_gate(20000, 2, f32, f32, tally);  // many row chunks

  check_argument_errors(tally);
}

// RoPE at the 125M trainer's shape (q and k of [q | k | v] bf16 rows, 8 x 2048 tokens, 2 x 6
// heads of 128), in place. (Measured on the H200: 52 us, 1.94 TB/s; reading cos / sin from a
// precomputed table instead, with a thread per head so that no load waits on a store, took
// the same 51.7 us: the fp64 angles are not what bounds it.)
void bench_rotary() {
  const int64_t rows = 16384, H = 12, D = 128, xs = 3 * 768;
  const DeviceArray x =
      to_device(random_values(size_t(rows * xs), fresh_seed()), ElementType::bf16);
  std::vector<int32_t> pos(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) pos[size_t(r)] = int32_t(r % 2048);
  const DeviceBuffer d_pos = upload_ints(pos);
  const double ms = time_ms(nullptr, [&] {
    cu::rotary_embedding(x.data(), ElementType::bf16, d_pos.as<int32_t>(), rows, H, D, xs, 1,
                         nullptr);
  });
  const double gb = 2.0 * double(rows * H * D) * 2 / 1e9;  // read + write
  std::printf(
      "BENCH lineage_ops rotary bf16 rows=%lld H=%lld D=%lld x_stride=%lld: %.1f us (%.0f "
      "GB/s)\n",
      (long long)rows, (long long)H, (long long)D, (long long)xs, ms * 1e3, gb / (ms * 1e-3));
  std::fflush(stdout);
}

// The short convolution + SiLU at the hybrid trainer's shape (one of q / k / v: fp32 columns of
// [q | k | v] rows, 8 x 2048 tokens, 768 channels, width 4): the forward into bf16 rows, the
// backward from bf16 dy into a bf16 column block of [dq | dk | dv | dg] rows (+ dweight).
// Bytes: the forward reads x, writes y; the backward reads x and dy, writes dx.
void bench_short_conv() {
  const int64_t rows = 16384, C = 768, W = 4, xs = 3 * C, dxs = 4 * C;
  const std::vector<float> x = random_values(size_t(rows * xs), fresh_seed());
  const std::vector<float> w = random_values(size_t(C * W), fresh_seed(), 0.8f);
  std::vector<int32_t> pos(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) pos[size_t(r)] = int32_t(r % 2048);
  const DeviceBuffer d_x = upload(x), d_w = upload(w), d_pos = upload_ints(pos);
  const DeviceArray dy =
      to_device(random_values(size_t(rows * C), fresh_seed()), ElementType::bf16);
  DeviceBuffer d_y(size_t(rows * C) * 2), d_dx(size_t(rows * dxs) * 2), d_dw = upload(w);
  cu::TrainScratch scratch;
  const double fwd_ms = time_ms(nullptr, [&] {
    cu::short_conv_silu_train_forward(d_x.as<float>(), d_pos.as<int32_t>(), rows, C, xs,
                                      d_w.as<float>(), W, {d_y.data(), ElementType::bf16, 0},
                                      nullptr);
  });
  const double bwd_ms = time_ms(nullptr, [&] {
    cu::short_conv_silu_train_backward(d_x.as<float>(), d_pos.as<int32_t>(), rows, C, xs,
                                       d_w.as<float>(), W, dy.data(), ElementType::bf16,
                                       {d_dx.data(), ElementType::bf16, dxs}, d_dw.as<float>(),
                                       scratch, nullptr);
  });
  const double fwd_gb = double(rows * C) * (4 + 2) / 1e9,
               bwd_gb = double(rows * C) * (4 + 2 + 2) / 1e9;
  std::printf(
      "BENCH lineage_ops short_conv rows=%lld C=%lld W=%lld: forward %.1f us (%.0f GB/s), "
      "backward %.1f us (%.0f GB/s)\n",
      (long long)rows, (long long)C, (long long)W, fwd_ms * 1e3, fwd_gb / (fwd_ms * 1e-3),
      bwd_ms * 1e3, bwd_gb / (bwd_ms * 1e-3));
  std::fflush(stdout);
}

void run_suite(const SuiteOptions& options, Tally& tally) {
  if (options.check) run_lineage_ops(options, tally);
  if (options.bench) {
    bench_rotary();
    bench_short_conv();
  }
}

const bool registered = register_suite("lineage_ops", run_suite);

}  // namespace
}  // namespace kda::gpu_check
