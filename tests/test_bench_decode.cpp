// kda bench decode end to end on a tiny synthetic Kimi Linear: it runs, prints the bandwidth
// and the decode table, writes its files, and refuses bad flags.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include "run_command.h"
#include "scratch_dir.h"

namespace {

using kda::testing::CommandResult;

CommandResult run(const std::string& args) {
  return kda::testing::run_kda(args);
}

TEST(BenchDecode, TinyConfigPrintsTheTable) {
  const kda::testing::ScratchDir scratch;  // this test's own folder
  const std::filesystem::path out_root(scratch.str());
  const CommandResult r = run("bench decode --tiny --out " + out_root.string());
  ASSERT_EQ(r.status, 0) << r.output;
  for (const char* needle : {"memory bandwidth", "read", "active per token",
                             "bytes per decoded token", "decode ", "prefill ", "% of floor"}) {
    EXPECT_NE(r.output.find(needle), std::string::npos) << needle << "\n" << r.output;
  }
  EXPECT_TRUE(std::filesystem::exists(out_root / "decode.md"));
  EXPECT_TRUE(std::filesystem::exists(out_root / "decode.csv"));
}

TEST(BenchDecode, BadFlagsFailClearly) {
  const CommandResult unknown = run("bench decode --tiny --no-such-flag 1");
  EXPECT_EQ(unknown.status, 1);
  EXPECT_NE(unknown.output.find("unknown option '--no-such-flag'"), std::string::npos)
      << unknown.output;
  const CommandResult top_k = run("bench decode --tiny --top-k 99");
  EXPECT_EQ(top_k.status, 1);
  EXPECT_NE(top_k.output.find("--top-k"), std::string::npos) << top_k.output;
}

}  // namespace
