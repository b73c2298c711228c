// Suite "train": the training kernels of ops/nn/cuda/train_cuda.h against float64 references of
// the CPU training functions (train/layers.cpp, train/adamw.cpp, train/hf_gpt2.cpp's layer norm
// and GELU backward; reimplemented here: kda_gpu_model does not link kda_train). Fresh random
// inputs (never zeros), poisoned outputs, accumulated gradients starting from random values.
// fp32 results are held to 1e-5 relative, bf16 logits to 1e-2; every reducing kernel is also run
// twice and must give the same bits; the embedding backward (a sequential sum in row order) must
// equal the CPU's float scatter-add bit for bit.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "bench/gpu/model/gpu_suite.h"
#include "core/error.h"
#include "ops/nn/cuda/train_cuda.h"

namespace kda::gpu_check {
namespace {

namespace cu = ops::cuda;

uint64_t fresh_seed() {
  static uint64_t next = 0x7a1a5eedull;
  return next++;
}

constexpr double kTol = 1e-5;

void sync() {
  cu::check_cuda(cudaDeviceSynchronize(), "train check sync");
}

// A poisoned fp32 device array of n values.
DeviceBuffer poisoned(size_t n) {
  DeviceBuffer b(n * sizeof(float));
  poison(b.data(), b.bytes());
  return b;
}

std::string dims(int64_t rows, int64_t D) {
  return " rows=" + std::to_string(rows) + " D=" + std::to_string(D);
}

// ---- RMSNorm ----

// The CPU's inv_rms (float of a double computation), which the backward is given.
std::vector<float> cpu_inv_rms(const std::vector<float>& x, int64_t rows, int64_t D, float eps) {
  std::vector<float> inv(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += double(x[r * D + i]) * x[r * D + i];
    inv[r] = float(1.0 / std::sqrt(ss / double(D) + eps));
  }
  return inv;
}

void check_rms_forward(int64_t rows, int64_t D, ElementType out, Tally& tally) {
  const float eps = 1e-6f;
  const std::vector<float> x = random_values(size_t(rows * D), fresh_seed(), 2.f);
  std::vector<float> w = random_values(size_t(D), fresh_seed());
  for (float& v : w) v += 1.0f;
  const DeviceBuffer dx = upload(x), dw = upload(w);
  DeviceBuffer y(size_t(rows * D) * cu::element_bytes(out));
  poison(y.data(), y.bytes());
  DeviceBuffer inv = poisoned(static_cast<size_t>(rows));
  cu::rms_norm_forward_train(dx.as<float>(), rows, D, dw.as<float>(), eps, {y.data(), out, 0},
                             inv.as<float>(), nullptr);
  sync();
  std::vector<double> y_ref(size_t(rows * D)), inv_ref(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < D; ++i) ss += double(x[r * D + i]) * x[r * D + i];
    inv_ref[r] = 1.0 / std::sqrt(ss / double(D) + eps);
    for (int64_t i = 0; i < D; ++i) y_ref[r * D + i] = x[r * D + i] * inv_ref[r] * w[i];
  }
  const std::string tag = "rms_norm_forward_train" + dims(rows, D);
  report(tally, tag + (out == ElementType::bf16 ? " y bf16" : " y f32"),
         rel_error(from_device(y.data(), y_ref.size(), out), y_ref),
         out == ElementType::bf16 ? 1e-2 : kTol);
  report(tally, tag + " inv_rms", rel_error(widen(download(inv.data(), size_t(rows))), inv_ref),
         kTol);
}

// accumulate: dx starts as random values and the gradient is added to them (the residual).
// with_copy: dx's bf16 copy (the trainer's next GEMM input) must be the final dx rounded to bf16,
// bit for bit.
void check_rms_backward(int64_t rows, int64_t D, bool dx_aliases_dy, Tally& tally,
                        bool accumulate = false, bool with_copy = false) {
  const std::vector<float> x = random_values(size_t(rows * D), fresh_seed(), 2.f);
  const std::vector<float> dy = random_values(size_t(rows * D), fresh_seed());
  std::vector<float> w = random_values(size_t(D), fresh_seed());
  for (float& v : w) v += 1.0f;
  const std::vector<float> dw0 = random_values(size_t(D), fresh_seed());
  const std::vector<float> inv = cpu_inv_rms(x, rows, D, 1e-6f);

  const std::vector<float> dx0 = random_values(size_t(rows * D), fresh_seed());
  std::vector<double> dx_ref(size_t(rows * D)), dw_ref(dw0.begin(), dw0.end());
  for (int64_t r = 0; r < rows; ++r) {
    double dot = 0;
    for (int64_t i = 0; i < D; ++i) dot += double(dy[r * D + i]) * w[i] * x[r * D + i];
    const double c = dot / double(D) * double(inv[r]) * inv[r] * inv[r];
    for (int64_t i = 0; i < D; ++i) {
      dx_ref[r * D + i] = double(dy[r * D + i]) * w[i] * inv[r] - x[r * D + i] * c +
                          (accumulate ? dx0[r * D + i] : 0.0);
      dw_ref[i] += double(dy[r * D + i]) * x[r * D + i] * inv[r];
    }
  }

  const DeviceBuffer d_x = upload(x), d_w = upload(w), d_inv = upload(inv);
  cu::TrainScratch scratch;
  std::vector<float> dx_runs[2], dw_runs[2];
  std::vector<double> copy;
  for (int run = 0; run < 2; ++run) {
    DeviceBuffer d_dy = upload(dy), d_dw = upload(dw0);
    DeviceBuffer d_dx = accumulate ? upload(dx0) : poisoned(size_t(rows * D));
    DeviceBuffer d_copy(with_copy ? size_t(rows * D) * 2 : 0);
    if (with_copy) poison(d_copy.data(), d_copy.bytes());
    float* dx_ptr = dx_aliases_dy ? d_dy.as<float>() : d_dx.as<float>();
    cu::rms_norm_backward(d_x.as<float>(), d_dy.as<float>(), rows, D, d_w.as<float>(),
                          d_inv.as<float>(), dx_ptr, d_dw.as<float>(), scratch, nullptr, accumulate,
                          with_copy ? d_copy.data() : nullptr);
    sync();
    dx_runs[run] = download(dx_ptr, size_t(rows * D));
    dw_runs[run] = download(d_dw.data(), size_t(D));
    if (with_copy && run == 0)
      copy = from_device(d_copy.data(), size_t(rows * D), ElementType::bf16);
  }
  const std::string tag = "rms_norm_backward" + dims(rows, D) + (dx_aliases_dy ? " dx=dy" : "") +
                          (accumulate ? " dx accumulated" : "") + (with_copy ? " bf16 copy" : "");
  report(tally, tag + " dx", rel_error(widen(dx_runs[0]), dx_ref), kTol);
  report(tally, tag + " dw (accumulated)", rel_error(widen(dw_runs[0]), dw_ref), kTol);
  report_same(tally, tag + " deterministic",
              same_bits(dx_runs[0], dx_runs[1]) && same_bits(dw_runs[0], dw_runs[1]));
  if (with_copy) {
    int64_t mismatches = 0;  // (a NaN never equals)
    for (size_t i = 0; i < copy.size(); ++i)
      mismatches += !(copy[i] == double(bf16_to_f32(f32_to_bf16(dx_runs[0][i]))));
    report(tally, tag + " copy equals the rounded dx", double(mismatches), 0.0);
  }
}

// ---- LayerNorm backward ----

void check_layer_norm_backward(int64_t rows, int64_t D, bool accumulate, bool dx_aliases_dy,
                               Tally& tally) {
  const float eps = 1e-5f;
  std::vector<float> x = random_values(size_t(rows * D), fresh_seed(), 2.f);
  for (float& v : x) v += 0.7f;  // a non-zero mean
  const std::vector<float> dy = random_values(size_t(rows * D), fresh_seed());
  const std::vector<float> w = random_values(size_t(D), fresh_seed());
  const std::vector<float> dx0 = random_values(size_t(rows * D), fresh_seed());
  const std::vector<float> dw0 = random_values(size_t(D), fresh_seed());
  const std::vector<float> db0 = random_values(size_t(D), fresh_seed());

  std::vector<double> dx_ref(size_t(rows * D)), dw_ref(dw0.begin(), dw0.end()),
      db_ref(db0.begin(), db0.end());
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x.data() + r * D;
    double mean = 0, var = 0;
    for (int64_t i = 0; i < D; ++i) mean += xr[i];
    mean /= double(D);
    for (int64_t i = 0; i < D; ++i) var += (xr[i] - mean) * (xr[i] - mean);
    var /= double(D);
    const double rstd = 1.0 / std::sqrt(var + eps);
    double sum_g = 0, sum_gx = 0;
    for (int64_t i = 0; i < D; ++i) {
      const double g = double(dy[r * D + i]) * w[i];
      sum_g += g;
      sum_gx += g * (xr[i] - mean) * rstd;
    }
    const double mg = sum_g / double(D), mgx = sum_gx / double(D);
    for (int64_t i = 0; i < D; ++i) {
      const double xhat = (xr[i] - mean) * rstd;
      const double grad = rstd * (double(dy[r * D + i]) * w[i] - mg - xhat * mgx);
      dx_ref[r * D + i] = accumulate ? dx0[r * D + i] + grad : grad;
      dw_ref[i] += dy[r * D + i] * xhat;
      db_ref[i] += dy[r * D + i];
    }
  }

  const DeviceBuffer d_x = upload(x), d_w = upload(w);
  cu::TrainScratch scratch;
  std::vector<float> runs[2][3];
  for (int run = 0; run < 2; ++run) {
    DeviceBuffer d_dy = upload(dy), d_dw = upload(dw0), d_db = upload(db0);
    DeviceBuffer d_dx = accumulate ? upload(dx0) : poisoned(size_t(rows * D));
    float* dx_ptr = dx_aliases_dy ? d_dy.as<float>() : d_dx.as<float>();
    cu::layer_norm_backward(d_x.as<float>(), d_dy.as<float>(), rows, D, d_w.as<float>(), eps,
                            dx_ptr, d_dw.as<float>(), d_db.as<float>(), accumulate, scratch,
                            nullptr);
    sync();
    runs[run][0] = download(dx_ptr, size_t(rows * D));
    runs[run][1] = download(d_dw.data(), size_t(D));
    runs[run][2] = download(d_db.data(), size_t(D));
  }
  const std::string tag = "layer_norm_backward" + dims(rows, D) + (accumulate ? " dx+=" : " dx=") +
                          (dx_aliases_dy ? " dx=dy" : "");
  report(tally, tag + " dx", rel_error(widen(runs[0][0]), dx_ref), kTol);
  report(tally, tag + " dw (accumulated)", rel_error(widen(runs[0][1]), dw_ref), kTol);
  report(tally, tag + " db (accumulated)", rel_error(widen(runs[0][2]), db_ref), kTol);
  bool same = true;
  for (int k = 0; k < 3; ++k) same = same && same_bits(runs[0][k], runs[1][k]);
  report_same(tally, tag + " deterministic", same);
}

// ---- activations ----

void check_gelu_backward(int64_t n, bool in_place, Tally& tally) {
  const std::vector<float> x = random_values(size_t(n), fresh_seed(), 4.f);
  const std::vector<float> dy = random_values(size_t(n), fresh_seed());
  std::vector<double> ref(static_cast<size_t>(n));
  const double c = 0.7978845608028654, cubic = 0.044715;
  for (int64_t i = 0; i < n; ++i) {
    const double v = x[i];
    const double t = std::tanh(c * (v + cubic * v * v * v));
    ref[i] = dy[i] * (0.5 * (1 + t) + 0.5 * v * (1 - t * t) * c * (1 + 3 * cubic * v * v));
  }
  const DeviceBuffer d_x = upload(x);
  DeviceBuffer d_dy = upload(dy), d_dx = poisoned(static_cast<size_t>(n));
  float* out = in_place ? d_dy.as<float>() : d_dx.as<float>();
  cu::gelu_tanh_backward(d_x.as<float>(), d_dy.as<float>(), n, out, nullptr);
  sync();
  report(tally, "gelu_tanh_backward n=" + std::to_string(n) + (in_place ? " in place" : ""),
         rel_error(widen(download(out, size_t(n))), ref), kTol);
}

void check_swiglu_backward(int64_t rows, int64_t I, bool in_place, Tally& tally) {
  const std::vector<float> gate_up = random_values(size_t(rows * 2 * I), fresh_seed(), 4.f);
  const std::vector<float> dh = random_values(size_t(rows * I), fresh_seed());
  std::vector<double> ref(size_t(rows * 2 * I));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < I; ++i) {
      const double a = gate_up[r * 2 * I + i], b = gate_up[r * 2 * I + I + i], g = dh[r * I + i];
      const double s = 1.0 / (1.0 + std::exp(-a));
      ref[r * 2 * I + I + i] = g * a * s;
      ref[r * 2 * I + i] = g * b * s * (1.0 + a * (1.0 - s));
    }
  DeviceBuffer d_gu = upload(gate_up), d_dh = upload(dh), d_out = poisoned(size_t(rows * 2 * I));
  float* out = in_place ? d_gu.as<float>() : d_out.as<float>();
  cu::swiglu_backward(d_gu.as<float>(), d_dh.as<float>(), rows, I, out, nullptr);
  sync();
  report(tally,
         "swiglu_backward rows=" + std::to_string(rows) + " I=" + std::to_string(I) +
             (in_place ? " in place" : ""),
         rel_error(widen(download(out, ref.size())), ref), kTol);
  if (in_place) return;
  // bf16 gradients (what the lineage trainer's GEMMs read next)
  DeviceBuffer d_bf(size_t(rows * 2 * I) * 2);
  poison(d_bf.data(), d_bf.bytes());
  cu::swiglu_backward(d_gu.as<float>(), d_dh.as<float>(), rows, I, d_bf.data(), ElementType::bf16,
                      nullptr);
  sync();
  report(tally,
         "swiglu_backward rows=" + std::to_string(rows) + " I=" + std::to_string(I) + " bf16",
         rel_error(from_device(d_bf.data(), ref.size(), ElementType::bf16), ref), 8e-3);
}

// SwiGLU forward and backward over pre-activations and d(act) of either type (the lineage
// trainer keeps both in bf16): against float64 on the rounded inputs; fp32 results to kTol, bf16
// ones to 4e-3 (one rounding, <= 2^-9 relative per element). Also in place over a bf16 gate_up,
// and the refusal to overwrite gate_up with gradients of another type.
void check_swiglu_typed(int64_t rows, int64_t I, Tally& tally) {
  constexpr ElementType f32 = ElementType::f32, bf16 = ElementType::bf16;
  const auto name = [](ElementType t) { return t == bf16 ? std::string("bf16") : "f32"; };
  const std::string shape = " rows=" + std::to_string(rows) + " I=" + std::to_string(I);
  const auto tol = [](ElementType t) { return t == bf16 ? 4e-3 : kTol; };
  const size_t n_in = size_t(rows * 2 * I), n_act = size_t(rows * I);
  for (ElementType in : {bf16, f32}) {
    const std::vector<float> values = random_values(n_in, fresh_seed(), 4.f);
    const DeviceArray gu = to_device(values, in);
    const std::vector<double>& x = gu.rounded;
    // forward: y = silu(a) * b, dense and into rows 4 wider than I
    std::vector<double> y_ref(n_act);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < I; ++i) {
        const double a = x[r * 2 * I + i], b = x[r * 2 * I + I + i];
        y_ref[r * I + i] = a / (1.0 + std::exp(-a)) * b;
      }
    for (ElementType out : {f32, bf16})
      for (int64_t stride : {int64_t(0), I + 4}) {
        const int64_t ys = stride > 0 ? stride : I;
        DeviceBuffer y(size_t(rows * ys) * element_bytes(out));
        poison(y.data(), y.bytes());
        cu::swiglu(gu.data(), in, rows, I, {y.data(), out, stride}, nullptr);
        sync();
        const std::vector<double> all = from_device(y.data(), size_t(rows * ys), out);
        std::vector<double> got(n_act);
        for (int64_t r = 0; r < rows; ++r)
          std::copy(all.begin() + r * ys, all.begin() + r * ys + I, got.begin() + r * I);
        report(tally,
               "swiglu" + shape + " ys=" + std::to_string(stride) + " " + name(in) + " -> " +
                   name(out),
               rel_error(got, y_ref), tol(out));
      }
    // backward: da = g b s (1 + a (1 - s)), db = g a s with s = sigmoid(a)
    for (ElementType dh_type : {bf16, f32}) {
      const DeviceArray dh = to_device(random_values(n_act, fresh_seed()), dh_type);
      std::vector<double> ref(n_in);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < I; ++i) {
          const double a = x[r * 2 * I + i], b = x[r * 2 * I + I + i], g = dh.rounded[r * I + i];
          const double s = 1.0 / (1.0 + std::exp(-a));
          ref[r * 2 * I + i] = g * b * s * (1.0 + a * (1.0 - s));
          ref[r * 2 * I + I + i] = g * a * s;
        }
      const std::string tag =
          "swiglu_backward" + shape + " gate_up " + name(in) + " dh " + name(dh_type);
      for (ElementType out : {f32, bf16}) {
        DeviceBuffer d(n_in * element_bytes(out));
        poison(d.data(), d.bytes());
        cu::swiglu_backward(gu.data(), in, dh.data(), dh_type, rows, I, d.data(), out, nullptr);
        sync();
        report(tally, tag + " -> " + name(out), rel_error(from_device(d.data(), n_in, out), ref),
               tol(out));
      }
      // in place: gradients of gate_up's own type over it
      const DeviceArray inplace = to_device(values, in);
      cu::swiglu_backward(inplace.data(), in, dh.data(), dh_type, rows, I, inplace.data(), in,
                          nullptr);
      sync();
      report(tally, tag + " in place", rel_error(from_device(inplace.data(), n_in, in), ref),
             tol(in));
      const ElementType other = in == bf16 ? f32 : bf16;
      report_throws(tally, tag + " -> " + name(other) + " over gate_up", [&] {
        cu::swiglu_backward(gu.data(), in, dh.data(), dh_type, rows, I, gu.data(), other, nullptr);
      });
    }
  }
}

// ---- embedding backward ----

// ids drawn from [0, distinct) (many repeats), plus ids outside the table when `strays`.
void check_embedding_backward(int64_t rows, int64_t D, int64_t vocab, int64_t distinct, bool strays,
                              Tally& tally) {
  Random rng(fresh_seed());
  std::vector<int32_t> ids(static_cast<size_t>(rows));
  for (int32_t& id : ids) id = int32_t(rng.integer(0, distinct - 1) * (vocab / distinct));
  if (strays && rows >= 3) {
    ids[1] = -1;
    ids[rows - 1] = int32_t(vocab);
  }
  const std::vector<float> dy = random_values(size_t(rows * D), fresh_seed());
  const std::vector<float> table0 = random_values(size_t(vocab * D), fresh_seed());
  // The CPU's float scatter-add in row order (rows outside the table skipped).
  std::vector<float> cpu = table0;
  for (int64_t r = 0; r < rows; ++r) {
    if (ids[r] < 0 || ids[r] >= vocab) continue;
    for (int64_t i = 0; i < D; ++i) cpu[int64_t(ids[r]) * D + i] += dy[r * D + i];
  }
  std::vector<double> ref = widen(table0);
  for (int64_t r = 0; r < rows; ++r) {
    if (ids[r] < 0 || ids[r] >= vocab) continue;
    for (int64_t i = 0; i < D; ++i) ref[int64_t(ids[r]) * D + i] += dy[r * D + i];
  }
  const DeviceBuffer d_ids = upload_ints(ids), d_dy = upload(dy);
  cu::TrainScratch scratch;
  std::vector<float> runs[2];
  for (int run = 0; run < 2; ++run) {
    DeviceBuffer d_table = upload(table0);
    cu::embedding_backward(d_ids.as<int32_t>(), d_dy.as<float>(), rows, D, vocab,
                           d_table.as<float>(), scratch, nullptr);
    sync();
    runs[run] = download(d_table.data(), table0.size());
  }
  const std::string tag = "embedding_backward" + dims(rows, D) + " vocab=" + std::to_string(vocab) +
                          " distinct=" + std::to_string(distinct) + (strays ? " strays" : "");
  report(tally, tag, rel_error(widen(runs[0]), ref), kTol);
  report_same(tally, tag + " equals the CPU bit for bit", same_bits(runs[0], cpu));
  report_same(tally, tag + " deterministic", same_bits(runs[0], runs[1]));
}

// ---- cross-entropy ----

// dlogits: in place (in the logits' type), else into a fresh array of type `out`.
void check_cross_entropy(int64_t rows, int64_t V, ElementType type, bool in_place,
                         int unscored_every, Tally& tally, ElementType out = ElementType::f32) {
  std::vector<float> logits = random_values(size_t(rows * V), fresh_seed(), 6.f);
  Random rng(fresh_seed());
  std::vector<int32_t> targets(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    targets[r] = int32_t(rng.integer(0, V - 1));
    if (unscored_every > 0 && r % unscored_every == 1) targets[r] = -1;
    // Some rows whose target is their argmax, so hits are counted.
    if (targets[r] >= 0 && r % 3 == 0) logits[r * V + targets[r]] = 9.f;
  }
  const DeviceArray d_logits = to_device(logits, type);  // .rounded: what the device reads
  const std::vector<double>& l = d_logits.rounded;

  int64_t count = 0;
  for (int32_t t : targets) count += t >= 0;
  std::vector<double> d_ref(size_t(rows * V), 0.0);
  double loss_ref = 0;
  int64_t hits_ref = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (targets[r] < 0) continue;
    const double* lr = l.data() + r * V;
    const int64_t best = std::max_element(lr, lr + V) - lr;
    double sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(lr[v] - lr[best]);
    loss_ref += lr[best] + std::log(sum) - lr[targets[r]];
    hits_ref += best == targets[r];
    for (int64_t v = 0; v < V; ++v)
      d_ref[r * V + v] =
          (std::exp(lr[v] - lr[best]) / sum - (v == targets[r] ? 1.0 : 0.0)) / double(count);
  }

  const DeviceBuffer d_targets = upload_ints(targets);
  cu::TrainScratch scratch;
  DeviceBuffer scalars(3 * sizeof(float));  // loss_sum, correct, scored
  const ElementType out_type = in_place ? type : out;
  std::vector<double> d_runs[2];
  std::vector<float> loss_runs[2];
  int32_t correct = -1, scored = -1;
  for (int run = 0; run < 2; ++run) {
    DeviceArray input = to_device(logits, type);
    DeviceBuffer d_out = poisoned(size_t(rows * V));
    poison(scalars.data(), scalars.bytes());
    void* dlogits = in_place ? input.data() : d_out.data();
    float* loss = scalars.as<float>();
    int32_t* correct_ptr = reinterpret_cast<int32_t*>(loss + 1);
    cu::cross_entropy_forward_backward(input.data(), type, d_targets.as<int32_t>(), rows, V,
                                       dlogits, out_type, loss, correct_ptr, correct_ptr + 1,
                                       scratch, nullptr);
    sync();
    d_runs[run] = from_device(dlogits, size_t(rows * V), out_type);
    loss_runs[run] = download(loss, 1);
    int32_t ints[2];
    scalars.download(ints, sizeof(ints), sizeof(float));
    correct = ints[0];
    scored = ints[1];
  }
  const double tol = type == ElementType::bf16 || out_type == ElementType::bf16 ? 1e-2 : kTol;
  const std::string tag = std::string("cross_entropy rows=") + std::to_string(rows) +
                          " V=" + std::to_string(V) +
                          (type == ElementType::bf16 ? " bf16" : " f32") +
                          (out_type == ElementType::bf16 ? " -> bf16" : " -> f32") +
                          (in_place ? " in place" : "") + " scored=" + std::to_string(count);
  report(tally, tag + " dlogits", rel_error(d_runs[0], d_ref), tol);
  report(tally, tag + " loss_sum", rel_error({double(loss_runs[0][0])}, {loss_ref}), tol);
  report(tally, tag + " correct", std::abs(double(correct - hits_ref)), 0.0);
  report(tally, tag + " scored", std::abs(double(scored - count)), 0.0);
  report_same(tally, tag + " deterministic",
              d_runs[0] == d_runs[1] && same_bits(loss_runs[0], loss_runs[1]));
}

// No scored row at all: zero gradients, zero loss.
void check_cross_entropy_unscored(Tally& tally) {
  const int64_t rows = 4, V = 1000;
  const std::vector<float> logits = random_values(size_t(rows * V), fresh_seed(), 6.f);
  const std::vector<int32_t> targets(size_t(rows), -1);
  const DeviceBuffer d_logits = upload(logits), d_targets = upload_ints(targets);
  DeviceBuffer d_out = poisoned(size_t(rows * V)), scalars(2 * sizeof(float));
  poison(scalars.data(), scalars.bytes());
  cu::TrainScratch scratch;
  cu::cross_entropy_forward_backward(
      d_logits.data(), ElementType::f32, d_targets.as<int32_t>(), rows, V, d_out.as<float>(),
      ElementType::f32, scalars.as<float>(), reinterpret_cast<int32_t*>(scalars.as<float>() + 1),
      nullptr, scratch, nullptr);
  sync();
  std::vector<double> got = widen(download(d_out.data(), size_t(rows * V)));
  const std::vector<float> loss = download(scalars.data(), 1);
  got.push_back(loss[0]);
  int32_t correct = -1;
  scalars.download(&correct, sizeof(correct), sizeof(float));
  got.push_back(correct);
  report(tally, "cross_entropy no scored rows: zero dlogits, loss, hits",
         rel_error(got, std::vector<double>(got.size(), 0.0)), 0.0);
}

// ---- AdamW ----

// train::AdamW::step's update of one parameter, in float as the CPU runs it.
void cpu_adamw(std::vector<float>& w, const std::vector<float>& g, std::vector<float>& m,
               std::vector<float>& v, const cu::AdamWHyper& h, int64_t step, float clip) {
  const float b1 = h.beta1, b2 = h.beta2;
  const float c1 = 1.0f - std::pow(b1, float(step)), c2 = 1.0f - std::pow(b2, float(step));
  const float decay = h.lr * h.weight_decay;
  for (size_t j = 0; j < w.size(); ++j) {
    const float gj = g[j] * clip;
    m[j] = b1 * m[j] + (1.0f - b1) * gj;
    v[j] = b2 * v[j] + (1.0f - b2) * gj * gj;
    w[j] -= decay * w[j];
    w[j] -= h.lr * (m[j] / c1) / (std::sqrt(v[j] / c2) + h.eps);
  }
}

void check_adamw(int64_t n, float weight_decay, float grad_scale, ElementType copy_type,
                 bool with_copy, Tally& tally) {
  cu::AdamWHyper h;
  h.lr = 1e-2f;
  h.beta1 = 0.9f;
  h.beta2 = 0.95f;
  h.eps = 1e-8f;
  h.weight_decay = weight_decay;
  const std::vector<float> w0 = random_values(size_t(n), fresh_seed());
  std::vector<float> w = w0, m(size_t(n), 0.0f), v(size_t(n), 0.0f);
  DeviceBuffer d_w = upload(w0), d_m = upload(m), d_v = upload(v);
  DeviceBuffer d_copy(size_t(n) * cu::element_bytes(copy_type));
  const std::string tag =
      "adamw n=" + std::to_string(n) + " wd=" + std::to_string(weight_decay) +
      " scale=" + std::to_string(grad_scale) +
      (with_copy ? (copy_type == ElementType::bf16 ? " copy bf16" : " copy f32") : " no copy");
  for (int64_t step = 1; step <= 3; ++step) {
    const std::vector<float> g = random_values(size_t(n), fresh_seed(), 0.5f);
    const DeviceBuffer d_g = upload(g);
    poison(d_copy.data(), d_copy.bytes());
    const std::vector<float> before = w;
    cu::adamw_step(d_w.as<float>(), d_g.as<float>(), d_m.as<float>(), d_v.as<float>(), n, h, step,
                   grad_scale, with_copy ? d_copy.data() : nullptr, copy_type, nullptr);
    sync();
    cpu_adamw(w, g, m, v, h, step, grad_scale);
    const std::vector<float> got_w = download(d_w.data(), size_t(n));
    // The update (w - w_before) is compared, so a small error is not hidden by |w|.
    std::vector<double> got_delta(static_cast<size_t>(n)), ref_delta(static_cast<size_t>(n));
    for (int64_t j = 0; j < n; ++j) {
      got_delta[j] = double(got_w[j]) - before[j];
      ref_delta[j] = double(w[j]) - before[j];
    }
    const std::string s = tag + " step " + std::to_string(step);
    report(tally, s + " update", rel_error(got_delta, ref_delta), kTol);
    report(tally, s + " m", rel_error(widen(download(d_m.data(), size_t(n))), widen(m)), kTol);
    report(tally, s + " v", rel_error(widen(download(d_v.data(), size_t(n))), widen(v)), kTol);
    if (with_copy) {
      const std::vector<double> copy = from_device(d_copy.data(), size_t(n), copy_type);
      int64_t mismatches = 0;
      for (int64_t j = 0; j < n; ++j) {
        const double expect = copy_type == ElementType::bf16
                                  ? double(bf16_to_f32(f32_to_bf16(got_w[j])))
                                  : double(got_w[j]);
        mismatches += !(copy[j] == expect);
      }
      report(tally, s + " copy equals the rounded master", double(mismatches), 0.0);
    }
    w = got_w;  // continue from the device's weights (the reference then tracks one step)
  }
}

// The multi-tensor AdamW (three launches for a model) against the one-tensor adamw_step given
// the clipping factor the host computes from the same gradients: the same bits. Tensors of 1,
// 3, 70001 (three chunks, the last not a multiple of 4), 10003 and 5001 elements, the last one
// at addresses one float past 16-byte alignment (the one-element-at-a-time path), with and
// without decay and bf16 copies; clipping engaged (clip_norm below the norm) and not; then a NaN
// gradient: nothing moves.
void check_adamw_multi_tensor(float clip_norm, Tally& tally) {
  const std::vector<int64_t> sizes = {1, 3, 70001, 10003, 5001};
  const std::vector<int64_t> offsets = {0, 0, 0, 0, 1};  // in elements, of every array
  cu::AdamWHyper h;
  h.lr = 3e-3f;
  h.weight_decay = 0.1f;
  struct Tensor {
    std::vector<float> w, g;
    DeviceBuffer d_w, d_g, d_m, d_v, d_copy, r_w, r_m, r_v, r_copy;  // r_: one-tensor run
    int64_t off = 0;
    float* at(const DeviceBuffer& b) const { return b.as<float>() + off; }
    void* copy_at(const DeviceBuffer& b) const {
      return b.data() ? static_cast<void*>(b.as<char>() + off * 2) : nullptr;
    }
  };
  // the values after `off` leading pad values
  const auto padded = [](const std::vector<float>& v, int64_t off) {
    std::vector<float> out(size_t(off), 7.0f);
    out.insert(out.end(), v.begin(), v.end());
    return upload(out);
  };
  std::vector<Tensor> t(sizes.size());
  std::vector<cu::AdamWTensor> table;
  double norm2 = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const int64_t n = sizes[i], off = offsets[i];
    t[i].off = off;
    t[i].w = random_values(size_t(n), fresh_seed());
    t[i].g = random_values(size_t(n), fresh_seed(), 0.5f);
    for (float x : t[i].g) norm2 += double(x) * x;
    t[i].d_w = padded(t[i].w, off), t[i].r_w = padded(t[i].w, off);
    t[i].d_g = padded(t[i].g, off);
    const std::vector<float> m = random_values(size_t(n), fresh_seed(), 0.1f);
    std::vector<float> v = random_values(size_t(n), fresh_seed(), 0.1f);
    for (float& x : v) x = x * x;
    t[i].d_m = padded(m, off), t[i].r_m = padded(m, off);
    t[i].d_v = padded(v, off), t[i].r_v = padded(v, off);
    const bool copy = i % 2 == 0;
    if (copy) {
      t[i].d_copy = DeviceBuffer(size_t(n + off) * 2),
      t[i].r_copy = DeviceBuffer(size_t(n + off) * 2);
      poison(t[i].d_copy.data(), t[i].d_copy.bytes());
    }
    table.push_back({t[i].at(t[i].d_w), t[i].at(t[i].d_g), t[i].at(t[i].d_m), t[i].at(t[i].d_v),
                     t[i].copy_at(t[i].d_copy), n, i != 1});
  }
  cu::AdamWMultiTensor multi(table);
  multi.step(h, 4, clip_norm, nullptr);
  sync();
  double norm = 0;
  ops::cuda::check_cuda(cudaMemcpy(&norm, multi.norm_device(), 8, cudaMemcpyDeviceToHost), "norm");
  const double ref_norm = std::sqrt(norm2);
  const float clip =
      clip_norm > 0 && ref_norm > clip_norm ? float(double(clip_norm) / ref_norm) : 1.0f;
  const std::string tag = "adamw multi-tensor clip_norm=" + std::to_string(clip_norm);
  report(tally, tag + " norm", std::abs(norm - ref_norm) / ref_norm, 1e-12);
  bool same = true;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const Tensor& ti = t[i];
    cu::AdamWHyper hi = h;
    hi.weight_decay = i != 1 ? h.weight_decay : 0.0f;
    const size_t n = size_t(sizes[i]);
    cu::adamw_step(ti.at(ti.r_w), ti.at(ti.d_g), ti.at(ti.r_m), ti.at(ti.r_v), int64_t(n), hi, 4,
                   clip, ti.copy_at(ti.r_copy), ElementType::bf16, nullptr);
    sync();
    same = same && download(ti.at(ti.d_w), n) == download(ti.at(ti.r_w), n) &&
           download(ti.at(ti.d_m), n) == download(ti.at(ti.r_m), n) &&
           download(ti.at(ti.d_v), n) == download(ti.at(ti.r_v), n);
    if (ti.d_copy.data())
      same = same && from_device(ti.copy_at(ti.d_copy), n, ElementType::bf16) ==
                         from_device(ti.copy_at(ti.r_copy), n, ElementType::bf16);
  }
  report_same(tally, tag + " equals adamw_step per tensor", same);
  // a NaN gradient: the norm is NaN and no weight moves
  const std::vector<float> before = download(t[2].d_w.data(), size_t(sizes[2]));
  const float nan = NAN;
  ops::cuda::check_cuda(cudaMemcpy(t[0].d_g.data(), &nan, 4, cudaMemcpyHostToDevice), "nan");
  multi.step(h, 5, clip_norm, nullptr);
  sync();
  ops::cuda::check_cuda(cudaMemcpy(&norm, multi.norm_device(), 8, cudaMemcpyDeviceToHost), "norm");
  report_same(tally, tag + " NaN gradient: NaN norm, nothing updated",
              std::isnan(norm) && download(t[2].d_w.data(), size_t(sizes[2])) == before);
}

// ---- global norm pieces ----

void check_sum_of_squares(int64_t n, Tally& tally) {
  const std::vector<float> x = random_values(size_t(n), fresh_seed());
  const float start = 0.75f;  // accumulated into
  double ref = start;
  for (float v : x) ref += double(v) * v;
  const DeviceBuffer d_x = upload(x);
  cu::TrainScratch scratch;
  std::vector<float> runs[2];
  for (int run = 0; run < 2; ++run) {
    DeviceBuffer out = upload({start});
    cu::sum_of_squares(d_x.as<float>(), n, out.as<float>(), scratch, nullptr);
    sync();
    runs[run] = download(out.data(), 1);
  }
  const std::string tag = "sum_of_squares n=" + std::to_string(n);
  report(tally, tag, rel_error({double(runs[0][0])}, {ref}), kTol);
  report_same(tally, tag + " deterministic", same_bits(runs[0], runs[1]));
}

void check_scale(int64_t n, Tally& tally) {
  const std::vector<float> x = random_values(size_t(n), fresh_seed());
  DeviceBuffer d_x = upload(x);
  cu::scale(d_x.as<float>(), n, 0.3125f, nullptr);
  sync();
  std::vector<double> ref(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ref[i] = double(x[i]) * 0.3125;
  report(tally, "scale n=" + std::to_string(n),
         rel_error(widen(download(d_x.data(), size_t(n))), ref), kTol);
}

void check_argument_errors(Tally& tally) {
  cu::TrainScratch scratch;
  float* bogus = reinterpret_cast<float*>(uintptr_t(256));  // never dereferenced
  report_throws(tally, "adamw_step step=0", [&] {
    cu::adamw_step(bogus, bogus, bogus, bogus, 10, cu::AdamWHyper{}, 0, 1.0f, nullptr,
                   ElementType::bf16, nullptr);
  });
  report_throws(tally, "rms_norm_backward D=0", [&] {
    cu::rms_norm_backward(bogus, bogus, 4, 0, bogus, bogus, bogus, bogus, scratch, nullptr);
  });
  report_throws(tally, "cross_entropy V=0", [&] {
    cu::cross_entropy_forward_backward(bogus, ElementType::f32, nullptr, 4, 0, bogus,
                                       ElementType::f32, bogus, nullptr, nullptr, scratch, nullptr);
  });
  report_throws(tally, "cross_entropy bf16 logits aliasing fp32 dlogits", [&] {
    cu::cross_entropy_forward_backward(bogus, ElementType::bf16,
                                       reinterpret_cast<const int32_t*>(bogus), 4, 10, bogus,
                                       ElementType::f32, bogus, nullptr, nullptr, scratch, nullptr);
  });
  report_throws(tally, "layer_norm_backward accumulate into dy", [&] {
    cu::layer_norm_backward(bogus, bogus, 4, 8, bogus, 1e-5f, bogus, bogus, bogus, true, scratch,
                            nullptr);
  });
  report_throws(tally, "embedding_backward vocab=0", [&] {
    cu::embedding_backward(reinterpret_cast<const int32_t*>(bogus), bogus, 4, 8, 0, bogus, scratch,
                           nullptr);
  });
}

// ---- timings (--bench): the memory-bound kernels of a 125M lineage model's training step ----

// n floats of 0x3C3C3C3C (~0.0115): finite normal values without a host upload.
void fill_small(const DeviceBuffer& b) {
  cu::check_cuda(cudaMemset(b.data(), 0x3C, b.bytes()), "fill");
}

void bench_rms_backward(int64_t rows, int64_t D, bool accumulate, bool with_copy) {
  const size_t n = size_t(rows * D);
  DeviceBuffer x(n * 4), dy(n * 4), dx(n * 4), w(size_t(D) * 4), inv(size_t(rows) * 4),
      dw(size_t(D) * 4), copy(with_copy ? n * 2 : 0);
  for (const DeviceBuffer* b : {&x, &dy, &dx, &w, &inv, &dw}) fill_small(*b);
  cu::TrainScratch scratch;
  const double ms = time_ms(nullptr, [&] {
    cu::rms_norm_backward(x.as<float>(), dy.as<float>(), rows, D, w.as<float>(), inv.as<float>(),
                          dx.as<float>(), dw.as<float>(), scratch, nullptr, accumulate,
                          with_copy ? copy.data() : nullptr);
  });
  const double bytes = double(n) * (8 + (accumulate ? 8 : 4) + (with_copy ? 2 : 0));
  std::printf("BENCH train rms_norm_backward rows=%lld D=%lld%s%s: %.1f us, %.0f GB/s\n",
              (long long)rows, (long long)D,
              accumulate ? " dx+=" : " dx=", with_copy ? " +bf16 copy" : "", ms * 1e3,
              bytes / (ms * 1e-3) / 1e9);
}

// The multi-tensor AdamW over a 162M-parameter set shaped like the 125M lineage model (width
// 768, 12 layers, MLP 2048, vocab 50304, untied head; norms without decay or copy).
void bench_adamw_multi_tensor() {
  std::vector<std::pair<int64_t, bool>> shapes;  // (elements, matrix: decay and a bf16 copy)
  shapes.push_back({50304 * 768, true});
  for (int l = 0; l < 12; ++l) {
    for (int64_t n : {768 * 2304, 768 * 768, 768 * 2048, 768 * 2048, 768 * 2048})
      shapes.push_back({n, true});
    shapes.push_back({768, false});
    shapes.push_back({768, false});
  }
  shapes.push_back({768, false});
  shapes.push_back({50304 * 768, true});
  std::vector<DeviceBuffer> buffers;
  std::vector<cu::AdamWTensor> table;
  double bytes = 0, params = 0;
  for (const auto& [n, matrix] : shapes) {
    cu::AdamWTensor t;
    float* arrays[4];
    for (float*& a : arrays) {
      buffers.emplace_back(size_t(n) * 4);
      fill_small(buffers.back());
      a = buffers.back().as<float>();
    }
    t.param = arrays[0], t.grad = arrays[1], t.m = arrays[2], t.v = arrays[3];
    if (matrix) {
      buffers.emplace_back(size_t(n) * 2);
      t.bf16_copy = buffers.back().data();
    }
    t.n = n;
    t.decay = matrix;
    table.push_back(t);
    params += double(n);
    bytes += double(n) * (4 + 16 + 12 + (matrix ? 2 : 0));  // the norm's read, then the update
  }
  cu::AdamWMultiTensor multi(table);
  cu::AdamWHyper h;
  h.lr = 1e-4f;
  h.weight_decay = 0.1f;
  const double ms = time_ms(nullptr, [&] { multi.step(h, 10, 1.0f, nullptr); });
  std::printf(
      "BENCH train adamw multi-tensor params=%.0fM: %.3f ms, %.0f GB/s (norm read + update)\n",
      params / 1e6, ms, bytes / (ms * 1e-3) / 1e9);
}

// Cross-entropy at the 125M trainer's shape (8 x 2048 rows, vocabulary 50304, fp32 logits,
// bf16 gradients). (H200: 2.02 ms. Staging each row in shared memory so that the second pass
// does not read DRAM again was slower, 2.20 ms: blocks of 1024 threads, one an SM, with a barrier
// between the passes, keep too few loads in flight.)
void bench_cross_entropy() {
  const int64_t rows = 16384, V = 50304;
  std::vector<float> logits = random_values(size_t(rows * V), fresh_seed(), 4.f);
  std::vector<int32_t> targets(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) targets[size_t(r)] = int32_t((r * 7919) % V);
  const DeviceBuffer d_logits = upload(logits), d_targets = upload_ints(targets);
  DeviceBuffer d_out(size_t(rows * V) * 2), scalars(3 * sizeof(float));
  cu::TrainScratch scratch;
  const double ms = time_ms(nullptr, [&] {
    float* loss = scalars.as<float>();
    auto* ints = reinterpret_cast<int32_t*>(loss + 1);
    cu::cross_entropy_forward_backward(d_logits.data(), ElementType::f32, d_targets.as<int32_t>(),
                                       rows, V, d_out.data(), ElementType::bf16, loss, ints,
                                       ints + 1, scratch, nullptr);
  });
  const double gb = double(rows * V) * (4 + 2) / 1e9;  // logits read once, gradients written
  std::printf(
      "BENCH train cross_entropy rows=%lld V=%lld f32 -> bf16: %.3f ms (%.0f GB/s at one "
      "read of the logits)\n",
      (long long)rows, (long long)V, ms, gb / (ms * 1e-3));
  std::fflush(stdout);
}

void bench_train() {
  bench_cross_entropy();
  bench_rms_backward(16384, 768, false, true);  // the final norm
  bench_rms_backward(16384, 768, true, true);   // a layer's norms, as the lineage trainer
  bench_rms_backward(16384, 768, true, false);
  bench_adamw_multi_tensor();
}

void check_train(Tally& tally) {
  constexpr ElementType f32 = ElementType::f32, bf16 = ElementType::bf16;

  check_rms_forward(7, 24, f32, tally);
  check_rms_forward(37, 128, bf16, tally);
  check_rms_forward(5, 100, f32, tally);   // scalar path
  check_rms_forward(3, 2304, f32, tally);  // a block per row

  check_rms_backward(1, 64, false, tally);
  check_rms_backward(17, 100, false, tally);
  check_rms_backward(300, 2304, false, tally);
  check_rms_backward(4000, 96, false, tally);  // many row chunks
  check_rms_backward(33, 128, true, tally);
  check_rms_backward(300, 768, false, tally, true);
  check_rms_backward(17, 100, false, tally, true);
  // the one-pass kernel (D <= 1024, D % 4 == 0) at each width class, with the bf16 copy: the
  // trainer's shape (rows not a multiple of the chunk), a lane with a partial last vector
  // (D % 128 != 0), the widest (the old dx loaded late), dx over dy; then the two-kernel paths
  // (a block per row, scalar) with the copy
  check_rms_backward(4100, 768, false, tally, true, true);
  check_rms_backward(4100, 768, false, tally, false, true);
  check_rms_backward(37, 900, false, tally, true, true);
  check_rms_backward(1000, 1024, false, tally, true, true);
  check_rms_backward(50, 1024, true, tally, false, true);
  check_rms_backward(5, 2304, false, tally, true, true);
  check_rms_backward(7, 100, false, tally, true, true);

  check_layer_norm_backward(1, 24, false, false, tally);
  check_layer_norm_backward(33, 768, true, false, tally);
  check_layer_norm_backward(5, 100, false, false, tally);
  check_layer_norm_backward(2000, 64, true, false, tally);
  check_layer_norm_backward(3, 2304, false, false, tally);
  check_layer_norm_backward(9, 128, false, true, tally);

  check_gelu_backward(1000, false, tally);
  check_gelu_backward(4099, true, tally);
  check_swiglu_backward(7, 100, false, tally);
  check_swiglu_backward(64, 1408, false, tally);
  check_swiglu_backward(5, 37, true, tally);
  check_swiglu_typed(7, 100, tally);
  check_swiglu_typed(5, 37, tally);  // scalar path
  check_swiglu_typed(1, 4, tally);
  check_swiglu_typed(64, 2048, tally);  // the lineage trainer's width

  // rows, D, vocab, distinct ids, strays
  check_embedding_backward(4096, 64, 1000, 50, false, tally);
  check_embedding_backward(300, 768, 50257, 40, true, tally);
  check_embedding_backward(1, 100, 1000, 1, false, tally);
  check_embedding_backward(2000, 64, 163840, 2000, true, tally);
  check_embedding_backward(500, 2304, 1000, 100, false, tally);
  // long runs of one id, as the recall tasks make (Stack's pop token on a third of the rows)
  check_embedding_backward(65536, 256, 8192, 3, true, tally);
  check_embedding_backward(1000, 256, 8192, 1, false, tally);

  // rows, V, logits type, in place, every k-th row (from row 1) unscored
  check_cross_entropy(37, 1000, f32, false, 4, tally);
  check_cross_entropy(37, 1000, f32, true, 4, tally);
  check_cross_entropy(9, 50257, f32, true, 3, tally);
  check_cross_entropy(9, 50257, bf16, false, 3, tally);
  check_cross_entropy(1, 1000, f32, false, 0, tally);
  check_cross_entropy(3, 262144, f32, false, 0, tally);
  check_cross_entropy(9, 50304, f32, true, 3, tally);  // the 125M trainer's vocabulary, in place
  check_cross_entropy(200, 1000, bf16, false, 5, tally);
  // bf16 gradients in place of bf16 logits (the lineage trainer's head): 4-wide (V % 4 == 0)
  // and scalar rows
  check_cross_entropy(9, 50304, bf16, true, 3, tally);
  check_cross_entropy(9, 50257, bf16, true, 3, tally);
  check_cross_entropy(200, 1000, bf16, true, 5, tally);
  // fp32 logits, bf16 gradients beside them (the lineage trainer's head)
  check_cross_entropy(9, 50304, f32, false, 3, tally, bf16);
  check_cross_entropy(9, 50257, f32, false, 3, tally, bf16);
  check_cross_entropy_unscored(tally);

  check_adamw(10003, 0.1f, 0.37f, bf16, true, tally);
  check_adamw(10003, 0.0f, 0.37f, bf16, true, tally);
  check_adamw(4096, 0.1f, 1.0f, f32, true, tally);
  check_adamw(1001, 0.0f, 2.5f, bf16, false, tally);
  check_adamw_multi_tensor(0.5f, tally);  // clipped (the norm is ~ 0.5 * sqrt(80000 / 3))
  check_adamw_multi_tensor(1e6f, tally);  // not clipped
  check_adamw_multi_tensor(0.0f, tally);  // clipping off

  check_sum_of_squares(1, tally);
  check_sum_of_squares(1000, tally);
  check_sum_of_squares((int64_t(1) << 20) + 7, tally);
  check_scale(1000, tally);
  check_scale(100003, tally);

  check_argument_errors(tally);
}

void run_train(const SuiteOptions& options, Tally& tally) {
  if (options.check) check_train(tally);
  if (options.bench) bench_train();
}

const bool registered = register_suite("train", run_train);

}  // namespace
}  // namespace kda::gpu_check
