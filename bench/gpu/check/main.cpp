// kda_gpu_check: correctness of the CUDA delta-rule kernels against the float64 CPU reference,
// then timings on the production shapes. Run on the GPU machine (scripts/gpu_run.sh).
//
//   kda_gpu_check [--check] [--bench] [--decode] [--out FILE]
//
// --check: chunked forward (bf16 tensor-core path and fp32 path), KDA / Gated DeltaNet /
//   DeltaNet, T = 1, 63, 64, 65, 2047, packed varlen with a length-1 sequence, grouped value
//   heads, K = V = 64 and 128, initial and final states; decode step by step against the float64
//   recurrence and against the chunked prefill, and single decode steps from random states in
//   scrambled slots (B = 1, 16, 128), each with both decode kernels (tile, head). Relative RMS
//   error ||x - ref|| / ||ref||.
//   Also: two-tile chunk_state blocks (many heads), long sequences (the split walk), and
//   the KDA layer's in-kernel options (l2norm, gate activation, sigmoid beta) against
//   kda_reference, and their backward (raw q, k, v, graw, braw, A_log, dt_bias, h0) against the
//   CPU fp32 KDA layer backward (kda_chunk_backward; tolerances 8e-3 dq, dk, dv, dh0, 2e-2 dg,
//   dbeta; 5e-2 for the token sums dA_log, ddt_bias).
//   Chunked backward (bf16): dq, dk, dv, dg, dbeta, dh0 against the CPU fp32 chunked backward
//   (delta_rule_chunk_backward, verified to 1e-7 against float64) on the same bf16-rounded
//   inputs; tolerances fla's: 8e-3 (dq, dk, dv, dh0), 2e-2 (dg, dbeta). Every backward check
//   also runs the training pair (chunk_forward_for_backward, then chunk_backward from the kept
//   arrays) against the recompute path (check_kept_forward).
// --decode: --check and --bench restricted to decode (its checks; the ceilings and decode rows).
// --small: one small forward and backward case (for compute-sanitizer).
// --profile: a few of each call, untimed, for a profiler (ncu, nsys): the KDA chunked forward,
//   backward and training pair at KDA_PROFILE_SHAPE=BxT (default 8x2048), and a B = 16 decode
//   step.
// --bench: copy bandwidth and cuBLAS bf16 GEMM ceilings, chunked forward (KDA, GDN; KDA also
//   with the layer options) at H = 32, K = V = 128 for 8x2048, 2x8192, 1x65536, forward +
//   backward on the same shapes (KDA also with the layer options; the training pair, and the
//   plain forward with a recomputing backward: the `_recompute` rows), and decode for B = 1, 16,
//   64, 128: the automatic choice, the tile and the head kernel, the automatic choice replayed
//   from a CUDA graph of 16 steps (plain launches, and programmatic), the same-size ceilings
//   (decode_state_copy: the step's state bytes copied in place; cudaMemcpyAsync of as many
//   bytes), all over slot sets rotating through a 2 GiB pool (no L2 reuse between calls).
//   KDA_BENCH_ONLY=kda: the KDA chunked rows alone (=chunk: KDA and GDN). KDA_DECODE_OVERLAP=1:
//   decode steps (and the in-place copy) with programmatic dependent launch. Results go to FILE as
//   tab-separated lines (read by bench/gpu/fla_bench.py).
//
// The helpers live in check_common.h / .cpp, the checks in forward_checks.cpp,
// backward_checks.cpp, kda_layer_checks.cpp and decode_checks.cpp, the timings in benches.cpp;
// this file parses the arguments and runs the checks in their order.
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "bench/gpu/check/check_common.h"

namespace kda_gpu_check {

// --decode: --check runs run_decode_checks() alone, --bench the ceilings and decode rows alone.
bool g_decode_only = false;

namespace {

void run_checks() {
  if (g_decode_only) {
    run_decode_checks();
    return;
  }
  const auto bf = ElementType::bf16, f32 = ElementType::f32;
  uint64_t seed = 1000;
  const std::vector<int64_t> varlen = {0, 1, 64, 129, 200, 521};  // includes a length-1 sequence
  // backward with the KDA layer's options (new checks first: they draw the first seeds)
  {
    const KdaGate lb = KdaGate::lower_bound, sp = KdaGate::softplus;
    uint64_t ls = 5000;
    check_kda_layer_backward(2, 1, 2, 4, 128, 128, {}, true, true, true, lb, ++ls);
    check_kda_layer_backward(2, 65, 2, 4, 128, 128, {}, true, true, true, lb, ++ls);
    check_kda_layer_backward(2, 65, 2, 2, 128, 128, {}, false, true, true, sp, ++ls);
    check_kda_layer_backward(1, 2047, 2, 2, 128, 128, {}, true, true, true, lb, ++ls);
    check_kda_layer_backward(1, 2047, 1, 2, 128, 128, {}, true, true, true, sp, ++ls);
    check_kda_layer_backward(1, 521, 2, 4, 128, 128, varlen, false, true, true, lb, ++ls);
    check_kda_layer_backward(1, 521, 1, 2, 64, 64, varlen, true, false, true, sp, ++ls);
    check_kda_layer_backward(2, 200, 2, 2, 128, 128, {}, true, true, false, sp, ++ls);
    check_kda_layer_backward(1, 300, 1, 2, 64, 64, {}, true, true, false, lb, ++ls);
    // T = 1 needs h0 for a gate gradient at all (else dg = 0 and the fp32 reference is noise)
    check_kda_layer_backward(2, 1, 1, 1, 64, 64, {}, true, false, true, sp, ++ls);
  }
  for (Gate gate : {Gate::channel, Gate::scalar}) {
    for (int64_t T : {1, 63, 64, 65})
      check_forward(gate, 2, T, 2, 4, 128, 128, {}, T != 64, bf, false, ++seed);
    check_forward(gate, 1, 2047, 2, 2, 128, 128, {}, true, bf, false, ++seed);
    check_forward(gate, 1, 521, 1, 2, 64, 64, varlen, true, bf, false, ++seed);
    check_forward(gate, 1, 521, 2, 4, 128, 128, varlen, false, bf, false, ++seed);
    check_forward(gate, 2, 300, 2, 4, 64, 128, {}, true, bf, false, ++seed);
    check_forward(gate, 1, 1000, 2, 2, 128, 128, {}, true, bf, false, ++seed, true);
    // fp32 inputs: the fp32 recurrent path (1e-4)
    check_forward(gate, 2, 65, 2, 4, 128, 128, {}, true, f32, false, ++seed);
    check_forward(gate, 1, 2047, 1, 2, 64, 64, {}, true, f32, false, ++seed);
    check_forward(gate, 1, 521, 2, 4, 128, 128, varlen, true, f32, false, ++seed);
    seed += 2;  // the decode checks' former seeds (run_decode_checks): keeps the inputs below
  }
  run_decode_checks();
  check_forward(Gate::none, 2, 130, 2, 2, 128, 128, {}, true, bf, false, ++seed);
  check_forward(Gate::none, 2, 130, 2, 2, 64, 64, {}, true, f32, false, ++seed);
  // enough sequences x heads for chunk_state's two-tile blocks (NT = 2, the production path)
  check_forward(Gate::channel, 3, 130, 22, 44, 128, 128, {}, true, bf, false, ++seed);
  check_forward(Gate::scalar, 3, 130, 22, 44, 128, 128, {}, true, bf, false, ++seed);
  // long sequences, state grid <= one block per SM (the split walk), here with sequences of
  // different lengths (one of 1 token) and an initial state
  for (Gate gate : {Gate::channel, Gate::scalar})
    check_forward(gate, 1, 4200, 2, 4, 128, 128, {0, 2100, 2101, 4200}, true, bf, false, ++seed);
  // batch grids of 16 chunks a sequence: two-tile state blocks (the Gated DeltaNet raw path
  // among them), and one-tile blocks (KDA_STATE_NT=1); fixed seeds, so that the inputs of the
  // checks below stay as they were
  {
    for (Gate gate : {Gate::channel, Gate::scalar})
      check_forward(gate, 3, 1024, 11, 22, 128, 128, {}, true, bf, false, 907);
    ScopedEnv one_tile("KDA_STATE_NT", "1");
    check_forward(Gate::channel, 3, 1024, 11, 22, 128, 128, {}, true, bf, false, 908);
  }
  // KDA layer options in the kernel
  check_kda_layer(2, 130, 2, 4, 128, 128, {}, true, true, KdaGate::lower_bound, ++seed);
  check_kda_layer(1, 521, 2, 4, 128, 128, varlen, false, true, KdaGate::lower_bound, ++seed);
  check_kda_layer(1, 300, 1, 2, 64, 64, {}, true, false, KdaGate::lower_bound, ++seed);
  check_kda_layer(2, 200, 2, 2, 128, 128, {}, true, true, KdaGate::softplus, ++seed);
  // the softplus gate decaying past chunk_prepare's split: the chunks chunk_prepare_exact redoes
  // (the gate lower_bound >= -5 never reaches it: delta_rule_cuda.h)
  {
    uint64_t ws = 7000;  // own seeds: the inputs of the checks below stay as they were
    const KdaGate sp = KdaGate::softplus;
    check_kda_layer(2, 17, 2, 4, 128, 128, {}, true, true, sp, ++ws, true);
    check_kda_layer(2, 65, 2, 4, 128, 128, {}, true, true, sp, ++ws, true);
    check_kda_layer(2, 200, 2, 2, 128, 128, {}, true, true, sp, ++ws, true);
    check_kda_layer(1, 521, 2, 4, 128, 128, varlen, false, true, sp, ++ws, true);
    check_kda_layer(1, 300, 1, 2, 64, 64, {}, true, false, sp, ++ws, true);
    check_kda_layer(1, 2047, 2, 2, 128, 128, {}, true, true, sp, ++ws, true);  // one long
    // the plain op (g given, no layer options): the exact kernel's other instantiation
    check_forward(Gate::channel, 2, 130, 2, 4, 128, 128, {}, true, ElementType::bf16, false, ++ws,
                  2);
    check_forward(Gate::channel, 1, 521, 1, 2, 64, 64, varlen, true, ElementType::bf16, false, ++ws,
                  2);
    // the backward: chunk_bwd_local's pairwise terms formed elementwise in the listed chunks
    check_kda_layer_backward(2, 65, 2, 4, 128, 128, {}, true, true, true, sp, ++ws, true);
    check_kda_layer_backward(1, 521, 1, 2, 64, 64, varlen, true, false, true, sp, ++ws, true);
    check_kda_layer_backward(2, 200, 2, 2, 128, 128, {}, true, true, false, sp, ++ws, true);
    check_backward(Gate::channel, 2, 130, 2, 4, 128, 128, {}, true, true, ++ws, 2);
  }
  // backward (bf16) against the CPU fp32 chunked backward
  for (Gate gate : {Gate::channel, Gate::scalar}) {
    for (int64_t T : {1, 63, 64, 65})
      check_backward(gate, 2, T, 2, 4, 128, 128, {}, T != 64, T != 63, ++seed);
    check_backward(gate, 1, 2047, 2, 2, 128, 128, {}, true, true, ++seed);
    check_backward(gate, 1, 521, 1, 2, 64, 64, varlen, true, true, ++seed);
    check_backward(gate, 1, 521, 2, 4, 128, 128, varlen, false, false, ++seed);
    check_backward(gate, 2, 300, 2, 2, 64, 64, {}, false, true, ++seed);
    check_backward(gate, 1, 1000, 2, 2, 128, 128, {}, true, true, ++seed, true);
  }
  check_backward(Gate::none, 2, 130, 2, 2, 128, 128, {}, true, true, ++seed);
}

// One small forward and backward (for compute-sanitizer, which slows kernels 10-100x).
void run_small() {
  check_forward(Gate::channel, 1, 130, 1, 2, 64, 64, {}, true, ElementType::bf16, false, 7);
  check_backward(Gate::channel, 1, 130, 1, 2, 64, 64, {}, true, true, 8);
  check_backward(Gate::scalar, 1, 70, 1, 1, 128, 128, {}, true, true, 9);
  check_forward(Gate::scalar, 1, 130, 1, 2, 64, 64, {}, true, ElementType::bf16, false, 10);
  check_kda_layer(1, 70, 1, 2, 64, 64, {}, true, true, KdaGate::lower_bound, 11);
  // the layer backward: grouped heads (partials + l2norm) and not (in place), both gates
  check_kda_layer_backward(1, 70, 1, 2, 64, 64, {}, true, true, true, KdaGate::lower_bound, 16);
  check_kda_layer_backward(1, 70, 1, 1, 128, 128, {}, true, true, true, KdaGate::softplus, 17);
  // wide decays on the odd value head: its chunks are listed and take chunk_bwd_local's EXACT
  // instance (exact_pairs_blocked) and chunk_prepare_exact, beside ordinary ones
  check_kda_layer_backward(1, 70, 1, 2, 64, 64, {}, true, true, true, KdaGate::softplus, 19, true);
  check_kda_layer_backward(1, 70, 1, 2, 128, 128, {}, true, true, true, KdaGate::softplus, 20,
                           true);
  check_decode(Gate::channel, 1, 2, 64, 64, ElementType::bf16, 12);
  // the decode head kernel (bulk copy, mbarrier, shared-memory reductions), grouped heads
  check_decode_step(Gate::channel, 3, 1, 2, 128, ElementType::bf16, cuda::DecodeKernel::head, 18);
  // one sequence of 32 chunks, KDA and Gated DeltaNet
  check_forward(Gate::channel, 1, 2048, 1, 1, 64, 64, {}, true, ElementType::bf16, false, 13);
  check_forward(Gate::scalar, 1, 2048, 1, 1, 64, 64, {}, true, ElementType::bf16, false, 14);
  // two-tile state blocks (2 x 30 heads x 2 >= 0.9 x 132 SMs): the Gated DeltaNet raw path
  check_forward(Gate::scalar, 2, 70, 15, 30, 128, 128, {}, true, ElementType::bf16, false, 15);
}

}  // namespace
}  // namespace kda_gpu_check

int main(int argc, char** argv) {
  using namespace kda_gpu_check;
  bool check = false, bench = false, profile = false, small = false;
  std::string out_path = "kda_gpu_bench.tsv";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--check")
      check = true;
    else if (a == "--bench")
      bench = true;
    else if (a == "--profile")
      profile = true;
    else if (a == "--small")
      small = true;
    else if (a == "--decode")
      g_decode_only = true;
    else if (a == "--out" && i + 1 < argc)
      out_path = argv[++i];
    else {
      std::fprintf(stderr,
                   "usage: kda_gpu_check [--check] [--small] [--bench] [--profile] [--decode] "
                   "[--out FILE]\n");
      return 2;
    }
  }
  if (!check && !bench && !profile && !small) check = bench = true;
  try {
    int devices = 0;
    ck(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
    if (check) {
      const auto t0 = std::chrono::steady_clock::now();
      run_checks();
      const double sec =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("CHECK summary: %d failure(s), %.1f s\n", g_failures, sec);
    }
    if (small) {
      run_small();
      std::printf("CHECK small summary: %d failure(s)\n", g_failures);
    }
    if (bench) run_bench(out_path);
    if (profile) run_profile();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kda_gpu_check: %s\n", e.what());
    return 1;
  }
  return g_failures ? 1 : 0;
}
