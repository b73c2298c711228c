// Suite "attention_bwd": the CUDA attention forward's lse and the backward
// (ops/attention/cuda/attention_cuda.h: attention_backward) against a float64 host reference
// computed on the inputs the device sees (bf16-rounded for bf16). Each case runs the forward
// with lse (o, lse poisoned), then the backward (dq, dk, dv and the workspace poisoned) twice:
// lse held to 1e-5 (f32) / 1e-3 (bf16), each gradient to 1e-5 / 2e-2 (relative RMS), the second
// run bit-identical to the first (dq within kDqAtomicsTol where it is summed by atomics).
// Cases: T = 1, 65, 300, 1000 x (H = 4, GQA 8 / 2) x D = 64, 128; chunked (q_offset) and a cache
// longer than the queries see (keys no query sees: gradients 0); strided q; Dk != Dv; dims not a
// multiple of 8 (bf16 falls back to the plain kernels); o written in bf16 (o_bf16: GQA cases,
// the plain kernels too) and read back by the backward. Bad arguments throw.
// Batch (AttentionArgs::batch = 3 over packed qkv rows with a gap between sequences; T = 1, 17,
// 200, Hq = 4, Hkv = 2, D = 64 and 128 (o and lse batch-strided too), GPT-2 T = 256 H = 12):
// forward o, lse and backward dq, dk, dv bit-identical to one call per sequence (dq within
// kDqAtomicsTol where it is summed by atomics).
// Timings (--bench): bf16 forward (with lse) and backward at T = 2048, 8192 for GPT-2 (H = 12,
// D = 64) and H = 32, D = 128; backward TFLOP/s counted as 2.5x the forward's FLOPs (FA2's
// convention; the deterministic split recomputes S and dP in the dq kernel: 3.5x done).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bench/gpu/model/gpu_suite.h"
#include "core/parallel.h"
#include "ops/attention/cuda/attention_cuda.h"

namespace kda::gpu_check {
namespace {

namespace cu = ops::cuda;

uint64_t fresh_seed() {
  static uint64_t next = 0xb4c7ull;
  return next++;
}

struct Case {
  std::string name;
  int64_t Tq = 1, Tk = 1, Hq = 1, Hkv = 1, Dk = 64, Dv = 64, q_offset = 0;
  int64_t q_pad = 0;  // q_row_stride = Hq * Dk + q_pad (0: dense)
};

int64_t q_stride_of(const Case& c) {
  return c.Hq * c.Dk + c.q_pad;
}

struct Reference {
  std::vector<double> o, lse, dq, dk, dv;
};

// Float64 forward and backward (gradients of sum(o * d_o)); q with row stride q_stride_of(c),
// the rest dense.
Reference reference(const Case& c, const std::vector<double>& q, const std::vector<double>& k,
                    const std::vector<double>& v, const std::vector<double>& d_o, double scale) {
  const int64_t qs = q_stride_of(c), group = c.Hq / c.Hkv;
  Reference r;
  r.o.assign(size_t(c.Tq * c.Hq * c.Dv), 0.0);
  r.lse.assign(size_t(c.Tq * c.Hq), 0.0);
  r.dq.assign(size_t(c.Tq * c.Hq * c.Dk), 0.0);
  r.dk.assign(size_t(c.Tk * c.Hkv * c.Dk), 0.0);
  r.dv.assign(size_t(c.Tk * c.Hkv * c.Dv), 0.0);
  std::vector<double> delta(size_t(c.Tq * c.Hq));
  auto qrow = [&](int64_t t, int64_t h) { return q.data() + t * qs + h * c.Dk; };
  auto krow = [&](int64_t j, int64_t kvh) { return k.data() + (j * c.Hkv + kvh) * c.Dk; };
  auto vrow = [&](int64_t j, int64_t kvh) { return v.data() + (j * c.Hkv + kvh) * c.Dv; };
  auto dorow = [&](int64_t t, int64_t h) { return d_o.data() + (t * c.Hq + h) * c.Dv; };
  auto dot = [](const double* a, const double* b, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
  };
  // Rows: o, lse, delta, dq.
  parallel_for(c.Tq * c.Hq, [&](int64_t row) {
    const int64_t t = row / c.Hq, h = row % c.Hq, kvh = h / group;
    const int64_t n = c.q_offset + t + 1;
    std::vector<double> p(static_cast<size_t>(n));
    double mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j)
      mx = std::max(mx, p[j] = scale * dot(qrow(t, h), krow(j, kvh), c.Dk));
    double sum = 0;
    for (int64_t j = 0; j < n; ++j) sum += std::exp(p[j] - mx);
    const double lse = mx + std::log(sum);
    r.lse[row] = lse;
    double* o = r.o.data() + row * c.Dv;
    for (int64_t j = 0; j < n; ++j) {
      p[j] = std::exp(p[j] - lse);
      for (int64_t d = 0; d < c.Dv; ++d) o[d] += p[j] * vrow(j, kvh)[d];
    }
    const double D = dot(dorow(t, h), o, c.Dv);
    delta[row] = D;
    double* dq = r.dq.data() + row * c.Dk;
    for (int64_t j = 0; j < n; ++j) {
      const double ds = p[j] * (dot(dorow(t, h), vrow(j, kvh), c.Dv) - D);
      for (int64_t d = 0; d < c.Dk; ++d) dq[d] += scale * ds * krow(j, kvh)[d];
    }
  });
  // Key rows: dk, dv over the query heads of the group and the queries that see the key.
  parallel_for(c.Tk * c.Hkv, [&](int64_t krow_index) {
    const int64_t j = krow_index / c.Hkv, kvh = krow_index % c.Hkv;
    double* dk = r.dk.data() + krow_index * c.Dk;
    double* dv = r.dv.data() + krow_index * c.Dv;
    for (int64_t hh = 0; hh < group; ++hh) {
      const int64_t h = kvh * group + hh;
      for (int64_t t = std::max<int64_t>(0, j - c.q_offset); t < c.Tq; ++t) {
        const int64_t row = t * c.Hq + h;
        const double p = std::exp(scale * dot(qrow(t, h), krow(j, kvh), c.Dk) - r.lse[row]);
        const double ds = p * (dot(dorow(t, h), vrow(j, kvh), c.Dv) - delta[row]);
        for (int64_t d = 0; d < c.Dv; ++d) dv[d] += p * dorow(t, h)[d];
        for (int64_t d = 0; d < c.Dk; ++d) dk[d] += scale * ds * qrow(t, h)[d];
      }
    }
  });
  return r;
}

struct Problem {
  DeviceArray q, k, v, d_o;
  DeviceBuffer o, lse;
  cu::AttentionArgs args;
};

// o_bf16: the forward writes o in bf16 (AttentionArgs::o_bf16) and the backward reads it there.
Problem make_problem(const Case& c, ElementType type, bool o_bf16 = false) {
  Problem pr;
  pr.q = to_device(random_values(size_t(c.Tq * q_stride_of(c)), fresh_seed(), 2.f), type);
  pr.k = to_device(random_values(size_t(c.Tk * c.Hkv * c.Dk), fresh_seed()), type);
  pr.v = to_device(random_values(size_t(c.Tk * c.Hkv * c.Dv), fresh_seed()), type);
  pr.d_o = to_device(random_values(size_t(c.Tq * c.Hq * c.Dv), fresh_seed()), type);
  pr.o.resize(size_t(c.Tq * c.Hq * c.Dv) * (o_bf16 ? 2 : sizeof(float)));
  pr.lse.resize(size_t(c.Tq * c.Hq) * sizeof(float));
  cu::AttentionArgs& a = pr.args;
  a.dtype = type;
  a.Tq = c.Tq;
  a.Tk = c.Tk;
  a.Hq = c.Hq;
  a.Hkv = c.Hkv;
  a.Dk = c.Dk;
  a.Dv = c.Dv;
  a.q = pr.q.data();
  a.k = pr.k.data();
  a.v = pr.v.data();
  a.q_row_stride = c.q_pad ? q_stride_of(c) : 0;
  a.q_offset = c.q_offset;
  if (o_bf16)
    a.o_bf16 = pr.o.data();
  else
    a.o = pr.o.as<float>();
  a.lse = pr.lse.as<float>();
  return pr;
}

struct Grads {
  DeviceBuffer dq, dk, dv;
};

// Where dq is summed by fp32 atomics (attention_backward_dq_deterministic false), two runs or a
// batch and its sequences one by one may differ by the order of the sums: a bf16 dq element
// then moves by at most one rounding step (2^-8 relative), a few elements in a run.
constexpr double kDqAtomicsTol = 1e-3;

Grads run_backward(const Case& c, Problem& pr, ElementType type) {
  const size_t e = cu::element_bytes(type);
  Grads g;
  g.dq.resize(size_t(c.Tq * c.Hq * c.Dk) * e);
  g.dk.resize(size_t(c.Tk * c.Hkv * c.Dk) * e);
  g.dv.resize(size_t(c.Tk * c.Hkv * c.Dv) * e);
  poison(g.dq.data(), g.dq.bytes());
  poison(g.dk.data(), g.dk.bytes());
  poison(g.dv.data(), g.dv.bytes());
  DeviceBuffer workspace(cu::attention_backward_workspace_bytes(pr.args));
  poison(workspace.data(), workspace.bytes());
  cu::attention_backward(pr.args, pr.lse.as<float>(), pr.d_o.data(), g.dq.data(), g.dk.data(),
                         g.dv.data(), workspace.data(), workspace.bytes(), nullptr);
  cu::check_cuda(cudaDeviceSynchronize(), "attention_bwd check (backward)");
  return g;
}

bool same_bytes(const DeviceBuffer& a, const DeviceBuffer& b) {
  std::vector<unsigned char> ha(a.bytes()), hb(b.bytes());
  cu::check_cuda(cudaMemcpy(ha.data(), a.data(), a.bytes(), cudaMemcpyDeviceToHost), "download");
  cu::check_cuda(cudaMemcpy(hb.data(), b.data(), b.bytes(), cudaMemcpyDeviceToHost), "download");
  return ha.size() == hb.size() && std::memcmp(ha.data(), hb.data(), ha.size()) == 0;
}

void run_case(const Case& c, ElementType type, Tally& tally, bool o_bf16 = false) {
  const bool f32 = type == ElementType::f32;
  const std::string tag = " " + c.name + (f32 ? " f32" : " bf16") + (o_bf16 ? " o_bf16" : "");
  Problem pr = make_problem(c, type, o_bf16);
  poison(pr.o.data(), pr.o.bytes());
  poison(pr.lse.data(), pr.lse.bytes());
  DeviceBuffer fwd_workspace(cu::attention_workspace_bytes(pr.args));
  cu::attention_forward(pr.args, fwd_workspace.data(), fwd_workspace.bytes(), nullptr);
  cu::check_cuda(cudaDeviceSynchronize(), "attention_bwd check (forward)");

  const Reference ref = reference(c, pr.q.rounded, pr.k.rounded, pr.v.rounded, pr.d_o.rounded,
                                  1.0 / std::sqrt(double(c.Dk)));
  const std::vector<double> lse = from_device(pr.lse.data(), size_t(c.Tq * c.Hq), ElementType::f32);
  const std::vector<double> o = from_device(pr.o.data(), size_t(c.Tq * c.Hq * c.Dv),
                                            o_bf16 ? ElementType::bf16 : ElementType::f32);
  report(tally, "attention_bwd lse" + tag, rel_error(lse, ref.lse), f32 ? 1e-5 : 1e-3);
  // (a bf16 o is the fp32 result rounded: 2^-9 relative at most)
  report(tally, "attention_bwd o" + tag, rel_error(o, ref.o), f32 && !o_bf16 ? 1e-5 : 1e-2);

  const Grads g = run_backward(c, pr, type);
  const double tol = f32 && !o_bf16 ? 1e-5 : 2e-2;
  report(tally, "attention_bwd dq" + tag,
         rel_error(from_device(g.dq.data(), ref.dq.size(), type), ref.dq), tol);
  report(tally, "attention_bwd dk" + tag,
         rel_error(from_device(g.dk.data(), ref.dk.size(), type), ref.dk), tol);
  report(tally, "attention_bwd dv" + tag,
         rel_error(from_device(g.dv.data(), ref.dv.size(), type), ref.dv), tol);
  const Grads again = run_backward(c, pr, type);
  const bool identical = same_bytes(g.dk, again.dk) && same_bytes(g.dv, again.dv);
  if (cu::attention_backward_dq_deterministic(pr.args)) {
    report(tally, "attention_bwd deterministic" + tag,
           identical && same_bytes(g.dq, again.dq) ? 0.0 : 1.0, 0.0);
  } else {  // dq summed by atomics: the same up to the order of its fp32 sums
    report(tally, "attention_bwd deterministic dk, dv" + tag, identical ? 0.0 : 1.0, 0.0);
    report(tally, "attention_bwd dq run to run (atomic sums)" + tag,
           rel_error(from_device(g.dq.data(), ref.dq.size(), type),
                     from_device(again.dq.data(), ref.dq.size(), type)),
           kDqAtomicsTol);
  }
}

std::vector<Case> check_cases() {
  std::vector<Case> cases;
  for (int64_t T : {1, 65, 300, 1000})
    for (int64_t D : {64, 128})
      for (auto [Hq, Hkv] : {std::pair<int64_t, int64_t>{4, 4}, {8, 2}})
        cases.push_back({.name = "T=" + std::to_string(T) + " Hq=" + std::to_string(Hq) +
                                 " Hkv=" + std::to_string(Hkv) + " D=" + std::to_string(D),
                         .Tq = T,
                         .Tk = T,
                         .Hq = Hq,
                         .Hkv = Hkv,
                         .Dk = D,
                         .Dv = D});
  cases.push_back({.name = "chunked Tq=100 q_offset=50 Hq=4 Hkv=2 D=64",
                   .Tq = 100,
                   .Tk = 150,
                   .Hq = 4,
                   .Hkv = 2,
                   .q_offset = 50});
  // (D = 128: the wgmma kernel's masks with an offset inside a tile, and GQA)
  cases.push_back({.name = "chunked Tq=200 q_offset=70 Hq=4 Hkv=2 D=128",
                   .Tq = 200,
                   .Tk = 270,
                   .Hq = 4,
                   .Hkv = 2,
                   .Dk = 128,
                   .Dv = 128,
                   .q_offset = 70});
  cases.push_back({.name = "longer cache Tq=70 q_offset=30 Tk=230 H=2 D=128 (unseen keys)",
                   .Tq = 70,
                   .Tk = 230,
                   .Hq = 2,
                   .Hkv = 2,
                   .Dk = 128,
                   .Dv = 128,
                   .q_offset = 30});
  cases.push_back({.name = "strided q (+8) T=130 H=3 D=64",
                   .Tq = 130,
                   .Tk = 130,
                   .Hq = 3,
                   .Hkv = 3,
                   .q_pad = 8});
  cases.push_back({.name = "T=200 H=2 Dk=128 Dv=64",
                   .Tq = 200,
                   .Tk = 200,
                   .Hq = 2,
                   .Hkv = 1,
                   .Dk = 128,
                   .Dv = 64});
  cases.push_back({.name = "T=100 H=2 Dk=32 Dv=48",
                   .Tq = 100,
                   .Tk = 100,
                   .Hq = 2,
                   .Hkv = 2,
                   .Dk = 32,
                   .Dv = 48});
  cases.push_back({.name = "T=90 H=2 20/12 (dims not x8)",
                   .Tq = 90,
                   .Tk = 90,
                   .Hq = 2,
                   .Hkv = 1,
                   .Dk = 20,
                   .Dv = 12});
  cases.push_back({.name = "T=150 H=2 192/128 (plain kernels)",
                   .Tq = 150,
                   .Tk = 150,
                   .Hq = 2,
                   .Hkv = 2,
                   .Dk = 192,
                   .Dv = 128});
  return cases;
}

// ---- Batch: B sequences in one forward and one backward launch (packed qkv rows with a gap
// between sequences: non-dense q / k / v batch strides; d_o, dq, dk, dv dense [B, ...]) equal B
// calls of one sequence each, bit for bit (every output and the workspaces poisoned first).
struct BatchShape {
  std::string name;
  int64_t T = 1, Hq = 4, Hkv = 2, D = 64;
  bool padded_out = false;  // o / lse batch strides past the dense ones (else 0: dense)
};

// The first n elements of each of `batch` blocks `stride` elements apart, concatenated.
std::vector<double> download_blocks(const void* p, ElementType type, int64_t batch, int64_t stride,
                                    int64_t n) {
  const size_t e = cu::element_bytes(type);
  std::vector<double> all;
  for (int64_t b = 0; b < batch; ++b) {
    const std::vector<double> part =
        from_device(static_cast<const char*>(p) + size_t(b * stride) * e, size_t(n), type);
    all.insert(all.end(), part.begin(), part.end());
  }
  return all;
}

// Forward (with lse) then backward outputs of one run.
struct BatchRun {
  DeviceBuffer o, lse, dq, dk, dv;
};

void run_batched_case(const BatchShape& c, ElementType type, Tally& tally) {
  const int64_t B = 3, T = c.T, D = c.D;
  const int64_t W = (c.Hq + 2 * c.Hkv) * D;  // a packed qkv row
  const int64_t seq = T * W + 24;            // elements between sequences (a gap of 24)
  const size_t e = cu::element_bytes(type);
  const DeviceArray qkv = to_device(random_values(size_t(B * seq), fresh_seed(), 1.5f), type);
  const DeviceArray d_o = to_device(random_values(size_t(B * T * c.Hq * D), fresh_seed()), type);
  const char* base = static_cast<const char*>(qkv.data());
  const int64_t o_n = T * c.Hq * D, lse_n = T * c.Hq, dq_n = T * c.Hq * D, dkv_n = T * c.Hkv * D;
  const int64_t o_seq = o_n + (c.padded_out ? 8 : 0), lse_seq = lse_n + (c.padded_out ? 4 : 0);

  cu::AttentionArgs a;
  a.dtype = type;
  a.Tq = a.Tk = T;
  a.Hq = c.Hq;
  a.Hkv = c.Hkv;
  a.Dk = a.Dv = D;
  a.q_row_stride = a.k_row_stride = a.v_row_stride = W;
  const auto point_at = [&](cu::AttentionArgs& args, int64_t b) {
    const char* row0 = base + size_t(b * seq) * e;
    args.q = row0;
    args.k = row0 + size_t(c.Hq * D) * e;
    args.v = row0 + size_t((c.Hq + c.Hkv) * D) * e;
  };
  const auto make_run = [&] {
    BatchRun r;
    r.o.resize(size_t(B * o_seq) * 4);
    r.lse.resize(size_t(B * lse_seq) * 4);
    r.dq.resize(size_t(B * dq_n) * e);
    r.dk.resize(size_t(B * dkv_n) * e);
    r.dv.resize(size_t(B * dkv_n) * e);
    for (DeviceBuffer* buf : {&r.o, &r.lse, &r.dq, &r.dk, &r.dv}) poison(buf->data(), buf->bytes());
    return r;
  };
  const auto forward_backward = [&](const cu::AttentionArgs& args, const void* dout, void* dq,
                                    void* dk, void* dv) {
    DeviceBuffer fwd_ws(cu::attention_workspace_bytes(args));
    cu::attention_forward(args, fwd_ws.data(), fwd_ws.bytes(), nullptr);
    DeviceBuffer bwd_ws(cu::attention_backward_workspace_bytes(args));
    poison(bwd_ws.data(), bwd_ws.bytes());
    cu::attention_backward(args, args.lse, dout, dq, dk, dv, bwd_ws.data(), bwd_ws.bytes(),
                           nullptr);
  };

  BatchRun batched = make_run();
  cu::AttentionArgs all = a;
  point_at(all, 0);
  all.batch = B;
  all.q_batch_stride = all.k_batch_stride = all.v_batch_stride = seq;
  all.o_batch_stride = c.padded_out ? o_seq : 0;
  all.lse_batch_stride = c.padded_out ? lse_seq : 0;
  all.o = batched.o.as<float>();
  all.lse = batched.lse.as<float>();
  forward_backward(all, d_o.data(), batched.dq.data(), batched.dk.data(), batched.dv.data());

  BatchRun single = make_run();
  for (int64_t b = 0; b < B; ++b) {
    cu::AttentionArgs one = a;
    point_at(one, b);
    one.o = single.o.as<float>() + b * o_seq;
    one.lse = single.lse.as<float>() + b * lse_seq;
    forward_backward(one, static_cast<const char*>(d_o.data()) + size_t(b * o_n) * e,
                     static_cast<char*>(single.dq.data()) + size_t(b * dq_n) * e,
                     static_cast<char*>(single.dk.data()) + size_t(b * dkv_n) * e,
                     static_cast<char*>(single.dv.data()) + size_t(b * dkv_n) * e);
  }
  cu::check_cuda(cudaDeviceSynchronize(), "attention_bwd check (batch)");

  const std::string tag = " batch=3 " + c.name + (type == ElementType::f32 ? " f32" : " bf16");
  const auto same = [&](const std::string& what, const DeviceBuffer& x, const DeviceBuffer& y,
                        ElementType t, int64_t stride, int64_t n, double tol = 0.0) {
    report(tally, "attention_bwd " + what + tag + " == one by one",
           rel_error(download_blocks(x.data(), t, B, stride, n),
                     download_blocks(y.data(), t, B, stride, n)),
           tol);
  };
  const bool dq_exact = cu::attention_backward_dq_deterministic(all);
  same("o", batched.o, single.o, ElementType::f32, o_seq, o_n);
  same("lse", batched.lse, single.lse, ElementType::f32, lse_seq, lse_n);
  same(dq_exact ? "dq" : "dq (atomic sums)", batched.dq, single.dq, type, dq_n, dq_n,
       dq_exact ? 0.0 : kDqAtomicsTol);
  same("dk", batched.dk, single.dk, type, dkv_n, dkv_n);
  same("dv", batched.dv, single.dv, type, dkv_n, dkv_n);

  // The same batched backward with the gradients as column blocks of one packed row
  // [dq | dk | dv | 8 unused] (AttentionGradLayout): equal to the dense ones, the gap untouched.
  const int64_t Wg = W + 8;
  DeviceBuffer packed(size_t(B * T * Wg) * e);
  poison(packed.data(), packed.bytes());
  {
    char* g = static_cast<char*>(packed.data());
    DeviceBuffer bwd_ws(cu::attention_backward_workspace_bytes(all));
    cu::attention_backward(all, all.lse, d_o.data(), g, g + size_t(c.Hq * D) * e,
                           g + size_t((c.Hq + c.Hkv) * D) * e, bwd_ws.data(), bwd_ws.bytes(),
                           nullptr,
                           {.dq_row_stride = Wg, .dk_row_stride = Wg, .dv_row_stride = Wg});
    cu::check_cuda(cudaDeviceSynchronize(), "attention_bwd check (packed gradients)");
  }
  const std::vector<double> rows = from_device(packed.data(), size_t(B * T * Wg), type);
  const auto column_block = [&](int64_t col0, int64_t width) {
    std::vector<double> out;
    for (int64_t r = 0; r < B * T; ++r)
      out.insert(out.end(), rows.begin() + r * Wg + col0, rows.begin() + r * Wg + col0 + width);
    return out;
  };
  const auto dense = [&](const DeviceBuffer& x, int64_t n) {
    return from_device(x.data(), size_t(B * n), type);
  };
  report(tally, "attention_bwd dk, dv packed in one row" + tag + " == dense",
         std::max(rel_error(column_block(c.Hq * D, c.Hkv * D), dense(batched.dk, dkv_n)),
                  rel_error(column_block((c.Hq + c.Hkv) * D, c.Hkv * D), dense(batched.dv, dkv_n))),
         0.0);
  report(tally, "attention_bwd dq packed in one row" + tag + " == dense",
         rel_error(column_block(0, c.Hq * D), dense(batched.dq, dq_n)),
         dq_exact ? 0.0 : kDqAtomicsTol);
  const std::vector<double> gap = column_block(W, 8);
  report(tally, "attention_bwd packed gradients leave the row's gap alone" + tag,
         std::all_of(gap.begin(), gap.end(), [](double x) { return std::isnan(x); }) ? 0.0 : 1.0,
         0.0);
}

// The backward workspace holds per-row lse2 / D_i for every sequence: batch 3 needs 3x.
void check_batch_workspace(Tally& tally) {
  cu::AttentionArgs a;
  a.Tq = a.Tk = 100;
  a.Hq = 4;
  a.Hkv = 2;
  a.Dk = a.Dv = 64;
  const size_t one = cu::attention_backward_workspace_bytes(a);
  a.batch = 3;
  const size_t three = cu::attention_backward_workspace_bytes(a);
  report(tally, "attention_bwd workspace for batch=3 is 3x batch=1",
         one > 0 && three == 3 * one ? 0.0 : 1.0, 0.0);
}

std::vector<BatchShape> batch_shapes() {
  std::vector<BatchShape> shapes;
  for (int64_t D : {64, 128})
    for (int64_t T : {1, 17, 200})
      shapes.push_back({.name = "T=" + std::to_string(T) + " Hq=4 Hkv=2 D=" + std::to_string(D) +
                                (D == 128 ? " (o, lse strided)" : ""),
                        .T = T,
                        .D = D,
                        .padded_out = D == 128});
  shapes.push_back({.name = "GPT-2 T=256 H=12 D=64", .T = 256, .Hq = 12, .Hkv = 12, .D = 64});
  return shapes;
}

template <class Fn>
bool throws(Fn&& fn) {
  try {
    fn();
  } catch (const kda::Error&) {
    return true;
  }
  return false;
}

void check_bad_arguments(Tally& tally) {
  cu::AttentionArgs a;
  a.Tq = 4;
  a.Tk = 8;
  a.Dk = a.Dv = 64;
  a.Tk_device = reinterpret_cast<const int32_t*>(uintptr_t(16));  // never dereferenced
  report(tally, "attention_bwd rejects Tk_device",
         throws([&] { cu::attention_backward_workspace_bytes(a); }) ? 0.0 : 1.0, 0.0);
  a.lse = reinterpret_cast<float*>(uintptr_t(16));
  report(tally, "attention forward rejects lse with Tk_device",
         throws([&] { cu::attention_workspace_bytes(a); }) ? 0.0 : 1.0, 0.0);
  a.Tk_device = nullptr;
  a.lse = nullptr;
  a.Tk = 3;  // < q_offset + Tq
  report(tally, "attention_bwd rejects Tk < q_offset + Tq",
         throws([&] { cu::attention_backward_workspace_bytes(a); }) ? 0.0 : 1.0, 0.0);
  // A workspace one byte short throws before anything runs.
  Case c{.name = "small", .Tq = 16, .Tk = 16, .Hq = 2, .Hkv = 2};
  Problem pr = make_problem(c, ElementType::bf16);
  const size_t need = cu::attention_backward_workspace_bytes(pr.args);
  DeviceBuffer workspace(need), grads(size_t(16 * 2 * 64) * 2 * 3);
  char* gp = static_cast<char*>(grads.data());
  report(tally, "attention_bwd rejects a short workspace",
         throws([&] {
           cu::attention_backward(pr.args, pr.lse.as<float>(), pr.d_o.data(), gp, gp + 4096,
                                  gp + 8192, workspace.data(), need - 1, nullptr);
         })
             ? 0.0
             : 1.0,
         0.0);
  // o and o_bf16: exactly one of them; a bf16 o only on the direct paths (not split decode)
  Problem pb = make_problem(c, ElementType::bf16, true);
  cu::AttentionArgs both = pb.args;
  both.o = pr.o.as<float>();
  report(tally, "attention forward rejects o and o_bf16 together",
         throws([&] { cu::attention_forward(both, nullptr, 0, nullptr); }) ? 0.0 : 1.0, 0.0);
  report(tally, "attention_bwd rejects o and o_bf16 together",
         throws([&] {
           cu::attention_backward(both, pb.lse.as<float>(), pb.d_o.data(), gp, gp + 4096, gp + 8192,
                                  workspace.data(), need, nullptr);
         })
             ? 0.0
             : 1.0,
         0.0);
  cu::AttentionArgs split = pb.args;  // 4 queries after 12 keys, no lse: the split decode path
  split.Tq = 4;
  split.q_offset = 12;
  split.lse = nullptr;
  DeviceBuffer split_ws(cu::attention_workspace_bytes(split));
  report(tally, "attention forward rejects o_bf16 on the split decode path",
         throws([&] { cu::attention_forward(split, split_ws.data(), split_ws.bytes(), nullptr); })
             ? 0.0
             : 1.0,
         0.0);
}

void bench(int64_t T, int64_t H, int64_t D) {
  Case c{.name = "bench", .Tq = T, .Tk = T, .Hq = H, .Hkv = H, .Dk = D, .Dv = D};
  Problem pr = make_problem(c, ElementType::bf16);
  DeviceBuffer fwd_workspace(cu::attention_workspace_bytes(pr.args));
  Grads g;
  g.dq.resize(size_t(T * H * D) * 2);
  g.dk.resize(size_t(T * H * D) * 2);
  g.dv.resize(size_t(T * H * D) * 2);
  DeviceBuffer workspace(cu::attention_backward_workspace_bytes(pr.args));
  const double fwd_ms = time_ms(nullptr, [&] {
    cu::attention_forward(pr.args, fwd_workspace.data(), fwd_workspace.bytes(), nullptr);
  });
  const double bwd_ms = time_ms(nullptr, [&] {
    cu::attention_backward(pr.args, pr.lse.as<float>(), pr.d_o.data(), g.dq.data(), g.dk.data(),
                           g.dv.data(), workspace.data(), workspace.bytes(), nullptr);
  });
  const double fwd_flops = double(T) * double(T + 1) * double(H) * double(2 * D);
  std::printf(
      "BENCH attention_bwd bf16 T=%lld H=%lld D=%lld: fwd %.3f ms (%.1f TFLOP/s), bwd %.3f ms "
      "(%.1f TFLOP/s at 2.5x fwd FLOPs; %.2fx fwd time)\n",
      (long long)T, (long long)H, (long long)D, fwd_ms, fwd_flops / (fwd_ms * 1e-3) / 1e12, bwd_ms,
      2.5 * fwd_flops / (bwd_ms * 1e-3) / 1e12, bwd_ms / fwd_ms);
  std::fflush(stdout);
}

void run_suite(const SuiteOptions& options, Tally& tally) {
  if (options.check) {
    for (const Case& c : check_cases()) {
      run_case(c, ElementType::f32, tally);
      run_case(c, ElementType::bf16, tally);
      // bf16 o: the tensor-core kernels (bf16) and the plain kernel (f32, dims not x8)
      if (c.Tq >= 65 && (c.Hq != c.Hkv || c.Dk % 8 != 0)) {
        run_case(c, ElementType::bf16, tally, true);
        if (c.Dk % 8 != 0) run_case(c, ElementType::f32, tally, true);
      }
    }
    check_bad_arguments(tally);
    for (const BatchShape& c : batch_shapes()) {
      run_batched_case(c, ElementType::f32, tally);
      run_batched_case(c, ElementType::bf16, tally);
    }
    check_batch_workspace(tally);
  }
  if (options.bench) {
    for (int64_t T : {2048, 8192}) {
      bench(T, 12, 64);
      bench(T, 32, 128);
    }
  }
}

const bool registered = register_suite("attention_bwd", run_suite);

}  // namespace
}  // namespace kda::gpu_check
