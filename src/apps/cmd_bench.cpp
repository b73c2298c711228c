// kda bench: CPU throughput of the delta-rule kernels against this machine's fp32 GEMM rate.
#include <cstdio>
#include <string>
#include <vector>

#include "apps/bench_util.h"
#include "apps/commands.h"
#include "core/blas.h"
#include "core/error.h"
#include "core/parallel.h"
#include "core/random.h"
#include "core/timer.h"
#include "ops/delta_rule/delta_rule.h"

namespace kda::apps {
namespace {

void print_usage() {
  std::puts(
      "usage: kda bench [--lengths 4096,16384] [--heads 4] [--dim 128] [--reps 3] [--out DIR]\n"
      "       kda bench recall [--quick] ...   (see kda bench recall --help)\n"
      "       kda bench decode [--tiny] ...    (see kda bench decode --help)\n"
      "       kda bench train [--model CONFIG] ... (see kda bench train --help)\n"
      "       kda bench tasks [--lengths 256,2048] ... (see kda bench tasks --help)\n"
      "\n"
      "Measures the fp32 GEMM rate (the ceiling), then for KDA and Gated DeltaNet: chunked\n"
      "forward, chunked forward+backward and recurrent forward, in tokens/s and GFLOP/s.\n"
      "Writes bench.md and bench.csv to DIR (default out/bench).");
}

}  // namespace

int cmd_bench(const Args& args) {
  if (!args.empty() && args[0] == "recall")
    return cmd_bench_recall(Args(args.begin() + 1, args.end()));
  if (!args.empty() && args[0] == "train")
    return cmd_bench_train(Args(args.begin() + 1, args.end()));
  if (!args.empty() && args[0] == "decode")
    return cmd_bench_decode(Args(args.begin() + 1, args.end()));
  if (!args.empty() && args[0] == "tasks")
    return cmd_bench_tasks(Args(args.begin() + 1, args.end()));
  std::vector<int64_t> lengths = {4096, 16384};
  int64_t heads = 4, dim = 128;
  int reps = 3;
  std::string out_dir = "out/bench";
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      print_usage();
      return 0;
    }
    const std::string value = flag_value(args, i);
    if (a == "--lengths")
      lengths = parse_int_list(value, a);
    else if (a == "--heads")
      heads = parse_int(value, a);
    else if (a == "--dim")
      dim = parse_int(value, a);
    else if (a == "--reps")
      reps = int(parse_int(value, a));
    else if (a == "--out")
      out_dir = value;
    else
      throw Error("bench: unknown option '" + a + "' (see kda bench --help)");
  }
  require(heads >= 1 && dim >= 1 && reps >= 1, "bench: --heads, --dim and --reps must be >= 1");

  std::printf("kda bench: %d threads, %s, OpenBLAS core %s\n", hardware_threads(),
              machine_description().c_str(), openblas_core_name().c_str());
  const double gemm = measure_gemm_gflops(2048, reps);
  std::printf("fp32 GEMM 2048^3 (OpenBLAS): %.1f GFLOP/s\n\n", gemm);

  Table table({"op", "path", "T", "ms", "tokens/s", "GFLOP/s", "% of GEMM"});
  for (ops::Gate gate : {ops::Gate::channel, ops::Gate::scalar}) {
    const char* name = gate == ops::Gate::channel ? "KDA" : "Gated DeltaNet";
    for (int64_t T : lengths) {
      const ops::DeltaRuleShape shape{1, T, heads, heads, dim, dim, gate, 0};
      const DeltaInputsBuffer data(shape, 42);
      const auto in = data.inputs();
      std::vector<float> o(T * heads * dim), ht(heads * dim * dim), d_o(o.size(), 0.01f),
          dq(o.size()), dk(o.size()), dv(o.size()), dg(data.g.size()), db(data.beta.size()),
          dh0(ht.size());
      const double fwd_flops = ops::delta_rule_chunk_forward_flops_per_token(shape) * double(T);
      const double rec_flops = 7.0 * dim * dim * heads * double(T);
      auto row = [&](const char* path, double seconds, double flops) {
        table.add({name, path, std::to_string(T), fmt(seconds * 1e3, 1), fmt(T / seconds, 0),
                   fmt(flops / seconds / 1e9, 1), fmt(100.0 * flops / seconds / 1e9 / gemm, 1)});
      };
      row("chunked forward",
          best_seconds(reps, [&] { ops::delta_rule_chunk_forward(in, o.data(), ht.data()); }),
          fwd_flops);
      row("chunked fwd+bwd",
          best_seconds(reps,
                       [&] {
                         ops::delta_rule_chunk_forward(in, o.data(), ht.data());
                         ops::delta_rule_chunk_backward(
                             in, d_o.data(), nullptr,
                             {dq.data(), dk.data(), dv.data(), dg.data(), db.data(), dh0.data()});
                       }),
          3 * fwd_flops);
      row("recurrent forward",
          best_seconds(reps, [&] { ops::delta_rule_recurrent_forward(in, o.data(), ht.data()); }),
          rec_flops);
    }
  }
  table.print();
  std::printf(
      "\nFLOPs: chunked forward counts every matrix product of the WY/UT form (see\n"
      "delta_rule_chunk_forward_flops_per_token); fwd+bwd counts 3x the forward; recurrent counts\n"
      "7 K V per token and head. %% of GEMM = achieved GFLOP/s over the measured GEMM rate.\n");
  table.write(out_dir, "bench");
  std::printf("wrote %s/bench.md and %s/bench.csv\n", out_dir.c_str(), out_dir.c_str());
  return 0;
}

}  // namespace kda::apps
