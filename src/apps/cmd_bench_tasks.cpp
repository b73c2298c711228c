// kda bench tasks: how long the synthetic recall tasks take to make a batch (the data side of a
// recall training step), with a hash of the batches so that two builds can show they make the
// same examples.
#include <cstdio>
#include <string>
#include <vector>

#include "apps/bench_util.h"
#include "apps/commands.h"
#include "core/error.h"
#include "core/timer.h"
#include "train/tasks.h"

namespace kda::apps {

int cmd_bench_tasks(const Args& args) {
  std::vector<int64_t> lengths = {256, 2048};
  int64_t vocab = 8192, batch = 32, batches = 20;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::puts(
          "usage: kda bench tasks [--lengths 256,2048] [--vocab 8192] [--batch 32] [--batches "
          "20]\n\n"
          "Times TaskStream::next (MQAR, Palindrome, Stack; seed 17, the test set forbidden as in\n"
          "kda bench recall) and prints ms a batch and a hash of every example and target.");
      return 0;
    }
    const std::string value = flag_value(args, i);
    if (a == "--lengths")
      lengths = parse_int_list(value, a);
    else if (a == "--vocab")
      vocab = parse_int(value, a);
    else if (a == "--batch")
      batch = parse_int(value, a);
    else if (a == "--batches")
      batches = parse_int(value, a);
    else
      throw Error("bench tasks: unknown option '" + a + "' (see kda bench tasks --help)");
  }
  require(batch >= 1 && batches >= 1, "bench tasks: --batch and --batches must be >= 1");
  for (const char* name : {"mqar", "palindrome", "stack"})
    for (int64_t T : lengths) {
      const train::TaskSpec spec{train::parse_task(name), vocab, T, 0};
      train::TaskStream stream(spec, 17, 0);
      stream.forbid(train::make_test_set(spec, 17, 64).hashes);
      uint64_t hash = 0;
      Stopwatch clock;
      for (int64_t i = 0; i < batches; ++i) {
        const train::Batch b = stream.next(batch);
        hash = hash * 31 + train::TaskStream::hash_example(b.inputs.data(), b.B * b.T) +
               train::TaskStream::hash_example(b.targets.data(), b.B * b.T);
      }
      std::printf("%-10s T=%-5lld vocab %lld: %8.3f ms a batch of %lld  (hash %016llx)\n", name,
                  (long long)T, (long long)vocab, 1e3 * clock.seconds() / double(batches),
                  (long long)batch, (unsigned long long)hash);
    }
  return 0;
}

}  // namespace kda::apps
