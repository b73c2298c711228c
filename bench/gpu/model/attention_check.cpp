// Suite "attention": the CUDA causal attention op (ops/attention/cuda/attention_cuda.h) against a
// float64 host reference computed on the inputs the device sees (bf16-rounded for bf16). Every
// case runs in fp32 (the plain kernel, or the split decode with the plain kernel; held to 1e-5)
// and bf16 (tensor-core prefill for Tq >= 16, tensor-core split decode for small Tq, the plain
// kernel for layouts they do not take; held to 1e-2). o is poisoned before each call.
// Cases: Tq = Tk = 1; prefill not a multiple of the tiles (65, 300); chunked prefill and decode of
// a few tokens with q_offset; a cache longer than what the queries see; MLA absorbed decode (MQA
// Hq = 32 / 64, Dk = 576, Dv = 512, v aliasing k); GPT-2, Kimi MLA-expanded prefill and the tiny
// model's shapes; grouped heads; strided q (aligned and not); head dims not a multiple of 8.
// Tk_device (the key count read from device memory, Tk only the plan's bound): MLA and GPT-2
// decode at n = 1, 33, 1000, 8192 of 8192 and Tq = 2 at n = 500, the cache past n and the
// workspace NaN; one launch captured in a graph and replayed with other n.
// Batch (AttentionArgs::batch = 3 over packed qkv rows with a gap between sequences; T = 1, 17,
// 200, Hq = 4, Hkv = 2, D = 64 and 128 (o and lse batch-strided too), GPT-2 T = 256 H = 12):
// o and lse bit-identical to one call per sequence; batch 2 on the decode paths throws.
// Timings (--bench): prefill H = 32, Dk = 192, Dv = 128 at T = 4096, 16384 (TFLOP/s); MLA
// decode (Hq = 32, Hkv = 1, Dk = 576, Dv = 512) at Tk = 4096, 32768, 131072 (cache read GB/s).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "bench/gpu/model/gpu_suite.h"
#include "core/parallel.h"
#include "ops/attention/cuda/attention_cuda.h"
#include "ops/attention/cuda/attention_kernels.cuh"

namespace kda::gpu_check {
namespace {

namespace cu = ops::cuda;

uint64_t fresh_seed() {
  static uint64_t next = 0xa77e57ull;
  return next++;
}

struct Case {
  std::string name;
  int64_t Tq = 1, Tk = 1, Hq = 1, Hkv = 1, Dk = 64, Dv = 64, q_offset = 0;
  int64_t q_pad = 0;     // q_row_stride = Hq * Dk + q_pad (0: dense)
  bool v_alias = false;  // v = the first Dv values of each k row (Hkv = 1)
};

// The element strides the op sees.
struct Strides {
  int64_t q, k, v;
};
Strides strides_of(const Case& c) {
  Strides s;
  s.q = c.Hq * c.Dk + c.q_pad;
  s.k = c.Hkv * c.Dk;
  s.v = c.v_alias ? s.k : c.Hkv * c.Dv;
  return s;
}

// o [Tq, Hq, Dv] in float64: query t (position q_offset + t) over keys 0 .. q_offset + t.
std::vector<double> reference(const Case& c, const std::vector<double>& q,
                              const std::vector<double>& k, const std::vector<double>& v,
                              double scale) {
  const Strides st = strides_of(c);
  const int64_t group = c.Hq / c.Hkv;
  std::vector<double> o(size_t(c.Tq * c.Hq * c.Dv));
  parallel_for(c.Tq * c.Hq, [&](int64_t row) {
    const int64_t t = row / c.Hq, h = row % c.Hq, kvh = h / group;
    const int64_t n = c.q_offset + t + 1;
    std::vector<double> s(static_cast<size_t>(n));
    double mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      double dot = 0;
      for (int64_t d = 0; d < c.Dk; ++d)
        dot += q[t * st.q + h * c.Dk + d] * k[j * st.k + kvh * c.Dk + d];
      s[j] = scale * dot;
      mx = std::max(mx, s[j]);
    }
    double sum = 0;
    for (int64_t j = 0; j < n; ++j) sum += (s[j] = std::exp(s[j] - mx));
    double* out = o.data() + row * c.Dv;
    for (int64_t d = 0; d < c.Dv; ++d) out[d] = 0;
    for (int64_t j = 0; j < n; ++j) {
      const double w = s[j] / sum;
      const double* vr = v.data() + j * st.v + kvh * c.Dv;
      for (int64_t d = 0; d < c.Dv; ++d) out[d] += w * vr[d];
    }
  });
  return o;
}

struct Inputs {
  DeviceArray q, k, v;
  cu::AttentionArgs args;
};

Inputs make_inputs(const Case& c, ElementType type) {
  const Strides st = strides_of(c);
  Inputs in;
  in.q = to_device(random_values(size_t(c.Tq * st.q), fresh_seed(), 2.f), type);
  in.k = to_device(random_values(size_t(c.Tk * st.k), fresh_seed()), type);
  if (!c.v_alias) in.v = to_device(random_values(size_t(c.Tk * st.v), fresh_seed()), type);
  cu::AttentionArgs& a = in.args;
  a.dtype = type;
  a.Tq = c.Tq;
  a.Tk = c.Tk;
  a.Hq = c.Hq;
  a.Hkv = c.Hkv;
  a.Dk = c.Dk;
  a.Dv = c.Dv;
  a.q = in.q.data();
  a.k = in.k.data();
  a.v = c.v_alias ? in.k.data() : in.v.data();
  a.q_row_stride = c.q_pad ? st.q : 0;
  a.k_row_stride = 0;
  a.v_row_stride = c.v_alias ? st.v : 0;
  a.q_offset = c.q_offset;
  return in;
}

void run_case(const Case& c, ElementType type, Tally& tally) {
  Inputs in = make_inputs(c, type);
  DeviceBuffer o(size_t(c.Tq * c.Hq * c.Dv) * sizeof(float));
  poison(o.data(), o.bytes());
  in.args.o = o.as<float>();
  DeviceBuffer workspace(cu::attention_workspace_bytes(in.args));
  cu::attention_forward(in.args, workspace.data(), workspace.bytes(), nullptr);
  cu::check_cuda(cudaDeviceSynchronize(), "attention check");
  const std::vector<double> got =
      from_device(o.data(), size_t(c.Tq * c.Hq * c.Dv), ElementType::f32);
  const std::vector<double>& vref = c.v_alias ? in.k.rounded : in.v.rounded;
  const std::vector<double> want =
      reference(c, in.q.rounded, in.k.rounded, vref, 1.0 / std::sqrt(double(c.Dk)));
  const bool f32 = type == ElementType::f32;
  report(tally, "attention " + c.name + (f32 ? " f32" : " bf16"), rel_error(got, want),
         f32 ? 1e-5 : 1e-2);
}

std::vector<Case> check_cases() {
  std::vector<Case> cases;
  auto add = [&](Case c) { cases.push_back(c); };
  add({.name = "Tq=Tk=1 Hq=4 Hkv=2 D=64", .Tq = 1, .Tk = 1, .Hq = 4, .Hkv = 2});
  add({.name = "prefill T=65 H=2 D=128",
       .Tq = 65,
       .Tk = 65,
       .Hq = 2,
       .Hkv = 2,
       .Dk = 128,
       .Dv = 128});
  add({.name = "prefill T=300 H=3 D=128",
       .Tq = 300,
       .Tk = 300,
       .Hq = 3,
       .Hkv = 3,
       .Dk = 128,
       .Dv = 128});
  add({.name = "chunked prefill Tq=100 q_offset=50",
       .Tq = 100,
       .Tk = 150,
       .Hq = 4,
       .Hkv = 2,
       .q_offset = 50});
  add({.name = "chunked prefill Tq=200 q_offset=70 Hq=4 Hkv=2 D=128",  // the TMA forward
       .Tq = 200,
       .Tk = 270,
       .Hq = 4,
       .Hkv = 2,
       .Dk = 128,
       .Dv = 128,
       .q_offset = 70});
  add({.name = "decode Tq=5 q_offset=200 Tk=205",
       .Tq = 5,
       .Tk = 205,
       .Hq = 4,
       .Hkv = 4,
       .q_offset = 200});
  add({.name = "decode Tq=3 q_offset=100 Tk=300 (longer cache)",
       .Tq = 3,
       .Tk = 300,
       .Hq = 2,
       .Hkv = 1,
       .q_offset = 100});
  add({.name = "MLA decode Tq=1 Tk=5000 Hq=32 Hkv=1 576/512 v=k",
       .Tq = 1,
       .Tk = 5000,
       .Hq = 32,
       .Hkv = 1,
       .Dk = 576,
       .Dv = 512,
       .q_offset = 4999,
       .v_alias = true});
  add({.name = "MLA decode Tq=4 Tk=1000 Hq=64 Hkv=1 576/512 v=k",
       .Tq = 4,
       .Tk = 1000,
       .Hq = 64,
       .Hkv = 1,
       .Dk = 576,
       .Dv = 512,
       .q_offset = 996,
       .v_alias = true});
  // The bulk-copy MLA decode kernel (32-key tiles): a cache shorter than a tile, one key past a
  // tile, many tiles per split, rows with no visible key in late splits, 16 heads (one row
  // block); and a head dim of 128 (the cp.async decode kernel).
  for (int64_t Tk : {20, 33, 40000})
    add({.name = "MLA decode Tq=1 Tk=" + std::to_string(Tk) + " Hq=32 Hkv=1 576/512 v=k",
         .Tq = 1,
         .Tk = Tk,
         .Hq = 32,
         .Hkv = 1,
         .Dk = 576,
         .Dv = 512,
         .q_offset = Tk - 1,
         .v_alias = true});
  add({.name = "MLA decode Tq=2 Tk=3000 q_offset=1000 Hq=32 576/512 v=k (longer cache)",
       .Tq = 2,
       .Tk = 3000,
       .Hq = 32,
       .Hkv = 1,
       .Dk = 576,
       .Dv = 512,
       .q_offset = 1000,
       .v_alias = true});
  add({.name = "MLA decode Tq=1 Tk=777 Hq=16 Hkv=1 576/512 v=k",
       .Tq = 1,
       .Tk = 777,
       .Hq = 16,
       .Hkv = 1,
       .Dk = 576,
       .Dv = 512,
       .q_offset = 776,
       .v_alias = true});
  add({.name = "decode Tq=1 Tk=1000 Hq=8 Hkv=2 D=128",
       .Tq = 1,
       .Tk = 1000,
       .Hq = 8,
       .Hkv = 2,
       .Dk = 128,
       .Dv = 128,
       .q_offset = 999});
  add({.name = "MLA absorbed Tq=20 Tk=40 Hq=2 576/512 v=k",
       .Tq = 20,
       .Tk = 40,
       .Hq = 2,
       .Hkv = 1,
       .Dk = 576,
       .Dv = 512,
       .q_offset = 20,
       .v_alias = true});
  add({.name = "decode Tq=12 q_offset=500 Tk=512 Hq=8 Hkv=1 D=64 (3 row groups)",
       .Tq = 12,
       .Tk = 512,
       .Hq = 8,
       .Hkv = 1,
       .q_offset = 500});
  add({.name = "GPT-2 prefill T=300 H=12 D=64", .Tq = 300, .Tk = 300, .Hq = 12, .Hkv = 12});
  add({.name = "GPT-2 decode Tq=1 Tk=300 H=12 D=64",
       .Tq = 1,
       .Tk = 300,
       .Hq = 12,
       .Hkv = 12,
       .q_offset = 299});
  add({.name = "Kimi prefill T=1024 H=32 192/128",
       .Tq = 1024,
       .Tk = 1024,
       .Hq = 32,
       .Hkv = 32,
       .Dk = 192,
       .Dv = 128});
  add({.name = "tiny prefill T=65 H=4 24/16",
       .Tq = 65,
       .Tk = 65,
       .Hq = 4,
       .Hkv = 4,
       .Dk = 24,
       .Dv = 16});
  add({.name = "tiny decode Tq=1 Tk=65 H=4 24/16",
       .Tq = 1,
       .Tk = 65,
       .Hq = 4,
       .Hkv = 4,
       .Dk = 24,
       .Dv = 16,
       .q_offset = 64});
  add({.name = "GQA prefill T=200 Hq=8 Hkv=2 D=64", .Tq = 200, .Tk = 200, .Hq = 8, .Hkv = 2});
  add({.name = "GQA decode Tq=2 Tk=700 Hq=8 Hkv=2 D=64",
       .Tq = 2,
       .Tk = 700,
       .Hq = 8,
       .Hkv = 2,
       .q_offset = 698});
  add({.name = "strided q (+8) prefill T=80 H=4 D=64",
       .Tq = 80,
       .Tk = 80,
       .Hq = 4,
       .Hkv = 4,
       .q_pad = 8});
  add({.name = "strided q (+3) prefill T=80 H=4 D=64",
       .Tq = 80,
       .Tk = 80,
       .Hq = 4,
       .Hkv = 4,
       .q_pad = 3});
  add({.name = "strided q (+8) decode Tq=1 Tk=90 H=4 D=64",
       .Tq = 1,
       .Tk = 90,
       .Hq = 4,
       .Hkv = 4,
       .q_offset = 89,
       .q_pad = 8});
  add({.name = "prefill T=80 H=2 256/256",
       .Tq = 80,
       .Tk = 80,
       .Hq = 2,
       .Hkv = 2,
       .Dk = 256,
       .Dv = 256});
  add({.name = "prefill T=70 H=2 20/12 (dims not x8)",
       .Tq = 70,
       .Tk = 70,
       .Hq = 2,
       .Hkv = 1,
       .Dk = 20,
       .Dv = 12});
  add({.name = "decode Tq=1 Tk=70 H=2 20/12 (dims not x8)",
       .Tq = 1,
       .Tk = 70,
       .Hq = 2,
       .Hkv = 1,
       .Dk = 20,
       .Dv = 12,
       .q_offset = 69});
  return cases;
}

void check_bad_arguments(Tally& tally) {
  cu::AttentionArgs a;
  a.Tq = 4;
  a.Tk = 3;  // < q_offset + Tq
  a.Dk = a.Dv = 64;
  bool threw = false;
  try {
    cu::attention_workspace_bytes(a);
  } catch (const kda::Error&) {
    threw = true;
  }
  report(tally, "attention rejects Tk < q_offset + Tq", threw ? 0.0 : 1.0, 0.0);
}

// ---- Tk_device: one launch (plan, grid, workspace sized by the bound Tk) over n keys read from
// device memory, as a captured decode graph replays it while the cache grows.

// NaN bytes in every cache row >= n (k, and v unless it aliases k): keys past n must not leak.
void poison_cache_from(const Case& c, const Inputs& in, ElementType type, int64_t n) {
  const Strides st = strides_of(c);
  const size_t e = cu::element_bytes(type);
  poison(static_cast<char*>(in.k.data()) + size_t(n * st.k) * e, size_t((c.Tk - n) * st.k) * e);
  if (!c.v_alias)
    poison(static_cast<char*>(in.v.data()) + size_t(n * st.v) * e, size_t((c.Tk - n) * st.v) * e);
}

// o against the reference over the first n keys, queries at n - Tq + t.
double device_len_error(const Case& c, const Inputs& in, const DeviceBuffer& o, int64_t n) {
  Case used = c;
  used.Tk = n;
  used.q_offset = n - c.Tq;
  const std::vector<double> got =
      from_device(o.data(), size_t(c.Tq * c.Hq * c.Dv), ElementType::f32);
  const std::vector<double>& vref = c.v_alias ? in.k.rounded : in.v.rounded;
  return rel_error(
      got, reference(used, in.q.rounded, in.k.rounded, vref, 1.0 / std::sqrt(double(c.Dk))));
}

void set_device_len(DeviceBuffer& len, int64_t n) {
  const int32_t value = int32_t(n);
  len.upload(&value, sizeof(value));
}

// c.Tk is the plan's bound; n keys in use, the rest NaN; workspace poisoned too (an empty split's
// partials must not leak).
void run_device_len_case(const Case& c, ElementType type, int64_t n, Tally& tally) {
  Inputs in = make_inputs(c, type);
  poison_cache_from(c, in, type, n);
  DeviceBuffer len(sizeof(int32_t));
  set_device_len(len, n);
  in.args.Tk_device = len.as<int32_t>();
  in.args.q_offset = c.Tk;  // ignored with Tk_device (would be out of range otherwise)
  DeviceBuffer o(size_t(c.Tq * c.Hq * c.Dv) * sizeof(float));
  poison(o.data(), o.bytes());
  in.args.o = o.as<float>();
  DeviceBuffer workspace(cu::attention_workspace_bytes(in.args));
  poison(workspace.data(), workspace.bytes());
  cu::attention_forward(in.args, workspace.data(), workspace.bytes(), nullptr);
  cu::check_cuda(cudaDeviceSynchronize(), "attention check (Tk_device)");
  const bool f32 = type == ElementType::f32;
  report(tally,
         "attention Tk_device " + c.name + " n=" + std::to_string(n) + (f32 ? " f32" : " bf16"),
         device_len_error(c, in, o, n), f32 ? 1e-5 : 1e-2);
}

// The graph use: one launch captured once (same args, same workspace), replayed with other n.
// Cache rows >= the largest n are NaN.
void run_device_len_replay(const Case& c, ElementType type, Tally& tally) {
  const std::vector<int64_t> ns = {1000, 33, 5000, 1, 1000};
  const int64_t n_max = *std::max_element(ns.begin(), ns.end());
  Inputs in = make_inputs(c, type);
  poison_cache_from(c, in, type, n_max);
  DeviceBuffer len(sizeof(int32_t));
  in.args.Tk_device = len.as<int32_t>();
  DeviceBuffer o(size_t(c.Tq * c.Hq * c.Dv) * sizeof(float));
  in.args.o = o.as<float>();
  DeviceBuffer workspace(cu::attention_workspace_bytes(in.args));
  poison(workspace.data(), workspace.bytes());
  cudaStream_t stream = nullptr;
  cu::check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  cudaGraphExec_t graph = nullptr;
  double worst = 0;
  for (size_t i = 0; i < ns.size(); ++i) {
    set_device_len(len, ns[i]);
    poison(o.data(), o.bytes());
    // The copies and memsets ran on the legacy stream, which `stream` does not wait for.
    cu::check_cuda(cudaDeviceSynchronize(), "attention check (Tk_device replay setup)");
    if (i == 0) {  // eager first (caches the kernels' attributes), then capture
      cu::attention_forward(in.args, workspace.data(), workspace.bytes(), stream);
    } else {
      if (graph == nullptr) {
        cudaGraph_t captured = nullptr;
        cu::check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal),
                       "cudaStreamBeginCapture");
        cu::attention_forward(in.args, workspace.data(), workspace.bytes(), stream);
        cu::check_cuda(cudaStreamEndCapture(stream, &captured), "cudaStreamEndCapture");
        const cudaError_t made = cudaGraphInstantiate(&graph, captured, 0);
        cudaGraphDestroy(captured);
        cu::check_cuda(made, "cudaGraphInstantiate");
      }
      cu::check_cuda(cudaGraphLaunch(graph, stream), "cudaGraphLaunch");
    }
    cu::check_cuda(cudaStreamSynchronize(stream), "attention check (Tk_device replay)");
    worst = std::max(worst, device_len_error(c, in, o, ns[i]));
  }
  if (graph) cudaGraphExecDestroy(graph);
  cudaStreamDestroy(stream);
  const bool f32 = type == ElementType::f32;
  report(
      tally,
      "attention Tk_device graph replay n=1000,33,5000,1,1000 " + c.name + (f32 ? " f32" : " bf16"),
      worst, f32 ? 1e-5 : 1e-2);
}

std::vector<Case> device_len_shapes() {
  const int64_t bound = 8192;
  return {{.name = "MLA Tq=1 Tk<=8192 Hq=32 Hkv=1 576/512 v=k",
           .Tq = 1,
           .Tk = bound,
           .Hq = 32,
           .Hkv = 1,
           .Dk = 576,
           .Dv = 512,
           .v_alias = true},
          {.name = "GPT-2 Tq=1 Tk<=8192 H=12 D=64", .Tq = 1, .Tk = bound, .Hq = 12, .Hkv = 12}};
}

void check_device_len(Tally& tally) {
  for (const Case& shape : device_len_shapes()) {
    for (ElementType type : {ElementType::f32, ElementType::bf16}) {
      for (int64_t n : {1, 33, 1000, 8192}) run_device_len_case(shape, type, n, tally);
      Case two = shape;
      two.Tq = 2;
      two.name += " Tq=2";
      run_device_len_case(two, type, 500, tally);
      run_device_len_replay(shape, type, tally);
    }
  }
  // Prefill-sized Tq has no Tk_device path: it must throw, not run.
  cu::AttentionArgs a;
  a.Tq = 16;
  a.Tk = 64;
  a.Dk = a.Dv = 64;
  a.Tk_device = reinterpret_cast<const int32_t*>(uintptr_t(16));  // never dereferenced
  bool threw = false;
  try {
    cu::attention_workspace_bytes(a);
  } catch (const kda::Error&) {
    threw = true;
  }
  report(tally, "attention rejects Tk_device with Tq = 16", threw ? 0.0 : 1.0, 0.0);
}

// ---- Batch: B sequences in one launch (packed qkv rows, a gap between sequences: non-dense
// batch strides) equal B calls of one sequence each, bit for bit (o and lse poisoned first).
struct BatchShape {
  std::string name;
  int64_t T = 1, Hq = 4, Hkv = 2, D = 64;
  bool padded_out = false;  // o / lse batch strides past the dense ones (else 0: dense)
};

// Sequence b's first n elements of `stride`-apart float blocks at p, concatenated.
std::vector<double> download_blocks(const float* p, int64_t batch, int64_t stride, int64_t n) {
  std::vector<double> all;
  for (int64_t b = 0; b < batch; ++b) {
    const std::vector<double> part = from_device(p + b * stride, size_t(n), ElementType::f32);
    all.insert(all.end(), part.begin(), part.end());
  }
  return all;
}

void run_batched_case(const BatchShape& c, ElementType type, Tally& tally) {
  const int64_t B = 3;
  const int64_t W = (c.Hq + 2 * c.Hkv) * c.D;  // a packed qkv row
  const int64_t seq = c.T * W + 24;            // elements between sequences (a gap of 24)
  const size_t e = cu::element_bytes(type);
  const DeviceArray qkv = to_device(random_values(size_t(B * seq), fresh_seed(), 1.5f), type);
  const char* base = static_cast<const char*>(qkv.data());
  const int64_t o_n = c.T * c.Hq * c.D, lse_n = c.T * c.Hq;
  const int64_t o_seq = o_n + (c.padded_out ? 8 : 0), lse_seq = lse_n + (c.padded_out ? 4 : 0);

  cu::AttentionArgs a;
  a.dtype = type;
  a.Tq = a.Tk = c.T;
  a.Hq = c.Hq;
  a.Hkv = c.Hkv;
  a.Dk = a.Dv = c.D;
  a.q_row_stride = a.k_row_stride = a.v_row_stride = W;
  const auto point_at = [&](cu::AttentionArgs& args, int64_t b) {
    const char* row0 = base + size_t(b * seq) * e;
    args.q = row0;
    args.k = row0 + size_t(c.Hq * c.D) * e;
    args.v = row0 + size_t((c.Hq + c.Hkv) * c.D) * e;
  };

  DeviceBuffer o(size_t(B * o_seq) * 4), lse(size_t(B * lse_seq) * 4);
  poison(o.data(), o.bytes());
  poison(lse.data(), lse.bytes());
  cu::AttentionArgs batched = a;
  point_at(batched, 0);
  batched.batch = B;
  batched.q_batch_stride = batched.k_batch_stride = batched.v_batch_stride = seq;
  batched.o_batch_stride = c.padded_out ? o_seq : 0;
  batched.lse_batch_stride = c.padded_out ? lse_seq : 0;
  batched.o = o.as<float>();
  batched.lse = lse.as<float>();
  DeviceBuffer workspace(cu::attention_workspace_bytes(batched));
  cu::attention_forward(batched, workspace.data(), workspace.bytes(), nullptr);

  DeviceBuffer o1(size_t(B * o_seq) * 4), lse1(size_t(B * lse_seq) * 4);
  poison(o1.data(), o1.bytes());
  poison(lse1.data(), lse1.bytes());
  for (int64_t b = 0; b < B; ++b) {
    cu::AttentionArgs one = a;
    point_at(one, b);
    one.o = o1.as<float>() + b * o_seq;
    one.lse = lse1.as<float>() + b * lse_seq;
    DeviceBuffer ws(cu::attention_workspace_bytes(one));
    cu::attention_forward(one, ws.data(), ws.bytes(), nullptr);
  }
  cu::check_cuda(cudaDeviceSynchronize(), "attention check (batch)");

  const std::string tag = " batch=3 " + c.name + (type == ElementType::f32 ? " f32" : " bf16");
  report(tally, "attention o" + tag + " == one by one",
         rel_error(download_blocks(o.as<float>(), B, o_seq, o_n),
                   download_blocks(o1.as<float>(), B, o_seq, o_n)),
         0.0);
  report(tally, "attention lse" + tag + " == one by one",
         rel_error(download_blocks(lse.as<float>(), B, lse_seq, lse_n),
                   download_blocks(lse1.as<float>(), B, lse_seq, lse_n)),
         0.0);
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

// The split decode paths take batch == 1 only: batch 2 there throws before anything runs.
void check_batch_rejects_decode(Tally& tally) {
  cu::AttentionArgs a;
  a.Tq = 1;  // decode-sized, no lse: the split path
  a.Tk = 64;
  a.q_offset = 63;
  a.Dk = a.Dv = 64;
  a.batch = 2;
  const char* fake = reinterpret_cast<const char*>(uintptr_t(256));  // never dereferenced
  a.q = a.k = a.v = fake;
  a.o = reinterpret_cast<float*>(uintptr_t(256));
  bool threw = false;
  try {
    cu::attention_forward(a, nullptr, 0, nullptr);
  } catch (const kda::Error&) {
    threw = true;
  }
  report(tally, "attention rejects batch=2 on the split decode path", threw ? 0.0 : 1.0, 0.0);
  a.Tk_device = reinterpret_cast<const int32_t*>(uintptr_t(16));  // never dereferenced
  threw = false;
  try {
    cu::attention_workspace_bytes(a);
  } catch (const kda::Error&) {
    threw = true;
  }
  report(tally, "attention rejects batch=2 with Tk_device", threw ? 0.0 : 1.0, 0.0);
}

double median_ms(const cu::AttentionArgs& args, DeviceBuffer& workspace) {
  return time_ms(
      nullptr, [&] { cu::attention_forward(args, workspace.data(), workspace.bytes(), nullptr); });
}

void bench_prefill(int64_t T) {
  Case c{.name = "bench", .Tq = T, .Tk = T, .Hq = 32, .Hkv = 32, .Dk = 192, .Dv = 128};
  Inputs in = make_inputs(c, ElementType::bf16);
  DeviceBuffer o(size_t(T * c.Hq * c.Dv) * sizeof(float));
  in.args.o = o.as<float>();
  DeviceBuffer workspace(cu::attention_workspace_bytes(in.args));
  const double ms = median_ms(in.args, workspace);
  const double flops = double(T) * double(T + 1) * double(c.Hq) * double(c.Dk + c.Dv);
  std::printf("BENCH attention prefill bf16 T=%lld H=32 Dk=192 Dv=128: %.3f ms, %.1f TFLOP/s\n",
              (long long)T, ms, flops / (ms * 1e-3) / 1e12);
  std::fflush(stdout);
}

void bench_decode(const char* what, int64_t Tk, int64_t Hq, int64_t Hkv, int64_t Dk, int64_t Dv,
                  bool v_alias) {
  Case c{.name = "bench",
         .Tq = 1,
         .Tk = Tk,
         .Hq = Hq,
         .Hkv = Hkv,
         .Dk = Dk,
         .Dv = Dv,
         .q_offset = Tk - 1,
         .v_alias = v_alias};
  Inputs in = make_inputs(c, ElementType::bf16);
  DeviceBuffer o(size_t(c.Hq * c.Dv) * sizeof(float));
  in.args.o = o.as<float>();
  DeviceBuffer workspace(cu::attention_workspace_bytes(in.args));
  const double ms = median_ms(in.args, workspace);
  const double bytes = double(Tk) * double(Hkv) * double(v_alias ? Dk : Dk + Dv) * 2.0;
  const double tbs = bytes / (ms * 1e-3) / 1e12;
  std::printf(
      "BENCH attention decode %s Tk=%lld Hq=%lld Hkv=%lld %lld/%lld: %.1f us, cache %.0f GB/s "
      "(%.0f%% of 4.25 TB/s copy)\n",
      what, (long long)Tk, (long long)Hq, (long long)Hkv, (long long)Dk, (long long)Dv, ms * 1e3,
      tbs * 1e3, 100.0 * tbs / 4.25);
  std::fflush(stdout);
}

// The wgmma building blocks alone (ops/attention/cuda/wgmma_probe.cu) against float64 products
// of the same bf16 inputs: S = A B^T through swizzled shared memory, O = P V with P in registers
// and V transposed. Tells a layout error from an attention error.
// The probes' operands (A, B 64 x 128; P 64 x 64; V 64 x 128, bf16) and their float64 products
// S = A B^T, O = P V on the rounded values.
struct ProbeProblem {
  DeviceArray a, b, pm, v;
  std::vector<double> s_ref, o_ref;
};

ProbeProblem make_probe_problem() {
  ProbeProblem p{to_device(random_values(64 * 128, fresh_seed()), ElementType::bf16),
                 to_device(random_values(64 * 128, fresh_seed()), ElementType::bf16),
                 to_device(random_values(64 * 64, fresh_seed()), ElementType::bf16),
                 to_device(random_values(64 * 128, fresh_seed()), ElementType::bf16),
                 std::vector<double>(64 * 64, 0.0),
                 std::vector<double>(64 * 128, 0.0)};
  for (int i = 0; i < 64; ++i) {
    for (int j = 0; j < 64; ++j)
      for (int k = 0; k < 128; ++k)
        p.s_ref[i * 64 + j] += p.a.rounded[i * 128 + k] * p.b.rounded[j * 128 + k];
    for (int key = 0; key < 64; ++key)
      for (int d = 0; d < 128; ++d)
        p.o_ref[i * 128 + d] += p.pm.rounded[i * 64 + key] * p.v.rounded[key * 128 + d];
  }
  return p;
}

void check_wgmma_probe(Tally& tally) {
  const ProbeProblem p = make_probe_problem();
  DeviceBuffer s(64 * 64 * 4), o(64 * 128 * 4);
  poison(s.data(), s.bytes());
  poison(o.data(), o.bytes());
  if (!ops::cuda_detail::run_wgmma_probe(p.a.data(), p.b.data(), p.pm.data(), p.v.data(),
                                         s.as<float>(), o.as<float>(), nullptr)) {
    std::printf("(wgmma probe skipped: not a compute capability 9 device)\n");
    return;
  }
  cu::check_cuda(cudaDeviceSynchronize(), "wgmma probe");
  report(tally, "wgmma probe S = A B^T (m64n64k16, both operands from swizzled shared memory)",
         rel_error(from_device(s.data(), p.s_ref.size(), ElementType::f32), p.s_ref), 1e-5);
  report(tally, "wgmma probe O = P V (m64n128k16, P in registers, V^T in shared memory)",
         rel_error(from_device(o.data(), p.o_ref.size(), ElementType::f32), p.o_ref), 1e-5);
}

// The TMA path's building blocks (attention_prefill_tma.cu): TMA's 128-byte swizzle against
// the K-major descriptors, and V read MN-major by the descriptor. The (LBO, SBO) assignment the
// kernel uses is checked; the swapped one is printed, to say which is right if the check fails.
void check_tma_probe(Tally& tally) {
  const ProbeProblem p = make_probe_problem();
  DeviceBuffer s(64 * 64 * 4), o(64 * 128 * 4), o_swapped(64 * 128 * 4);
  poison(s.data(), s.bytes());
  poison(o.data(), o.bytes());
  poison(o_swapped.data(), o_swapped.bytes());
  if (!ops::cuda_detail::run_tma_probe(p.a.data(), p.b.data(), p.pm.data(), p.v.data(),
                                       s.as<float>(), o.as<float>(), o_swapped.as<float>(),
                                       nullptr)) {
    std::printf(
        "(TMA probe skipped: not a compute capability 9 device, or no tensor-map encoder)\n");
    return;
  }
  cu::check_cuda(cudaDeviceSynchronize(), "TMA probe");
  report(tally, "TMA probe S = A B^T (A, B by TMA with the 128-byte swizzle, K-major descriptors)",
         rel_error(from_device(s.data(), p.s_ref.size(), ElementType::f32), p.s_ref), 1e-5);
  report(tally, "TMA probe O = P V (V by TMA, read MN-major: LBO 8 KB along N, SBO 1 KB along K)",
         rel_error(from_device(o.data(), p.o_ref.size(), ElementType::f32), p.o_ref), 1e-5);
  std::printf("(TMA probe, LBO and SBO swapped: rel=%.3e)\n",
              rel_error(from_device(o_swapped.data(), p.o_ref.size(), ElementType::f32), p.o_ref));
}

void run_suite(const SuiteOptions& options, Tally& tally) {
  if (options.check) {
    check_wgmma_probe(tally);
    check_tma_probe(tally);
    for (const Case& c : check_cases()) {
      run_case(c, ElementType::f32, tally);
      run_case(c, ElementType::bf16, tally);
    }
    check_bad_arguments(tally);
    check_device_len(tally);
    for (const BatchShape& c : batch_shapes()) {
      run_batched_case(c, ElementType::f32, tally);
      run_batched_case(c, ElementType::bf16, tally);
    }
    check_batch_rejects_decode(tally);
  }
  if (options.bench) {
    bench_prefill(4096);
    bench_prefill(16384);
    for (int64_t Tk : {4096, 32768, 131072}) bench_decode("MLA", Tk, 32, 1, 576, 512, true);
    bench_decode("MLA", 32768, 64, 1, 576, 512, true);
    bench_decode("GPT-2", 8192, 12, 12, 64, 64, false);
  }
}

const bool registered = register_suite("attention", run_suite);

}  // namespace
}  // namespace kda::gpu_check
