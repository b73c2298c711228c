// kda: one binary, subcommands.
#include <malloc.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "apps/commands.h"
#include "core/blas.h"
#include "core/error.h"
#ifdef KDA_HAVE_CUDA
#include "train/cuda/cuda_training.h"
#endif

namespace {

void print_usage() {
  std::puts(
      "kda.cpp: the attention lineage that ends in Kimi Linear\n"
      "\n"
      "usage: kda <command> [options]\n"
      "\n"
      "commands:\n"
      "  lineage   measured walk through the lineage (softmax -> KDA) on this machine\n"
      "  verify    check op fixtures and model folders (logits, decode, gradients)\n"
      "  bench     benchmarks: CPU kernels, recall, decode, training, task streams\n"
      "  info      architecture, parameters and memory per sequence of a model or config\n"
      "  run       generate text from a model folder (GPT-2, Kimi Linear)\n"
      "  serve     OpenAI-style HTTP server (completions, chat, streaming)\n"
      "  tokenize  text to token ids (JSON) and back: GPT-2 BPE, tiktoken files, Kimi\n"
      "  train     train a lineage model, Kimi Linear or GPT-2 (synthetic tasks or text)\n"
      "  export    a trained checkpoint as a bf16 model folder with its tokenizer\n"
      "\n"
      "run 'kda <command> --help' for a command's options");
}

// Keeps freed buffers in the heap instead of handing them back to the kernel. The trainers (and
// prefill) allocate the same large temporaries every step; by default glibc serves each from a
// fresh mmap and unmaps it on free, so every step pays page faults and the kernel's zeroing
// again: 1.3x on a small recall model's step (docs/PERF.md). The process keeps its peak
// footprint instead, which one job a process can afford.
void keep_freed_memory() {
#ifdef __GLIBC__
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
#endif
}

}  // namespace

int main(int argc, char** argv) {
  // Let OpenBLAS use this CPU's vector kernels (see openblas_coretype_upgrade); it reads the
  // variable only at load time, hence the re-execution. On failure we simply run on.
  if (const std::string core = kda::openblas_coretype_upgrade(); !core.empty()) {
    setenv("OPENBLAS_CORETYPE", core.c_str(), 1);
    execv("/proc/self/exe", argv);
  }
  if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
    print_usage();
    return argc < 2 ? 2 : 0;
  }
  keep_freed_memory();
  const std::string command = argv[1];
  const kda::apps::Args args(argv + 2, argv + argc);
#ifdef KDA_HAVE_CUDA
  kda::train::cuda::register_cuda_training();  // `--device cuda` for kda train / bench recall
#endif
  try {
    if (command == "verify") return kda::apps::cmd_verify(args);
    if (command == "lineage") return kda::apps::cmd_lineage(args);
    if (command == "bench") return kda::apps::cmd_bench(args);
    if (command == "train") return kda::apps::cmd_train(args);
    if (command == "tokenize") return kda::apps::cmd_tokenize(args);
    if (command == "info") return kda::apps::cmd_info(args);
    if (command == "run") return kda::apps::cmd_run(args);
    if (command == "serve") return kda::apps::cmd_serve(args);
    if (command == "export") return kda::apps::cmd_export(args);
    std::fprintf(stderr, "kda: unknown command '%s' (try 'kda --help')\n", command.c_str());
    return 2;
  } catch (const kda::Error& e) {
    std::fprintf(stderr, "kda %s: error: %s\n", command.c_str(), e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kda %s: internal error: %s\n", command.c_str(), e.what());
    return 1;
  }
}
