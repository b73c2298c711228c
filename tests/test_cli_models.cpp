// The model commands of the built kda binary on the gpt2_tiny fixture: verify, run, info, and
// the exit codes and messages of bad invocations.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/causal_lm.h"
#include "run_command.h"
#include "runtime/sampling.h"
#include "tokenizer/gpt2_tokenizer.h"

namespace kda {
namespace {

namespace fs = std::filesystem;

const std::string kFixture = std::string(KDA_SHARED_DIR) + "/fixtures/models/gpt2_tiny";

using testing::run_kda;
using Result = testing::CommandResult;

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

TEST(CliModels, VerifyModelFolder) {
  const Result r = run_kda("verify '" + kFixture + "'");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("gpt2_tiny (model gpt2)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("decode               greedy"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(" 0 failed"), std::string::npos) << r.output;
}

// A Kimi Linear that transformers made (q_lora_rank, grouped routing, two shared experts), with
// its logits, greedy continuation and gradients: every check of verify, the backward's included.
TEST(CliModels, VerifyKimiLinearFolderMadeByTransformers) {
  const std::string dir = (fs::path(__FILE__).parent_path() / "data/kimi_linear_qlora").string();
  const Result r = run_kda("verify '" + dir + "'");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("backward             gradients (147 tensors"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("6 checks, 0 failed"), std::string::npos) << r.output;
}

TEST(CliModels, RunWithIdsPrintsTheGeneratedIds) {
  const Result r = run_kda("run -m '" + kFixture + "' --ids 1,2,3 -n 5", false);
  ASSERT_EQ(r.status, 0) << r.output;
  const std::vector<std::string> lines = lines_of(r.output);
  ASSERT_EQ(lines.size(), 1u) << r.output;
  std::istringstream in(lines[0]);
  std::vector<int> ids;
  for (int id; in >> id;) ids.push_back(id);
  EXPECT_TRUE(in.eof()) << "not only ids: " << lines[0];
  ASSERT_EQ(ids.size(), 5u) << lines[0];
  for (const int id : ids) EXPECT_TRUE(id >= 0 && id < 1000) << id;

  // Greedy is the default: the same run again gives the same ids; the stats line is on stderr.
  const Result again = run_kda("run -m '" + kFixture + "' --ids 1,2,3 -n 5");
  EXPECT_EQ(again.status, 0);
  EXPECT_EQ(lines_of(again.output).at(0), lines[0]);
  EXPECT_NE(again.output.find("[kda run] prompt: 3 tokens"), std::string::npos) << again.output;
  EXPECT_NE(again.output.find("decode: 4 tokens"), std::string::npos) << again.output;
  EXPECT_NE(again.output.find("MLA/KV cache"), std::string::npos) << again.output;

  // The ids are the model's: a plain loop over the loaded model (prompt, then one token at a
  // time through a session) with the same settings gives them, greedy and sampled.
  const auto expected = [&](std::vector<int32_t> prompt, int n, runtime::SamplingParams params) {
    const auto lm = model::load_causal_lm(kFixture);
    const auto session = lm->start_session(int64_t(prompt.size()) + n);
    runtime::Sampler sampler(params);
    std::string out;
    Tensor last = session->feed_last(prompt);
    for (int i = 0; i < n; ++i) {
      const int32_t next = sampler.sample(last.span_f32());
      out += (i ? " " : "") + std::to_string(next);
      if (i + 1 < n) last = session->feed_last(std::span<const int32_t>(&next, 1));
    }
    return out;
  };
  EXPECT_EQ(lines[0], expected({1, 2, 3}, 5, {}));

  // Sampling with a seed is reproducible, and is the model's distribution drawn with that seed;
  // --ctx bounds prompt + generation.
  const std::string sampled =
      "run -m '" + kFixture + "' --ids 4,5 -n 8 --temp 1 --top-p 0.9 --seed 3";
  EXPECT_EQ(run_kda(sampled, false).output, run_kda(sampled, false).output);
  EXPECT_EQ(lines_of(run_kda(sampled, false).output).at(0),
            expected({4, 5}, 8, {.temperature = 1, .top_p = 0.9f, .seed = 3}));
  EXPECT_NE(lines_of(run_kda(sampled, false).output).at(0),
            expected({4, 5}, 8, {.temperature = 1, .top_p = 0.9f, .seed = 4}));
  const Result bounded = run_kda("run -m '" + kFixture + "' --ids 1,2,3 -n 50 --ctx 6");
  EXPECT_EQ(bounded.status, 0) << bounded.output;
  std::istringstream first(lines_of(bounded.output).at(0));
  int count = 0;
  for (int id; first >> id;) ++count;
  EXPECT_EQ(count, 4);  // 3 fed tokens of room after the prompt, plus the last sampled one
  EXPECT_NE(bounded.output.find("context limit of 6"), std::string::npos) << bounded.output;
}

std::string utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += char(cp);
  } else if (cp < 0x800) {
    s += char(0xC0 | (cp >> 6));
    s += char(0x80 | (cp & 0x3F));
  } else {
    s += char(0xE0 | (cp >> 12));
    s += char(0x80 | ((cp >> 6) & 0x3F));
    s += char(0x80 | (cp & 0x3F));
  }
  return s;
}

// gpt2_tiny plus a byte-level BPE tokenizer covering its 1000 ids: 256 bytes, 743 merges
// (letter pairs, space + letter, pair + 'e'), <|endoftext|> = 999 (the stop id).
fs::path write_tiny_folder_with_tokenizer() {
  const fs::path dir =
      fs::temp_directory_path() / ("kda_cli_models_tok_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  for (const char* file : {"config.json", "model.safetensors"})
    fs::copy_file(fs::path(kFixture) / file, dir / file);
  const auto& unicode = tokenizer::gpt2_byte_to_unicode();
  const auto sym = [&](char c) { return utf8(unicode[uint8_t(c)]); };
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) vocab[utf8(unicode[size_t(b)])] = b;
  std::string merges = "#version: 0.2\n";
  const auto merge = [&](const std::string& a, const std::string& b) {
    const int id = int(vocab.size());
    vocab[a + b] = id;
    merges += a + " " + b + "\n";
  };
  for (char a = 'a'; a <= 'z'; ++a)
    for (char b = 'a'; b <= 'z'; ++b) merge(sym(a), sym(b));
  for (char a = 'a'; a <= 'z'; ++a) merge(sym(' '), sym(a));
  for (int i = 0; vocab.size() < 999; ++i)
    merge(sym(char('a' + i / 26)) + sym(char('a' + i % 26)), sym('e'));
  vocab["<|endoftext|>"] = 999;
  std::ofstream(dir / "vocab.json") << vocab.dump();
  std::ofstream(dir / "merges.txt") << merges;
  return dir;
}

TEST(CliModels, RunStreamsTextWithATokenizer) {
  const fs::path dir = write_tiny_folder_with_tokenizer();
  const std::string model = "run -m '" + dir.string() + "'";
  const Result r = run_kda(model + " -p 'hello world' -n 12", false);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output.rfind("hello world", 0), 0u) << r.output;  // the prompt, then its continuation
  EXPECT_GT(r.output.size(), std::string("hello world\n").size()) << r.output;
  const Result stats = run_kda(model + " -p 'hello world' -n 12 --temp 0.8 --top-k 40 --seed 5");
  EXPECT_EQ(stats.status, 0) << stats.output;
  EXPECT_NE(stats.output.find("[kda run] prompt: "), std::string::npos) << stats.output;
  // GPT-2's tokenizer has no chat template.
  const Result chat = run_kda(model + " -p hi --chat");
  EXPECT_EQ(chat.status, 1) << chat.output;
  EXPECT_NE(chat.output.find("chat template"), std::string::npos) << chat.output;
  fs::remove_all(dir);
}

TEST(CliModels, RunRejectsBadFlags) {
  const std::string model = "run -m '" + kFixture + "'";
  const std::pair<std::string, std::string> cases[] = {
      {model + " --ids 1,2,3 --bogus", "unknown option '--bogus'"},
      {model + " --ids 1,x,3", "--ids"},
      {model + " --ids 1,2,3000", "3000"},
      {model + " --ids 1,2 -n 0", "-n"},
      {model + " --ids 1,2 --temp -1", "temperature"},
      {model + " --ids 1,2 --top-p 2", "top-p"},
      {model + " --ids 1,2 --ctx", "--ctx needs a value"},
      {model + " -p hello", "no tokenizer"},
      {model, "-p TEXT or --ids"},
      {"run --ids 1", "-m DIR"},
      {"run -m /nonexistent/folder --ids 1", "/nonexistent/folder"},
      {model + " --ids 1,2 --device tpu", "expected cpu or cuda"},
      {model + " --ids 1,2 --dtype fp8", "expected bf16 or fp32"},
  };
  for (const auto& [args, needle] : cases) {
    const Result r = run_kda(args);
    EXPECT_EQ(r.status, 1) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(needle), std::string::npos) << args << "\n" << r.output;
  }
}

// Without a GPU (CI), --device cuda must end in a clear error, not a crash; with one, it runs.
TEST(CliModels, RunOnCudaWithoutAGpuFailsCleanly) {
  const Result r = run_kda("run -m '" + kFixture + "' --ids 1,2,3 -n 3 --device cuda");
  if (r.status == 0) GTEST_SKIP() << "a GPU is present: " << r.output;
  EXPECT_EQ(r.status, 1) << r.output;
  const bool explained =
      r.output.find("CUDA") != std::string::npos || r.output.find("cuda") != std::string::npos;
  EXPECT_TRUE(explained) << r.output;
}

TEST(CliModels, InfoOnFolderAndBareConfig) {
  const Result r = run_kda("info '" + kFixture + "'");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("model_type      gpt2"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("180.48 K (180480) total"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("0-1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("at 1M tokens"), std::string::npos) << r.output;

  // A bare config.json (no weights next to it) works too.
  const fs::path dir = fs::temp_directory_path() / ("kda_cli_models_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  fs::copy_file(kFixture + "/config.json", dir / "config.json",
                fs::copy_options::overwrite_existing);
  const Result bare = run_kda("info '" + (dir / "config.json").string() + "'");
  fs::remove_all(dir);
  EXPECT_EQ(bare.status, 0) << bare.output;
  EXPECT_NE(bare.output.find("180480"), std::string::npos) << bare.output;

  const Result missing = run_kda("info /nonexistent/config.json");
  EXPECT_EQ(missing.status, 1);
  EXPECT_NE(missing.output.find("/nonexistent/config.json"), std::string::npos) << missing.output;
}

}  // namespace
}  // namespace kda
