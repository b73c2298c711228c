// Benchmarks (--bench) and the profiler run (--profile): the copy and cuBLAS bf16 GEMM
// ceilings, the chunked forward and forward + backward rows (KDA, Gated DeltaNet, the KDA layer's
// options), the decode rows with their same-size ceilings and CUDA graph replays, speculative
// decoding; printed as BENCH lines and written to the tab-separated FILE (--out).
#include <cublas_v2.h>

#include "bench/gpu/check/check_common.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/random.h"

namespace kda_gpu_check {
namespace {

struct Timer {
  // Median over `reps` samples of the time (ms) of `batch` back-to-back calls fn(i), divided by
  // `batch`, after `warm` untimed calls. All samples are queued before any is read, so the GPU
  // never waits for the host between them (as triton.testing.do_bench does).
  template <class F>
  double median_ms(F&& fn, int warm, int reps, int batch = 1) {
    for (int i = 0; i < warm; ++i) fn(i);
    ck(cudaDeviceSynchronize(), "warm-up");
    std::vector<cudaEvent_t> ev(2 * reps);
    for (auto& e : ev) ck(cudaEventCreate(&e), "event");
    int call = warm;
    for (int i = 0; i < reps; ++i) {
      ck(cudaEventRecord(ev[2 * i]), "record");
      for (int j = 0; j < batch; ++j) fn(call++);
      ck(cudaEventRecord(ev[2 * i + 1]), "record");
    }
    ck(cudaDeviceSynchronize(), "timed calls");
    std::vector<double> ms;
    for (int i = 0; i < reps; ++i) {
      float t = 0;
      ck(cudaEventElapsedTime(&t, ev[2 * i], ev[2 * i + 1]), "elapsed");
      ms.push_back(t / batch);
    }
    for (auto& e : ev) cudaEventDestroy(e);
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  }
};

// A decode step replayed from a CUDA graph, as the models' decode runs (there one graph a step):
// one step per rotating slot set (step i: set i % sets; >= 16 sets, >= 128 slots: no replay finds
// its states in L2), at least `min_steps` steps captured once, a replay timed as that many steps.
// The launches come from the GPU, so between steps only the kernels' own ramp and tail remain
// (with a.overlap_launch, programmatic edges overlap even those); what the replay adds once (the
// graph's own launch, before its first kernel) is shared by its steps: 1/16 of it each with 16
// steps, 1/64 with 64, closer to a model's graph, where a decode kernel is one of hundreds.
double decode_graph_step_ms(cuda::DecodeArgs a, const int32_t* slot_sets, int sets, int64_t B,
                            Timer& timer, int min_steps = 16) {
  const int steps = sets * ((min_steps + sets - 1) / sets);  // whole passes: set 0 follows the last
  cudaStream_t stream = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "graph stream");
  ck(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
  try {
    for (int i = 0; i < steps; ++i) {
      a.slots = slot_sets + size_t(i % sets) * B;
      cuda::decode_step(a, stream);
    }
    ck(cudaStreamEndCapture(stream, &graph), "end capture");
    ck(cudaGraphInstantiate(&exec, graph, 0), "graph instantiate");
  } catch (...) {  // end the capture (else this thread's later syncs fail), then report
    cudaGraph_t partial = nullptr;
    cudaStreamEndCapture(stream, &partial);
    if (partial) cudaGraphDestroy(partial);
    if (graph) cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
    cudaGetLastError();
    throw;
  }
  const double ms =
      timer.median_ms([&](int) { ck(cudaGraphLaunch(exec, nullptr), "graph launch"); }, 3, 20) /
      steps;
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  return ms;
}

}  // namespace

// Two chunked forwards and backwards (KDA, 8 x 2048, H = 32) and two decode steps (B = 16),
// for ncu.
void run_profile() {
  // KDA_PROFILE_SHAPE=BxT picks the chunked calls' batch and length (default 8x2048)
  int64_t B0 = 8, T0 = 2048;
  if (const char* shape = std::getenv("KDA_PROFILE_SHAPE")) {
    long long b = 0, t = 0;
    if (std::sscanf(shape, "%lldx%lld", &b, &t) != 2 || b < 1 || t < 1)
      throw Error(std::string("KDA_PROFILE_SHAPE: expected BxT, got '") + shape + "'");
    B0 = b, T0 = t;
  }
  require(B0 * T0 >= 16, "KDA_PROFILE_SHAPE: at least 16 tokens (the decode step reads 16)");
  DeltaRuleShape s{B0, T0, 32, 32, 128, 128, Gate::channel, 0};
  const size_t tokens = size_t(B0 * T0), H = 32, K = 128, V = 128;
  DeviceBuffer q(tokens * H * K * 2), k(tokens * H * K * 2), v(tokens * H * V * 2),
      g(tokens * H * K * 2), beta(tokens * H * 2), o(tokens * H * V * 2),
      ht(size_t(B0) * H * K * V * 4);
  fill_device_random_bf16(q, tokens * H * K, 11, -1, 1, true, int(K));
  fill_device_random_bf16(k, tokens * H * K, 12, -1, 1, true, int(K));
  fill_device_random_bf16(v, tokens * H * V, 13, -1, 1);
  fill_device_random_bf16(g, tokens * H * K, 14, -1.0f, -0.01f);
  fill_device_random_bf16(beta, tokens * H, 15, 0.1f, 0.9f);
  cuda::DeltaRuleDeviceInputs d;
  d.shape = s;
  d.q = q.ptr, d.k = k.ptr, d.v = v.ptr, d.g = g.ptr, d.beta = beta.ptr;
  const size_t ws_bytes = cuda::chunk_backward_workspace_bytes(s, {});
  DeviceBuffer ws(ws_bytes);
  for (int i = 0; i < 2; ++i)
    cuda::chunk_forward(d, o.ptr, ht.as<float>(), ws.ptr, ws_bytes, nullptr);
  {
    DeviceBuffer dq(tokens * H * K * 2), dk(tokens * H * K * 2), dv(tokens * H * V * 2),
        dg(tokens * H * K * 2), dbeta(tokens * H * 2);
    fill_device_random_bf16(o, tokens * H * V, 16, -1, 1);  // o reused as d_o
    cuda::DeltaRuleDeviceGrads grads;
    grads.dq = dq.ptr, grads.dk = dk.ptr, grads.dv = dv.ptr, grads.dg = dg.ptr;
    grads.dbeta = dbeta.ptr;
    for (int i = 0; i < 2; ++i)
      cuda::chunk_backward(d, o.ptr, nullptr, grads, ws.ptr, ws_bytes, nullptr);
    ck(cudaDeviceSynchronize(), "profile backward");
    // the training pair (its forward into a second output: o holds d_o here)
    DeviceBuffer o2(tokens * H * V * 2);
    for (int i = 0; i < 2; ++i) {
      cuda::chunk_forward_for_backward(d, o2.ptr, ht.as<float>(), ws.ptr, ws_bytes, nullptr);
      cuda::chunk_backward(d, o.ptr, nullptr, grads, ws.ptr, ws_bytes, nullptr,
                           cuda::ChunkBackwardFrom::kept_forward);
    }
    ck(cudaDeviceSynchronize(), "profile training pair");
  }
  const int64_t B = 16;
  DeviceBuffer pool(size_t(1024) * H * K * V * 4), slots(B * 4);
  std::vector<int32_t> sl(B);
  for (int64_t b = 0; b < B; ++b) sl[b] = int32_t(b * 61 % 1024);
  ck(cudaMemcpy(slots.ptr, sl.data(), B * 4, cudaMemcpyHostToDevice), "slots");
  cuda::DecodeArgs a;
  a.shape = DeltaRuleShape{B, 1, 32, 32, 128, 128, Gate::channel, 0};
  a.q = q.ptr, a.k = k.ptr, a.v = v.ptr, a.g = g.ptr, a.beta = beta.ptr, a.o = o.ptr;
  a.state_pool = pool.as<float>();
  a.slots = slots.as<int32_t>();
  a.num_slots = 1024;
  for (int i = 0; i < 2; ++i) cuda::decode_step(a, nullptr);
  ck(cudaDeviceSynchronize(), "profile");
}

void run_bench(const std::string& out_path) {
  std::ofstream out(out_path);
  Timer timer;
  cudaDeviceProp prop{};
  ck(cudaGetDeviceProperties(&prop, 0), "props");
  std::printf("BENCH device %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20);

  // Ceilings: device-to-device copy (bytes read + written) and a cuBLAS bf16 GEMM.
  double copy_tbs = 0, gemm_tflops = 0;
  {
    const size_t bytes = size_t(2) << 30;
    DeviceBuffer a(bytes), b(bytes);
    ck(cudaMemset(a.ptr, 1, bytes), "memset");
    const double ms = timer.median_ms(
        [&](int) { ck(cudaMemcpyAsync(b.ptr, a.ptr, bytes, cudaMemcpyDeviceToDevice), "copy"); }, 3,
        20);
    copy_tbs = 2.0 * bytes / (ms * 1e-3) / 1e12;
  }
  {
    const int n = 8192;
    DeviceBuffer a(size_t(n) * n * 2), b(size_t(n) * n * 2), c(size_t(n) * n * 2);
    fill_device_random_bf16(a, size_t(n) * n, 1, -1, 1);
    fill_device_random_bf16(b, size_t(n) * n, 2, -1, 1);
    cublasHandle_t h;
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) throw Error("cublasCreate failed");
    const float one = 1, zero = 0;
    const double ms = timer.median_ms(
        [&](int) {
          if (cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a.ptr, CUDA_R_16BF, n, b.ptr,
                           CUDA_R_16BF, n, &zero, c.ptr, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                           CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS)
            throw Error("cublasGemmEx failed");
        },
        3, 10);
    cublasDestroy(h);
    gemm_tflops = 2.0 * n * double(n) * n / (ms * 1e-3) / 1e12;
  }
  std::printf("BENCH ceilings: copy %.2f TB/s (read+write), bf16 GEMM %.0f TFLOP/s\n", copy_tbs,
              gemm_tflops);
  out << "ceiling\tcopy_tbs\t" << copy_tbs << "\n";
  out << "ceiling\tgemm_tflops\t" << gemm_tflops << "\n";

  const int64_t H = 32, K = 128, V = 128;
  struct Shape {
    int64_t B, T;
  };
  // Kernel-lab knob: KDA_BENCH_ONLY=kda times the KDA chunked rows alone (no GDN, no decode);
  // KDA_BENCH_ONLY=chunk the KDA and Gated DeltaNet chunked rows (no decode);
  // KDA_BENCH_ONLY=decode (or --decode) the decode rows alone
  const char* only = std::getenv("KDA_BENCH_ONLY");
  const bool kda_only = only && std::strcmp(only, "kda") == 0;
  const bool chunk_only = kda_only || (only && std::strcmp(only, "chunk") == 0);
  const bool decode_only = g_decode_only || (only && std::strcmp(only, "decode") == 0);
  for (Gate gate : {Gate::channel, Gate::scalar}) {
    if (decode_only) break;
    if (kda_only && gate != Gate::channel) continue;
    for (Shape sh : {Shape{8, 2048}, Shape{2, 8192}, Shape{1, 65536}}) {
      DeltaRuleShape s{sh.B, sh.T, H, H, K, V, gate, 0};
      const size_t tokens = size_t(sh.B * sh.T), gw = size_t(s.gate_width());
      DeviceBuffer q(tokens * H * K * 2), k(tokens * H * K * 2), v(tokens * H * V * 2),
          g(tokens * H * gw * 2), beta(tokens * H * 2), o(tokens * H * V * 2),
          ht(size_t(sh.B) * H * K * V * 4);
      fill_device_random_bf16(q, tokens * H * K, 11, -1, 1, true, int(K));
      fill_device_random_bf16(k, tokens * H * K, 12, -1, 1, true, int(K));
      fill_device_random_bf16(v, tokens * H * V, 13, -1, 1);
      fill_device_random_bf16(g, tokens * H * gw, 14, -1.0f, -0.01f);
      fill_device_random_bf16(beta, tokens * H, 15, 0.1f, 0.9f);
      cuda::DeltaRuleDeviceInputs d;
      d.shape = s;
      d.q = q.ptr, d.k = k.ptr, d.v = v.ptr, d.g = g.ptr, d.beta = beta.ptr;
      // the backward's workspace starts with the forward's layout: one buffer serves both
      const size_t ws_bytes = cuda::chunk_backward_workspace_bytes(s, {});
      DeviceBuffer ws(ws_bytes);
      auto call = [&](int) {
        cuda::chunk_forward(d, o.ptr, ht.as<float>(), ws.ptr, ws_bytes, nullptr);
      };
      const double ms = timer.median_ms(call, 3, 15);
      setenv("KDA_CHUNK_STAGES", "prepare", 1);
      const double prepare_ms = timer.median_ms(call, 2, 10);
      setenv("KDA_CHUNK_STAGES", "state", 1);
      const double state_ms = timer.median_ms(call, 2, 10);
      unsetenv("KDA_CHUNK_STAGES");
      // Floors: each input read once, o and ht written once; FLOPs of the chunked algorithm.
      const double bytes = double(tokens) * H * (2 * K * 2 + V * 2 + gw * 2 + 2 + V * 2) +
                           double(sh.B) * H * K * V * 4;
      const double flops = delta_rule_chunk_forward_flops_per_token(s) * double(tokens);
      const double floor_ms =
          std::max(bytes / (copy_tbs * 1e12), flops / (gemm_tflops * 1e12)) * 1e3;
      std::printf(
          "BENCH chunk_fwd %s %lldx%lld: %.3f ms (prepare %.3f + state %.3f) floor %.3f ms: %.0f "
          "MB, %.1f GFLOP\n",
          gate_name(gate), (long long)sh.B, (long long)sh.T, ms, prepare_ms, state_ms, floor_ms,
          bytes / 1e6, flops / 1e9);
      std::fflush(stdout);
      out << "chunk_fwd_" << gate_name(gate) << "\t" << sh.B << "x" << sh.T << "\t" << ms << "\t"
          << floor_ms << "\n";
      // the KDA layer's in-kernel options (as fla's anchor: l2norm q / k, the lower-bound
      // gate from graw with A_log and dt_bias, sigmoid(braw)); the same tensors as raw inputs
      DeviceBuffer A_dev(H * 4), dt_dev(H * K * 4);
      cuda::DeltaRuleDeviceInputs dl = d;
      if (gate == Gate::channel) {
        std::vector<float> A_log(H, 0.f), dt_bias(H * K);
        Random rng(18);
        for (float& x : dt_bias) x = rng.uniform(-0.5f, 0.5f);
        ck(cudaMemcpy(A_dev.ptr, A_log.data(), A_dev.bytes, cudaMemcpyHostToDevice), "A_log");
        ck(cudaMemcpy(dt_dev.ptr, dt_bias.data(), dt_dev.bytes, cudaMemcpyHostToDevice), "dt");
        dl.kda_layer.l2norm_qk = true;
        dl.kda_layer.gate_in_kernel = true;
        dl.kda_layer.gate = KdaGate::lower_bound;
        dl.kda_layer.lower_bound = -5.f;
        dl.kda_layer.A_log = A_dev.as<float>();
        dl.kda_layer.dt_bias = dt_dev.as<float>();
        dl.kda_layer.beta_sigmoid = true;
        // Kernel-lab knob: KDA_LAYER_OPTS=[n][g][b] keeps only those options (timing only)
        if (const char* opts = std::getenv("KDA_LAYER_OPTS")) {
          dl.kda_layer.l2norm_qk = std::strchr(opts, 'n') != nullptr;
          dl.kda_layer.gate_in_kernel = std::strchr(opts, 'g') != nullptr;
          dl.kda_layer.beta_sigmoid = std::strchr(opts, 'b') != nullptr;
        }
        auto layer_call = [&](int) {
          cuda::chunk_forward(dl, o.ptr, ht.as<float>(), ws.ptr, ws_bytes, nullptr);
        };
        const double layer_ms = timer.median_ms(layer_call, 3, 15);
        setenv("KDA_CHUNK_STAGES", "prepare", 1);
        const double layer_prepare_ms = timer.median_ms(layer_call, 2, 10);
        unsetenv("KDA_CHUNK_STAGES");
        std::printf(
            "BENCH chunk_fwd kda-layer %lldx%lld: %.3f ms (prepare %.3f; l2norm, "
            "lower-bound gate, sigmoid beta in the kernel)\n",
            (long long)sh.B, (long long)sh.T, layer_ms, layer_prepare_ms);
        std::fflush(stdout);
        out << "chunk_fwd_kda_layer\t" << sh.B << "x" << sh.T << "\t" << layer_ms << "\t"
            << floor_ms << "\n";
      }

      // Forward + backward (as a training step: o and ht, then every gradient from do and dht).
      DeviceBuffer d_o(tokens * H * V * 2), dht(size_t(sh.B) * H * K * V * 4),
          dq(tokens * H * K * 2), dk(tokens * H * K * 2), dv(tokens * H * V * 2),
          dg(tokens * H * gw * 2), dbeta(tokens * H * 2);
      fill_device_random_bf16(d_o, tokens * H * V, 16, -1, 1);
      {
        std::vector<float> h(size_t(sh.B) * H * K * V);
        Random rng(17);
        rng.fill_normal(h, 0.1f);
        ck(cudaMemcpy(dht.ptr, h.data(), dht.bytes, cudaMemcpyHostToDevice), "dht");
      }
      cuda::DeltaRuleDeviceGrads grads;
      grads.dq = dq.ptr, grads.dk = dk.ptr, grads.dv = dv.ptr, grads.dg = dg.ptr;
      grads.dbeta = dbeta.ptr;
      auto backward = [&](int) {
        cuda::chunk_backward(d, d_o.ptr, dht.as<float>(), grads, ws.ptr, ws_bytes, nullptr);
      };
      // the training pair: the forward keeps what the backward needs (no recompute) ...
      const double fb_ms = timer.median_ms(
          [&](int) {
            cuda::chunk_forward_for_backward(d, o.ptr, ht.as<float>(), ws.ptr, ws_bytes, nullptr);
            cuda::chunk_backward(d, d_o.ptr, dht.as<float>(), grads, ws.ptr, ws_bytes, nullptr,
                                 cuda::ChunkBackwardFrom::kept_forward);
          },
          2, 10);
      // ... and the plain forward with a backward that recomputes
      const double fb_recompute_ms = timer.median_ms(
          [&](int i) {
            call(i);
            backward(i);
          },
          2, 10);
      const double bwd_ms = timer.median_ms(backward, 1, 10);
      double stage_ms[3] = {0, 0, 0};
      const char* stages[3] = {"recompute", "state", "local"};
      for (int st = 0; st < 3; ++st) {
        setenv("KDA_BWD_STAGES", stages[st], 1);
        stage_ms[st] = timer.median_ms(backward, 1, 10);
      }
      unsetenv("KDA_BWD_STAGES");
      // Floors: forward bytes + the backward's (inputs and do read, gradients written, dht
      // read); FLOPs taken as 3x the forward's (the backward's products are about twice the
      // forward's; an estimate, not a count).
      const double bwd_bytes = double(tokens) * H * (2 * (2 * K * 2 + V * 2 + gw * 2 + 2) + V * 2) +
                               double(sh.B) * H * K * V * 4;
      const double fb_floor_ms =
          std::max((bytes + bwd_bytes) / (copy_tbs * 1e12), 3 * flops / (gemm_tflops * 1e12)) * 1e3;
      std::printf(
          "BENCH chunk_fwd+bwd %s %lldx%lld: %.3f ms kept forward, %.3f ms recompute (bwd alone "
          "%.3f "
          "= recompute %.3f + state_bwd %.3f + local %.3f) floor %.3f ms\n",
          gate_name(gate), (long long)sh.B, (long long)sh.T, fb_ms, fb_recompute_ms, bwd_ms,
          stage_ms[0], stage_ms[1], stage_ms[2], fb_floor_ms);
      std::fflush(stdout);
      out << "chunk_fwdbwd_" << gate_name(gate) << "\t" << sh.B << "x" << sh.T << "\t" << fb_ms
          << "\t" << fb_floor_ms << "\n";
      out << "chunk_fwdbwd_" << gate_name(gate) << "_recompute\t" << sh.B << "x" << sh.T << "\t"
          << fb_recompute_ms << "\t" << fb_floor_ms << "\n";
      if (gate == Gate::channel) {
        // the same with the layer's options: gradients of the raw q, k, graw, braw, and of
        // A_log, dt_bias (floor as the plain op's: the two small arrays add nothing)
        DeviceBuffer dA(H * 4), ddt(H * K * 4);
        cuda::DeltaRuleDeviceGrads lgrads = grads;
        lgrads.dA_log = dA.as<float>();
        lgrads.ddt_bias = ddt.as<float>();
        auto layer_backward = [&](int) {
          cuda::chunk_backward(dl, d_o.ptr, dht.as<float>(), lgrads, ws.ptr, ws_bytes, nullptr);
        };
        const double lfb_ms = timer.median_ms(
            [&](int) {
              cuda::chunk_forward_for_backward(dl, o.ptr, ht.as<float>(), ws.ptr, ws_bytes,
                                               nullptr);
              cuda::chunk_backward(dl, d_o.ptr, dht.as<float>(), lgrads, ws.ptr, ws_bytes, nullptr,
                                   cuda::ChunkBackwardFrom::kept_forward);
            },
            2, 10);
        const double lfb_recompute_ms = timer.median_ms(
            [&](int i) {
              cuda::chunk_forward(dl, o.ptr, ht.as<float>(), ws.ptr, ws_bytes, nullptr);
              layer_backward(i);
            },
            2, 10);
        const double lbwd_ms = timer.median_ms(layer_backward, 1, 10);
        setenv("KDA_BWD_STAGES", "local", 1);
        const double llocal_ms = timer.median_ms(layer_backward, 1, 10);
        unsetenv("KDA_BWD_STAGES");
        std::printf(
            "BENCH chunk_fwd+bwd kda-layer %lldx%lld: %.3f ms kept forward, %.3f ms recompute "
            "(bwd alone %.3f, of which local + finish %.3f)\n",
            (long long)sh.B, (long long)sh.T, lfb_ms, lfb_recompute_ms, lbwd_ms, llocal_ms);
        std::fflush(stdout);
        out << "chunk_fwdbwd_kda_layer\t" << sh.B << "x" << sh.T << "\t" << lfb_ms << "\t"
            << fb_floor_ms << "\n";
        out << "chunk_fwdbwd_kda_layer_recompute\t" << sh.B << "x" << sh.T << "\t"
            << lfb_recompute_ms << "\t" << fb_floor_ms << "\n";
        if (sh.B == 8) {
          // Kimi Linear's softplus gate, with the decays of its init (exp(A_log) in [1, 16],
          // dt ~ 0.01: ~0.1 nats a token, no chunk listed) and with decays every chunk lists
          // (exp(A_log) 16, dt_bias +2: ~27 nats a token): what the exact path costs when
          // training has made the decays strong (GPU_NOTES item 12)
          for (bool wide : {false, true}) {
            std::vector<float> A_log(H), dt_bias(H * K);
            Random rng(19);
            for (float& a : A_log) a = wide ? std::log(16.f) : std::log(rng.uniform(1.f, 16.f));
            for (float& x : dt_bias) x = wide ? 2.f : std::log(std::expm1(0.01f));
            ck(cudaMemcpy(A_dev.ptr, A_log.data(), A_dev.bytes, cudaMemcpyHostToDevice), "A_log");
            ck(cudaMemcpy(dt_dev.ptr, dt_bias.data(), dt_dev.bytes, cudaMemcpyHostToDevice), "dt");
            cuda::DeltaRuleDeviceInputs ds = dl;
            ds.kda_layer.gate = KdaGate::softplus;
            const double sf_ms = timer.median_ms(
                [&](int) {
                  cuda::chunk_forward(ds, o.ptr, ht.as<float>(), ws.ptr, ws_bytes, nullptr);
                },
                2, 10);
            const double sfb_ms = timer.median_ms(
                [&](int) {
                  cuda::chunk_forward_for_backward(ds, o.ptr, ht.as<float>(), ws.ptr, ws_bytes,
                                                   nullptr);
                  cuda::chunk_backward(ds, d_o.ptr, dht.as<float>(), lgrads, ws.ptr, ws_bytes,
                                       nullptr, cuda::ChunkBackwardFrom::kept_forward);
                },
                2, 10);
            std::printf(
                "BENCH chunk kda-layer softplus%s %lldx%lld: fwd %.3f ms, fwd+bwd %.3f ms kept "
                "forward (%s)\n",
                wide ? "-wide" : "", (long long)sh.B, (long long)sh.T, sf_ms, sfb_ms,
                wide ? "every chunk listed: the exact kernels" : "the init's decays");
            std::fflush(stdout);
          }
        }
      }
    }
  }

  // Decode: pool of 1024 slots (2 GiB at H = 32); each call uses the next of `sets` random slot
  // sets (consecutive ones disjoint, as DecodeArgs::prefetch_state requires), with sets x B >= 128
  // (256 MB of states, ~5x the H200's 50 MB L2), so no call finds the states it reads in L2. Beside
  // both kernels, the same-size ceilings measured the same way: decode_state_copy (the step's exact
  // state bytes, same slots, read and written in place by a plain copy kernel) and a
  // cudaMemcpyAsync of the same byte count between blocks rotating over the pool; the faster of the
  // two is the ceiling. "warm": one slot set for every call (B <= 16: the states may stay in L2
  // between calls: what L2 reuse would flatter). Until v18 the rows used 16 rotating sets for every
  // B (B = 1: only 32 MB, partly L2-resident).
  for (Gate gate : {Gate::channel, Gate::scalar}) {
    if (chunk_only) break;
    const int64_t slots_n = 1024;
    DeviceBuffer pool(size_t(slots_n) * H * K * V * 4);
    ck(cudaMemset(pool.ptr, 0, pool.bytes), "pool");
    for (int64_t B : {1, 16, 64, 128}) {
      const int sets = int(std::max<int64_t>(16, (128 + B - 1) / B));
      const std::vector<int32_t> slots = rotating_slot_sets(slots_n, B, sets, 77 + B);
      DeviceBuffer slots_dev(slots.size() * 4);
      ck(cudaMemcpy(slots_dev.ptr, slots.data(), slots_dev.bytes, cudaMemcpyHostToDevice), "slots");
      const DecodeBenchTokens x(B, H, K, V, gate == Gate::channel ? K : 1, 21);
      cuda::DecodeArgs a;
      a.shape = DeltaRuleShape{B, 1, H, H, K, V, gate, 0};
      x.bind(a);
      a.state_pool = pool.as<float>();
      a.num_slots = slots_n;
      a.prefetch_state = prefetch_requested();  // consecutive slot sets are disjoint
      auto time_rotating = [&](auto&& step) {
        return timer.median_ms(
            [&](int rep) {
              a.slots = slots_dev.as<int32_t>() + size_t(rep % sets) * B;
              step();
            },
            5, 30, 10);
      };
      auto time_warm = [&](auto&& step) {
        // one slot set for every call: outside DecodeArgs::prefetch_state's contract, so never
        // with it (the warm rows time the plain programmatic launch when prefetch is asked for)
        a.slots = slots_dev.as<int32_t>();
        a.prefetch_state = false;
        const double ms = timer.median_ms([&](int) { step(); }, 5, 30, 10);
        a.prefetch_state = prefetch_requested();
        return ms;
      };
      auto decode = [&] { cuda::decode_step(a, nullptr); };
      a.kernel = cuda::DecodeKernel::automatic;
      const double ms = time_rotating(decode);
      a.kernel = cuda::DecodeKernel::tile;
      const double tile_ms = time_rotating(decode), tile_warm_ms = time_warm(decode);
      a.kernel = cuda::DecodeKernel::head;
      const double head_ms = time_rotating(decode), head_warm_ms = time_warm(decode);
      a.kernel = cuda::DecodeKernel::automatic;
      const double copy_ms = time_rotating([&] { cuda::decode_state_copy(a, nullptr); });
      const size_t state_bytes = size_t(B) * H * K * V * 4;
      const size_t blocks = pool.bytes / state_bytes;  // >= 8
      int memcpy_call = 0;
      const double memcpy_ms = timer.median_ms(
          [&](int) {
            const size_t from = size_t(2 * memcpy_call) % blocks,
                         to = size_t(2 * memcpy_call + 1) % blocks;
            ++memcpy_call;
            ck(cudaMemcpyAsync(static_cast<char*>(pool.ptr) + to * state_bytes,
                               static_cast<char*>(pool.ptr) + from * state_bytes, state_bytes,
                               cudaMemcpyDeviceToDevice),
               "same-size copy");
          },
          5, 30, 10);
      // (the head or tile kernel as `automatic` picks; plain launches, then programmatic ones)
      const double graph_ms = decode_graph_step_ms(a, slots_dev.as<int32_t>(), sets, B, timer);
      double graph_pdl_ms = 0, graph_pdl64_ms = 0;
      try {
        cuda::DecodeArgs chained = a;
        chained.overlap_launch = true;
        graph_pdl_ms = decode_graph_step_ms(chained, slots_dev.as<int32_t>(), sets, B, timer);
        graph_pdl64_ms = decode_graph_step_ms(chained, slots_dev.as<int32_t>(), sets, B, timer, 64);
      } catch (const std::exception& e) {
        std::printf("NOTE  decode graph with programmatic launch not timed: %s\n", e.what());
        cudaGetLastError();
      }
      const double bytes = 2.0 * double(state_bytes);
      const double ceiling_ms = std::min(copy_ms, memcpy_ms);  // the faster same-size copy
      auto tbs = [&](double t) { return bytes / (t * 1e-3) / 1e12; };
      const std::pair<const char*, double> rows[] = {
          {"auto", ms},        {"tile", tile_ms},           {"head", head_ms},
          {"graph", graph_ms}, {"graph+pdl", graph_pdl_ms}, {"graph+pdl x64", graph_pdl64_ms}};
      for (const auto& [name, t] : rows)
        if (t > 0)
          std::printf(
              "BENCH decode %s B=%lld %s: %.4f ms, state %.2f TB/s = %.0f%% of copy, %.0f%% of the "
              "same-size copy\n",
              gate_name(gate), (long long)B, name, t, tbs(t), 100 * tbs(t) / copy_tbs,
              100 * ceiling_ms / t);
      std::printf(
          "BENCH decode %s B=%lld same-size copies (%.1f MB read + written; the faster is the "
          "ceiling): in-place state copy %.4f ms (%.2f TB/s = %.0f%% of copy), cudaMemcpyAsync "
          "%.4f ms (%.2f TB/s = %.0f%%); warm (one slot set): tile %.4f ms, head %.4f ms\n",
          gate_name(gate), (long long)B, bytes / 2e6, copy_ms, tbs(copy_ms),
          100 * tbs(copy_ms) / copy_tbs, memcpy_ms, tbs(memcpy_ms), 100 * tbs(memcpy_ms) / copy_tbs,
          tile_warm_ms, head_warm_ms);
      std::fflush(stdout);
      const double floor_ms = bytes / (copy_tbs * 1e12) * 1e3;
      out << "decode_" << gate_name(gate) << "\tB" << B << "\t" << ms << "\t" << floor_ms << "\n";
      out << "decode_" << gate_name(gate) << "_tile\tB" << B << "\t" << tile_ms << "\t" << floor_ms
          << "\n";
      out << "decode_" << gate_name(gate) << "_head\tB" << B << "\t" << head_ms << "\t" << floor_ms
          << "\n";
      out << "decode_" << gate_name(gate) << "_graph\tB" << B << "\t" << graph_ms << "\t"
          << floor_ms << "\n";
      if (graph_pdl_ms > 0)
        out << "decode_" << gate_name(gate) << "_graph_pdl\tB" << B << "\t" << graph_pdl_ms << "\t"
            << floor_ms << "\n";
      if (graph_pdl64_ms > 0)
        out << "decode_" << gate_name(gate) << "_graph_pdl_x64\tB" << B << "\t" << graph_pdl64_ms
            << "\t" << floor_ms << "\n";
      if (gate == Gate::channel)
        out << "decode_same_size_copy\tB" << B << "\t" << ceiling_ms << "\t" << floor_ms << "\n";
    }
  }

  // Speculative decoding (KDA, B = 16, the last accepted token and 3 drafts: 4 tokens a
  // sequence): the step with the final state in place, and keeping every token's state (4x the
  // state writes), against one-token steps' bytes. Rotating slot sets as above.
  if (!chunk_only) {
    const int64_t B = 16, T = 4, slots_n = 1024, sets = 8;
    DeviceBuffer pool(size_t(slots_n) * H * K * V * 4);
    ck(cudaMemset(pool.ptr, 0, pool.bytes), "pool");
    const std::vector<int32_t> all = rotating_slot_sets(slots_n, B + B * T, int(sets), 99);
    std::vector<int32_t> slots(size_t(sets) * B), token_slots(size_t(sets) * B * T);
    for (int64_t si = 0; si < sets; ++si) {
      const auto set = all.begin() + si * (B + B * T);
      std::copy(set, set + B, slots.begin() + si * B);
      std::copy(set + B, set + B + B * T, token_slots.begin() + si * B * T);
    }
    DeviceBuffer slots_dev(slots.size() * 4), token_slots_dev(token_slots.size() * 4);
    ck(cudaMemcpy(slots_dev.ptr, slots.data(), slots_dev.bytes, cudaMemcpyHostToDevice), "slots");
    ck(cudaMemcpy(token_slots_dev.ptr, token_slots.data(), token_slots_dev.bytes,
                  cudaMemcpyHostToDevice),
       "token slots");
    const DecodeBenchTokens x(B * T, H, K, V, K, 31);
    cuda::DecodeArgs a;
    a.shape = DeltaRuleShape{B, T, H, H, K, V, Gate::channel, 0};
    x.bind(a);
    a.state_pool = pool.as<float>();
    a.num_slots = slots_n;
    a.tokens = int(T);
    a.prefetch_state = prefetch_requested();  // consecutive slot sets are disjoint
    for (bool keep : {false, true}) {
      const double ms = timer.median_ms(
          [&](int rep) {
            a.slots = slots_dev.as<int32_t>() + size_t(rep % sets) * B;
            a.token_slots =
                keep ? token_slots_dev.as<int32_t>() + size_t(rep % sets) * B * T : nullptr;
            cuda::decode_step(a, nullptr);
          },
          5, 30, 10);
      const double bytes = double(B) * H * K * V * 4 * (keep ? 1 + T : 2);
      std::printf(
          "BENCH decode kda B=%lld tokens=%lld (speculative, %s): %.4f ms, state %.2f TB/s "
          "= %.0f%% of copy\n",
          (long long)B, (long long)T, keep ? "every token's state kept" : "in place", ms,
          bytes / (ms * 1e-3) / 1e12, 100 * bytes / (ms * 1e-3) / 1e12 / copy_tbs);
      out << (keep ? "decode_kda_spec_keep" : "decode_kda_spec") << "\tB" << B << "T" << T << "\t"
          << ms << "\t" << bytes / (copy_tbs * 1e12) * 1e3 << "\n";
    }
  }
}

}  // namespace kda_gpu_check
