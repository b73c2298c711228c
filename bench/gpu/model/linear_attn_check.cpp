// Suite "linear_attn": the GPU linear attention of ops/linear_attn/cuda/linear_attn_cuda.h (plain
// and normalised) against float64 host references: the forward against ops::linear_attn_reference,
// the backward against a float64 token-by-token backward of the recurrence written here (itself
// checked against central finite differences of ops::linear_attn_reference), plus the GPU
// gradients against finite differences directly and against the CPU fp32 chunked backward
// (ops::linear_attn_chunk_backward). Shapes: B = 2, H = 2, T = 1, 63, 64, 65, 300 (around and
// across the 64-token chunk), packed lengths {1, 37, 64, 100}, K = V in {32, 64, 128} and two
// K != V. Fresh random inputs per check, outputs poisoned with NaN; outputs to 1e-4, gradients to
// 1e-3 relative. The backward runs twice and must give the same bits; bad arguments throw.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "bench/gpu/model/gpu_suite.h"
#include "core/error.h"
#include "ops/common/sequences.h"
#include "ops/linear_attn/cuda/linear_attn_cuda.h"
#include "ops/linear_attn/linear_attn.h"

namespace kda::gpu_check {
namespace {

namespace cu = ops::cuda;
using ops::LinearAttnShape;

constexpr double kTol = 1e-4, kGradTol = 1e-3;

uint64_t fresh_seed() {
  static uint64_t next = 0x1a7ea77e5eedull;
  return next++;
}

void sync() {
  cu::check_cuda(cudaDeviceSynchronize(), "linear_attn check sync");
}

DeviceBuffer poisoned(size_t floats) {
  DeviceBuffer b(floats * sizeof(float));
  poison(b.data(), b.bytes());
  return b;
}

std::vector<float> download(const DeviceBuffer& b) {
  std::vector<float> out(b.bytes() / sizeof(float));
  b.download(out.data(), b.bytes());
  return out;
}

double norm(const std::vector<double>& x) {
  double sum = 0;
  for (double v : x) sum += v * v;
  return std::sqrt(sum);
}

// ||x - ref|| / max(||ref||, floor); any non-finite x gives +inf.
double error_with_floor(const std::vector<double>& x, const std::vector<double>& ref,
                        double floor) {
  const double rel = rel_error(x, ref), ref_norm = norm(ref);
  if (!std::isfinite(rel) || floor <= ref_norm) return rel;
  return ref_norm > 0 ? rel * ref_norm / floor : rel / floor;
}

// ---- cases ----

struct Case {
  std::string name;
  int64_t B, T;
  std::vector<int64_t> cu_seqlens;  // empty: B sequences of T tokens
};

std::vector<Case> cases() {
  std::vector<Case> out;
  for (int64_t T : {1, 63, 64, 65, 300}) out.push_back({"B=2 T=" + std::to_string(T), 2, T, {}});
  out.push_back({"packed 1,37,64,100", 1, 202, {0, 1, 38, 102, 202}});
  return out;
}

LinearAttnShape shape_of(const Case& c, int64_t H, int64_t K, int64_t V, bool normalize) {
  LinearAttnShape s;
  s.B = c.B, s.T = c.T, s.H = H, s.K = K, s.V = V, s.normalize = normalize;
  return s;
}

std::string describe(const Case& c, const LinearAttnShape& s) {
  return c.name + " H=" + std::to_string(s.H) + " K=" + std::to_string(s.K) +
         " V=" + std::to_string(s.V) + (s.normalize ? " normalised" : " plain");
}

struct HostInputs {
  std::vector<float> q, k, v, d_o;
};

HostInputs random_inputs(const LinearAttnShape& s) {
  const size_t rows = size_t(s.B * s.T * s.H);
  return {random_values(rows * size_t(s.K), fresh_seed()),
          random_values(rows * size_t(s.K), fresh_seed()),
          random_values(rows * size_t(s.V), fresh_seed()),
          random_values(rows * size_t(s.V), fresh_seed())};
}

// ---- float64 references ----

std::vector<double> reference_forward(const LinearAttnShape& s, std::span<const int64_t> cu_seqlens,
                                      const std::vector<double>& q, const std::vector<double>& k,
                                      const std::vector<double>& v) {
  std::vector<double> o(size_t(s.B * s.T * s.H * s.V));
  ops::LinearAttnInputs<double> in;
  in.shape = s;
  in.q = q.data(), in.k = k.data(), in.v = v.data();
  in.cu_seqlens = cu_seqlens;
  ops::LinearAttnOutputs<double> out;
  out.o = o.data();
  ops::linear_attn_reference(in, out);
  return o;
}

struct Grads {
  std::vector<double> dq, dk, dv;
};

double slope(double x) {
  return x > 0 ? 1.0 : std::exp(x);
}

// The backward of the recurrence token by token, float64, independent of the chunked algebra:
//   S_t = S_{t-1} + kp_t v_t^T, z_t = z_{t-1} + kp_t, o_t = scale S_t^T qp_t / den_t,
//   den_t = scale qp_t . z_t + 1e-10 (normalised; else o_t = scale S_t^T qp_t).
// With E_t = d_o_t / den_t and w_t = -scale (o_t . d_o_t) / den_t (zero for the plain form):
//   dqp_t = scale S_t E_t + w_t z_t;  G_t = sum_{s >= t} scale qp_s E_s^T,
//   Gz_t = sum_{s >= t} w_s qp_s;  dkp_t = G_t v_t + Gz_t;  dv_t = G_t^T kp_t.
Grads reference_backward(const LinearAttnShape& s, std::span<const int64_t> cu_seqlens,
                         const std::vector<double>& q, const std::vector<double>& k,
                         const std::vector<double>& v, const std::vector<double>& d_o) {
  const ops::SequenceLayout layout(s.B, s.T, cu_seqlens);
  const size_t H = size_t(s.H), K = size_t(s.K), V = size_t(s.V);
  const double scale = s.effective_scale();
  Grads g{std::vector<double>(q.size()), std::vector<double>(k.size()),
          std::vector<double>(v.size())};
  for (int64_t n = 0; n < layout.num_sequences(); ++n) {
    const size_t start = size_t(layout.start(n)), length = size_t(layout.length(n));
    for (size_t h = 0; h < H; ++h) {
      auto row = [&](size_t t) { return (start + t) * H + h; };
      std::vector<double> S(K * V, 0.0), z(K, 0.0), qp(K), kp(K);
      std::vector<double> E(length * V), w(length, 0.0);
      for (size_t t = 0; t < length; ++t) {
        const double* qr = &q[row(t) * K];
        const double* kr = &k[row(t) * K];
        const double* vr = &v[row(t) * V];
        const double* dor = &d_o[row(t) * V];
        for (size_t c = 0; c < K; ++c) {
          qp[c] = ops::linear_attn_feature_map(qr[c]);
          kp[c] = ops::linear_attn_feature_map(kr[c]);
          z[c] += kp[c];
          for (size_t j = 0; j < V; ++j) S[c * V + j] += kp[c] * vr[j];
        }
        double* Et = &E[t * V];
        if (s.normalize) {
          double qz = 0, o_dot_do = 0;
          for (size_t c = 0; c < K; ++c) qz += qp[c] * z[c];
          const double den = scale * qz + 1e-10;
          for (size_t j = 0; j < V; ++j) {
            double num = 0;
            for (size_t c = 0; c < K; ++c) num += S[c * V + j] * qp[c];
            o_dot_do += scale * num / den * dor[j];
            Et[j] = dor[j] / den;
          }
          w[t] = -scale * o_dot_do / den;
        } else {
          for (size_t j = 0; j < V; ++j) Et[j] = dor[j];
        }
        double* dq = &g.dq[row(t) * K];
        for (size_t c = 0; c < K; ++c) {
          double d = w[t] * z[c];
          for (size_t j = 0; j < V; ++j) d += scale * S[c * V + j] * Et[j];
          dq[c] = d * slope(qr[c]);
        }
      }
      std::vector<double> G(K * V, 0.0), Gz(K, 0.0);
      for (size_t t = length; t-- > 0;) {
        const double* qr = &q[row(t) * K];
        const double* kr = &k[row(t) * K];
        const double* vr = &v[row(t) * V];
        const double* Et = &E[t * V];
        for (size_t c = 0; c < K; ++c) {
          const double qpc = ops::linear_attn_feature_map(qr[c]);
          kp[c] = ops::linear_attn_feature_map(kr[c]);
          Gz[c] += w[t] * qpc;
          for (size_t j = 0; j < V; ++j) G[c * V + j] += scale * qpc * Et[j];
        }
        double* dk = &g.dk[row(t) * K];
        for (size_t c = 0; c < K; ++c) {
          double d = Gz[c];
          for (size_t j = 0; j < V; ++j) d += G[c * V + j] * vr[j];
          dk[c] = d * slope(kr[c]);
        }
        double* dv = &g.dv[row(t) * V];
        for (size_t j = 0; j < V; ++j) {
          double d = 0;
          for (size_t c = 0; c < K; ++c) d += G[c * V + j] * kp[c];
          dv[j] = d;
        }
      }
    }
  }
  return g;
}

// ---- the GPU calls ----

struct DeviceRun {
  std::vector<float> o, dq, dk, dv;
};

struct DeviceInputs {
  DeviceBuffer q, k, v, d_o, workspace;
  cu::LinearAttnDeviceArgs args;
};

DeviceInputs upload_inputs(const LinearAttnShape& s, std::span<const int64_t> cu_seqlens,
                           const HostInputs& in) {
  DeviceInputs d;
  d.q = upload(in.q), d.k = upload(in.k), d.v = upload(in.v), d.d_o = upload(in.d_o);
  d.workspace = DeviceBuffer(cu::linear_attn_workspace_bytes(s, cu_seqlens));
  poison(d.workspace.data(), d.workspace.bytes());  // the kernels must not read stale scratch
  d.args.shape = s;
  d.args.q = d.q.as<float>(), d.args.k = d.k.as<float>(), d.args.v = d.v.as<float>();
  d.args.cu_seqlens = cu_seqlens;
  return d;
}

std::vector<float> run_forward(const DeviceInputs& d) {
  const LinearAttnShape& s = d.args.shape;
  DeviceBuffer o = poisoned(size_t(s.B * s.T * s.H * s.V));
  cu::linear_attn_forward(d.args, o.as<float>(), d.workspace.data(), d.workspace.bytes(), nullptr);
  sync();
  return download(o);
}

DeviceRun run_backward(const DeviceInputs& d) {
  const LinearAttnShape& s = d.args.shape;
  const size_t rows = size_t(s.B * s.T * s.H);
  DeviceBuffer dq = poisoned(rows * size_t(s.K)), dk = poisoned(rows * size_t(s.K));
  DeviceBuffer dv = poisoned(rows * size_t(s.V));
  cu::linear_attn_backward(d.args, d.d_o.as<float>(), dq.as<float>(), dk.as<float>(),
                           dv.as<float>(), d.workspace.data(), d.workspace.bytes(), nullptr);
  sync();
  return {{}, download(dq), download(dk), download(dv)};
}

// ---- checks ----

void check_case(const Case& c, int64_t H, int64_t K, int64_t V, bool normalize, Tally& tally) {
  const LinearAttnShape s = shape_of(c, H, K, V, normalize);
  const std::string name = "linear_attn " + describe(c, s);
  const HostInputs in = random_inputs(s);
  const DeviceInputs d = upload_inputs(s, c.cu_seqlens, in);
  const std::vector<double> q = widen(in.q), k = widen(in.k), v = widen(in.v), d_o = widen(in.d_o);

  report(tally, name + " o",
         rel_error(widen(run_forward(d)), reference_forward(s, c.cu_seqlens, q, k, v)), kTol);
  const DeviceRun got = run_backward(d);
  const Grads ref = reference_backward(s, c.cu_seqlens, q, k, v, d_o);
  // Normalised, every sequence's first output is o = v exactly, so with T = 1 dq and dk vanish
  // (the reference holds rounding noise): measure them against the size of dv instead.
  const bool vanishing = normalize && c.T == 1;
  const double floor = vanishing ? norm(ref.dv) : 0.0;
  const std::string note = vanishing ? " (~0, vs |dv|)" : "";
  report(tally, name + " dq" + note, error_with_floor(widen(got.dq), ref.dq, floor), kGradTol);
  report(tally, name + " dk" + note, error_with_floor(widen(got.dk), ref.dk, floor), kGradTol);
  report(tally, name + " dv", rel_error(widen(got.dv), ref.dv), kGradTol);
}

// The GPU gradients against the CPU fp32 chunked backward (the op the GPU path mirrors).
void check_against_cpu(const Case& c, int64_t K, int64_t V, bool normalize, Tally& tally) {
  const LinearAttnShape s = shape_of(c, 2, K, V, normalize);
  const std::string name = "linear_attn vs CPU chunked " + describe(c, s);
  const HostInputs in = random_inputs(s);
  const DeviceRun got = run_backward(upload_inputs(s, c.cu_seqlens, in));
  std::vector<float> dq(in.q.size()), dk(in.k.size()), dv(in.v.size());
  ops::LinearAttnInputs<float> cpu_in;
  cpu_in.shape = s;
  cpu_in.q = in.q.data(), cpu_in.k = in.k.data(), cpu_in.v = in.v.data();
  cpu_in.cu_seqlens = c.cu_seqlens;
  ops::LinearAttnGrads<float> grads;
  grads.dq = dq.data(), grads.dk = dk.data(), grads.dv = dv.data();
  ops::linear_attn_chunk_backward(cpu_in, in.d_o.data(), nullptr, nullptr, grads);
  report(tally, name + " dq", rel_error(widen(got.dq), widen(dq)), kGradTol);
  report(tally, name + " dk", rel_error(widen(got.dk), widen(dk)), kGradTol);
  report(tally, name + " dv", rel_error(widen(got.dv), widen(dv)), kGradTol);
}

// Central finite differences of sum(o * d_o) (float64 reference forward) at a sample of input
// coordinates, against the float64 backward (to 1e-6) and the GPU backward (to 1e-3). Two
// sequences (3 and 67 tokens: the second crosses a chunk), H = 1, K = V = 32.
void check_finite_differences(bool normalize, Tally& tally) {
  const Case c{"packed 3,67", 1, 70, {0, 3, 70}};
  const LinearAttnShape s = shape_of(c, 1, 32, 32, normalize);
  const HostInputs in = random_inputs(s);
  std::vector<double> q = widen(in.q), k = widen(in.k), v = widen(in.v);
  const std::vector<double> d_o = widen(in.d_o);
  auto loss = [&] {
    const std::vector<double> o = reference_forward(s, c.cu_seqlens, q, k, v);
    double sum = 0;
    for (size_t i = 0; i < o.size(); ++i) sum += o[i] * d_o[i];
    return sum;
  };
  const Grads ref = reference_backward(s, c.cu_seqlens, q, k, v, d_o);
  const DeviceRun got = run_backward(upload_inputs(s, c.cu_seqlens, in));

  std::vector<double> fd, from_ref, from_gpu;
  Random pick(fresh_seed());
  auto sample = [&](std::vector<double>& x, const std::vector<double>& ref_grad,
                    const std::vector<float>& gpu_grad) {
    for (int n = 0; n < 48; ++n) {
      const size_t i = size_t(pick.integer(0, int64_t(x.size()) - 1));
      if (std::abs(x[i]) < 1e-3) continue;  // keep the step off the feature map's kink at 0
      const double x0 = x[i], step = 1e-5;
      x[i] = x0 + step;
      const double up = loss();
      x[i] = x0 - step;
      const double down = loss();
      x[i] = x0;
      fd.push_back((up - down) / (2 * step));
      from_ref.push_back(ref_grad[i]);
      from_gpu.push_back(gpu_grad[i]);
    }
  };
  sample(q, ref.dq, got.dq);
  sample(k, ref.dk, got.dk);
  sample(v, ref.dv, got.dv);
  const std::string name = std::string("linear_attn finite differences ") + c.name + " K=V=32" +
                           (normalize ? " normalised" : " plain");
  report(tally, name + " float64 backward", rel_error(from_ref, fd), 1e-6);
  report(tally, name + " GPU backward", rel_error(from_gpu, fd), kGradTol);
}

void check_deterministic(const Case& c, int64_t K, int64_t V, bool normalize, Tally& tally) {
  const LinearAttnShape s = shape_of(c, 2, K, V, normalize);
  const DeviceInputs d = upload_inputs(s, c.cu_seqlens, random_inputs(s));
  const DeviceRun a = run_backward(d), b = run_backward(d);
  const bool same = same_bits(a.dq, b.dq) && same_bits(a.dk, b.dk) && same_bits(a.dv, b.dv);
  report(tally, "linear_attn backward twice same bits " + describe(c, s), same ? 0.0 : 1.0, 0.0);
}

// The normalised backward from a kept forward (o and den as the forward wrote them, a workspace
// sized for it) against the one that recomputes them: the same bits. den is poisoned first, so
// an element the forward left unwritten turns the gradients to NaN; and a kept den changed
// (doubled) must change the gradients, so the kept path is the one that ran.
void check_kept_forward(const Case& c, int64_t K, int64_t V, Tally& tally) {
  const LinearAttnShape s = shape_of(c, 2, K, V, true);
  const DeviceInputs d = upload_inputs(s, c.cu_seqlens, random_inputs(s));
  const size_t rows = size_t(s.B * s.T * s.H);
  DeviceBuffer o = poisoned(rows * size_t(V)), den = poisoned(rows);
  DeviceBuffer ws(cu::linear_attn_workspace_bytes(s, c.cu_seqlens, /*kept_forward=*/true));
  report(tally, "linear_attn kept-forward workspace smaller " + describe(c, s),
         ws.bytes() < d.workspace.bytes() ? 0.0 : 1.0, 0.0);
  poison(ws.data(), ws.bytes());
  cu::linear_attn_forward(d.args, o.as<float>(), ws.data(), ws.bytes(), nullptr, den.as<float>());
  const auto backward_from = [&](const float* kept_den) {
    DeviceBuffer dq = poisoned(rows * size_t(K)), dk = poisoned(rows * size_t(K));
    DeviceBuffer dv = poisoned(rows * size_t(V));
    cu::linear_attn_backward(d.args, d.d_o.as<float>(), dq.as<float>(), dk.as<float>(),
                             dv.as<float>(), ws.data(), ws.bytes(), nullptr,
                             {o.as<float>(), kept_den});
    sync();
    return DeviceRun{{}, download(dq), download(dk), download(dv)};
  };
  const DeviceRun kept = backward_from(den.as<float>()), again = run_backward(d);
  std::vector<float> doubled = download(den);
  for (float& x : doubled) x *= 2.0f;
  const DeviceBuffer den2 = upload(doubled);
  const DeviceRun changed = backward_from(den2.as<float>());
  const auto finite = [](const std::vector<float>& x) {
    return std::all_of(x.begin(), x.end(), [](float v) { return std::isfinite(v); });
  };
  const bool same = finite(kept.dq) && finite(kept.dk) && finite(kept.dv) &&
                    same_bits(kept.dq, again.dq) && same_bits(kept.dk, again.dk) &&
                    same_bits(kept.dv, again.dv);
  report(tally, "linear_attn backward from the kept forward same bits " + describe(c, s),
         same ? 0.0 : 1.0, 0.0);
  const bool used = !same_bits(changed.dq, kept.dq) && !same_bits(changed.dv, kept.dv);
  report(tally, "linear_attn backward reads the kept den " + describe(c, s), used ? 0.0 : 1.0, 0.0);
}

void check_argument_errors(Tally& tally) {
  const Case c{"B=2 T=8", 2, 8, {}};
  const LinearAttnShape good = shape_of(c, 2, 64, 64, true);
  const HostInputs in = random_inputs(good);
  const DeviceInputs d = upload_inputs(good, {}, in);
  DeviceBuffer out(size_t(2 * 8 * 2 * 64) * sizeof(float) * 2);
  float* o = out.as<float>();
  void* ws = d.workspace.data();
  const size_t ws_bytes = d.workspace.bytes();
  auto with = [&](auto change) {
    cu::LinearAttnDeviceArgs a = d.args;
    change(a);
    return a;
  };
  auto forward = [&](const cu::LinearAttnDeviceArgs& a) {
    cu::linear_attn_forward(a, o, ws, ws_bytes, nullptr);
  };
  auto backward = [&](const cu::LinearAttnDeviceArgs& a) {
    cu::linear_attn_backward(a, d.d_o.as<float>(), o, o, o, ws, ws_bytes, nullptr);
  };
  report_throws(tally, "K=48", [&] { forward(with([](auto& a) { a.shape.K = 48; })); });
  report_throws(tally, "V=256", [&] { backward(with([](auto& a) { a.shape.V = 256; })); });
  report_throws(tally, "K=16", [&] { backward(with([](auto& a) { a.shape.K = 16; })); });
  report_throws(tally, "null q", [&] { forward(with([](auto& a) { a.q = nullptr; })); });
  report_throws(tally, "null v (backward)",
                [&] { backward(with([](auto& a) { a.v = nullptr; })); });
  report_throws(tally, "null o",
                [&] { cu::linear_attn_forward(d.args, nullptr, ws, ws_bytes, nullptr); });
  report_throws(tally, "null d_o",
                [&] { cu::linear_attn_backward(d.args, nullptr, o, o, o, ws, ws_bytes, nullptr); });
  report_throws(tally, "null dk", [&] {
    cu::linear_attn_backward(d.args, d.d_o.as<float>(), o, nullptr, o, ws, ws_bytes, nullptr);
  });
  report_throws(tally, "den from a plain forward", [&] {
    cu::linear_attn_forward(with([](auto& a) { a.shape.normalize = false; }), o, ws, ws_bytes,
                            nullptr, o);
  });
  report_throws(tally, "kept forward of a plain form", [&] {
    cu::linear_attn_backward(with([](auto& a) { a.shape.normalize = false; }), d.d_o.as<float>(), o,
                             o, o, ws, ws_bytes, nullptr, {o, o});
  });
  report_throws(tally, "kept forward without den", [&] {
    cu::linear_attn_backward(d.args, d.d_o.as<float>(), o, o, o, ws, ws_bytes, nullptr,
                             {o, nullptr});
  });
  report_throws(tally, "small workspace (backward)", [&] {
    cu::linear_attn_backward(d.args, d.d_o.as<float>(), o, o, o, ws, 256, nullptr);
  });
  report_throws(tally, "null workspace",
                [&] { cu::linear_attn_forward(d.args, o, nullptr, ws_bytes, nullptr); });
  report_throws(tally, "negative scale",
                [&] { forward(with([](auto& a) { a.shape.scale = -1; })); });
  static const int64_t bad_end[] = {0, 5, 9};  // does not end at T = 16 (B = 1)
  static const int64_t fine[] = {0, 5, 16};
  report_throws(tally, "cu_seqlens with B=2",
                [&] { forward(with([](auto& a) { a.cu_seqlens = fine; })); });
  report_throws(tally, "cu_seqlens not ending at T", [&] {
    forward(with([](auto& a) {
      a.shape.B = 1, a.shape.T = 16;
      a.cu_seqlens = bad_end;
    }));
  });
  sync();
}

void bench(int64_t B, int64_t T, int64_t H, int64_t K, int64_t V, bool normalize) {
  LinearAttnShape s;
  s.B = B, s.T = T, s.H = H, s.K = K, s.V = V, s.normalize = normalize;
  const HostInputs in = random_inputs(s);
  const DeviceInputs d = upload_inputs(s, {}, in);
  const size_t rows = size_t(B * T * H);
  DeviceBuffer o(rows * size_t(V) * 4), dq(rows * size_t(K) * 4), dk(rows * size_t(K) * 4),
      dv(rows * size_t(V) * 4);
  const double fwd = time_ms(nullptr, [&] {
    cu::linear_attn_forward(d.args, o.as<float>(), d.workspace.data(), d.workspace.bytes(),
                            nullptr);
  });
  const double bwd = time_ms(nullptr, [&] {
    cu::linear_attn_backward(d.args, d.d_o.as<float>(), dq.as<float>(), dk.as<float>(),
                             dv.as<float>(), d.workspace.data(), d.workspace.bytes(), nullptr);
  });
  // the trainer's path: o (and den) kept from the forward, so the backward runs no forward walk
  DeviceBuffer den(rows * 4);
  cu::linear_attn_forward(d.args, o.as<float>(), d.workspace.data(), d.workspace.bytes(), nullptr,
                          normalize ? den.as<float>() : nullptr);
  // (the plain form's backward never needs its forward: it takes no kept forward)
  const cu::LinearAttnKeptForward kept =
      normalize ? cu::LinearAttnKeptForward{o.as<float>(), den.as<float>()}
                : cu::LinearAttnKeptForward{};
  const double bwd_kept = time_ms(nullptr, [&] {
    cu::linear_attn_backward(d.args, d.d_o.as<float>(), dq.as<float>(), dk.as<float>(),
                             dv.as<float>(), d.workspace.data(), d.workspace.bytes(), nullptr,
                             kept);
  });
  std::printf(
      "BENCH linear_attn f32 B=%lld T=%lld H=%lld K=%lld V=%lld %s: fwd %.3f ms, bwd %.3f ms, "
      "bwd with kept forward %.3f ms\n",
      (long long)B, (long long)T, (long long)H, (long long)K, (long long)V,
      normalize ? "normalised" : "plain", fwd, bwd, bwd_kept);
  std::fflush(stdout);
}

void run_suite(const SuiteOptions& options, Tally& tally) {
  if (options.check && options.small) {  // every walk once, at the recall width (sanitizers)
    for (bool normalize : {false, true}) check_case(cases()[3], 1, 128, 128, normalize, tally);
    check_case(cases().back(), 1, 64, 32, true, tally);  // packed, with a length-1 sequence
    check_kept_forward(cases()[3], 128, 128, tally);
  } else if (options.check) {
    for (bool normalize : {false, true}) {
      for (const Case& c : cases()) {
        for (int64_t width : {32, 64, 128}) check_case(c, 2, width, width, normalize, tally);
      }
      check_case(cases()[3], 2, 64, 128, normalize, tally);      // K != V: T = 65
      check_case(cases().back(), 2, 128, 32, normalize, tally);  // packed
      check_against_cpu(cases()[4], 128, 128, normalize, tally);
      check_against_cpu(cases().back(), 64, 32, normalize, tally);
      check_finite_differences(normalize, tally);
      check_deterministic(cases()[4], 128, 128, normalize, tally);
      check_deterministic(cases().back(), 64, 64, normalize, tally);
    }
    check_kept_forward(cases()[4], 128, 128, tally);    // T = 300
    check_kept_forward(cases().back(), 64, 32, tally);  // packed, with a length-1 sequence
    check_kept_forward(cases()[3], 32, 128, tally);     // T = 65, V > K
    check_argument_errors(tally);
  }
  if (options.bench) {
    for (int64_t T : {1024, 2048})  // the recall benchmark's linear layers
      for (bool normalize : {false, true}) bench(32, T, 2, 128, 128, normalize);
  }
}

const bool registered = register_suite("linear_attn", run_suite);

}  // namespace
}  // namespace kda::gpu_check
