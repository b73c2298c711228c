// kda train end to end: checkpoints, bit-exact resume, Ctrl-C saving, the log and the plot.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/safetensors.h"
#include "core/tensor.h"
#include "scratch_dir.h"

namespace {

namespace fs = std::filesystem;

const std::string kArgs =
    " --pattern KA --width 32 --heads 2 --head-dim 16 --mlp 64 --task mqar --vocab 64"
    " --seq-len 32 --batch 4 --lr 3e-3 --seed 5";

int run(const std::string& args) {
  const int status =
      std::system((std::string(KDA_BINARY) + " " + args + " >/dev/null 2>&1").c_str());
  return WEXITSTATUS(status);
}

std::vector<std::string> lines(const fs::path& p) {
  std::ifstream in(p);
  std::vector<std::string> out;
  std::string line;
  while (std::getline(in, line)) out.push_back(line);
  return out;
}

// the "loss" field of a log line, as written (bit-for-bit comparisons); a run whose losses
// are not finite numbers fails here, so that two NaN runs cannot match each other
std::string loss_of(const std::string& line) {
  const auto at = line.find("\"loss\":");
  EXPECT_NE(at, std::string::npos) << line;
  if (at == std::string::npos) return "";
  const std::string field = line.substr(at, line.find(',', at) - at);
  const std::string value = field.substr(7);
  char* end = nullptr;
  const double loss = std::strtod(value.c_str(), &end);
  EXPECT_TRUE(end != value.c_str() && std::isfinite(loss)) << "loss not a finite number: " << line;
  return field;
}

TEST(CliTrain, ResumedRunMatchesTheUninterruptedOneBitForBit) {
  const kda::testing::ScratchDir scratch;  // this test's own folder
  const fs::path a = scratch.file("kda_train_a"), b = scratch.file("kda_train_b");
  fs::remove_all(a);
  fs::remove_all(b);
  ASSERT_EQ(run("train --out " + a.string() + " --steps 12" + kArgs), 0);
  ASSERT_EQ(run("train --out " + b.string() + " --steps 12 --stop-after 5" + kArgs), 0);
  EXPECT_EQ(lines(b / "log.jsonl").size(), 5u);
  ASSERT_EQ(run("train --resume " + b.string()), 0);
  const auto la = lines(a / "log.jsonl"), lb = lines(b / "log.jsonl");
  ASSERT_EQ(la.size(), 12u);
  ASSERT_EQ(lb.size(), 12u);
  for (size_t i = 0; i < la.size(); ++i)
    EXPECT_EQ(loss_of(la[i]), loss_of(lb[i])) << "step " << i + 1;
  for (const char* f : {"config.json", "model.safetensors", "optimizer.safetensors",
                        "trainer_state.json", "loss.svg"}) {
    EXPECT_TRUE(fs::exists(a / f)) << f;
  }
  // a second run into a folder holding a checkpoint is refused
  EXPECT_EQ(run("train --out " + a.string() + " --steps 12" + kArgs), 1);
}

TEST(CliTrain, CtrlCSavesACheckpointThatResumes) {
  const kda::testing::ScratchDir scratch;  // this test's own folder
  const fs::path dir = scratch.file("kda_train_sigint");
  fs::remove_all(dir);
  const pid_t pid = fork();
  if (pid == 0) {
    const int null = open("/dev/null", O_WRONLY);
    dup2(null, 1);
    dup2(null, 2);
    execl(KDA_BINARY, KDA_BINARY, "train", "--out", dir.c_str(), "--steps", "100000", "--pattern",
          "K", "--width", "32", "--heads", "2", "--head-dim", "16", "--mlp", "64", "--task",
          "stack", "--vocab", "64", "--seq-len", "32", "--batch", "4", nullptr);
    _exit(127);
  }
  // wait until a few steps are logged
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (std::chrono::steady_clock::now() < deadline && lines(dir / "log.jsonl").size() < 3)
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  kill(pid, SIGINT);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 130);
  ASSERT_TRUE(fs::exists(dir / "trainer_state.json"));
  std::ifstream in(dir / "trainer_state.json");
  std::stringstream state;
  state << in.rdbuf();
  EXPECT_NE(state.str().find("\"step\""), std::string::npos);
  EXPECT_EQ(run("train --resume " + dir.string() + " --stop-after 2"), 0);
}

}  // namespace

namespace {

const std::string kKimiTiny = std::string(KDA_SHARED_DIR) + "/fixtures/models/kimi_linear_tiny";
// Two micro-batches of 2 make the step of one batch of 4 (the same examples, in order): on
// Stack, whose rows score different numbers of tokens, as on MQAR. The losses, gradient norms
// and weights after two steps agree to fp32 rounding.
TEST(CliTrain, GradientAccumulationEqualsOneBatch) {
  const kda::testing::ScratchDir scratch;
  for (const char* task : {"stack", "mqar"}) {
    const std::string args = std::string(" --pattern KA --width 32 --heads 2 --head-dim 16") +
                             " --mlp 64 --vocab 64 --seq-len 32 --lr 3e-3 --seed 5 --steps 2" +
                             " --eval-every 0 --task " + task;
    const fs::path one = scratch.file(std::string(task) + "_one"),
                   two = scratch.file(std::string(task) + "_two");
    ASSERT_EQ(run("train --out " + one.string() + " --batch 4" + args), 0);
    ASSERT_EQ(run("train --out " + two.string() + " --batch 2 --grad-accum 2" + args), 0);
    const auto a = lines(one / "log.jsonl"), b = lines(two / "log.jsonl");
    ASSERT_EQ(a.size(), 2u);
    ASSERT_EQ(b.size(), 2u);
    auto field = [](const std::string& line, const std::string& key) {
      const auto at = line.find("\"" + key + "\":");
      EXPECT_NE(at, std::string::npos) << key << " in " << line;
      return at == std::string::npos ? NAN
                                     : std::strtod(line.c_str() + at + key.size() + 3, nullptr);
    };
    for (size_t i = 0; i < a.size(); ++i)
      for (const char* key : {"loss", "grad_norm"}) {
        const double x = field(a[i], key), y = field(b[i], key);
        EXPECT_LE(std::abs(x - y), 1e-5 * std::abs(x)) << task << " step " << i + 1 << " " << key;
      }
    const kda::SafetensorsFile wa = kda::SafetensorsFile::open(one / "model.safetensors");
    const kda::SafetensorsFile wb = kda::SafetensorsFile::open(two / "model.safetensors");
    double num = 0, den = 0;
    for (const std::string& name : wa.names()) {
      const kda::Tensor x = wa.load(name), y = wb.load(name);
      for (int64_t i = 0; i < x.numel(); ++i) {
        num += (double(x.f32()[i]) - y.f32()[i]) * (double(x.f32()[i]) - y.f32()[i]);
        den += double(x.f32()[i]) * x.f32()[i];
      }
    }
    EXPECT_LE(std::sqrt(num / den), 1e-6) << task << " weights after two steps";
  }
}

const std::string kKimiArgs = " --task mqar --vocab 64 --seq-len 32 --batch 2 --lr 3e-3 --seed 7";

// A Kimi Linear run (KDA, MLA, MoE with its balancing bias) resumes bit for bit, and its
// folder, exported to bf16, runs in `kda run`.
TEST(CliTrain, KimiLinearRunResumesExactlyAndExportsARunnableModel) {
  const kda::testing::ScratchDir scratch;  // this test's own folder
  const fs::path a = scratch.file("kda_train_kimi_a"), b = scratch.file("kda_train_kimi_b"),
                 e = scratch.file("kda_train_kimi_export");
  for (const fs::path& p : {a, b, e}) fs::remove_all(p);
  const std::string model = " --model " + kKimiTiny + "/config.json";
  ASSERT_EQ(run("train --out " + a.string() + " --steps 6" + model + kKimiArgs), 0);
  ASSERT_EQ(run("train --out " + b.string() + " --steps 6 --stop-after 3" + model + kKimiArgs), 0);
  ASSERT_EQ(run("train --resume " + b.string()), 0);
  const auto la = lines(a / "log.jsonl"), lb = lines(b / "log.jsonl");
  ASSERT_EQ(la.size(), 6u);
  ASSERT_EQ(lb.size(), 6u);
  for (size_t i = 0; i < la.size(); ++i)
    EXPECT_EQ(loss_of(la[i]), loss_of(lb[i])) << "step " << i + 1;
  // the run folder is a model folder, and so is its bf16 export
  EXPECT_EQ(run("run -m " + a.string() + " --ids 1,2,3 -n 4"), 0);
  ASSERT_EQ(run("export " + a.string() + " " + e.string()), 0);
  EXPECT_LT(fs::file_size(e / "model.safetensors"),
            fs::file_size(a / "model.safetensors") * 6 / 10);
  {  // every tensor of the run under its name and shape, stored as the bf16 rounding of its value
    const kda::SafetensorsFile run_file = kda::SafetensorsFile::open(a / "model.safetensors");
    const kda::SafetensorsFile exported = kda::SafetensorsFile::open(e / "model.safetensors");
    ASSERT_EQ(exported.names(), run_file.names());
    for (const std::string& name : run_file.names()) {
      const kda::Tensor want = run_file.load(name, kda::DType::f32);
      const kda::TensorView got = exported.view(name);
      ASSERT_EQ(got.dtype, kda::DType::bf16) << name;
      ASSERT_EQ(got.shape, want.shape()) << name;
      const uint16_t* bits = got.as<uint16_t>();
      for (int64_t i = 0; i < want.numel(); ++i)
        ASSERT_EQ(bits[i], kda::f32_to_bf16(want.f32()[i])) << name << " element " << i;
    }
  }
  EXPECT_EQ(run("run -m " + e.string() + " --ids 1,2,3 -n 4"), 0);
  EXPECT_NE(run("export " + a.string() + " " + e.string()), 0);  // never overwrites
  // starting from a folder's weights
  fs::remove_all(b);
  EXPECT_EQ(run("train --out " + b.string() + " --steps 2 --model " + kKimiTiny + kKimiArgs), 0);
  for (const fs::path& p : {a, b, e}) fs::remove_all(p);
}

}  // namespace

namespace {

// stdout + stderr and the exit status of a kda command
std::pair<int, std::string> run_capture(const std::string& args) {
  const fs::path out = fs::temp_directory_path() / ("kda_cli_train_" + std::to_string(::getpid()));
  const int status =
      std::system((std::string(KDA_BINARY) + " " + args + " >'" + out.string() + "' 2>&1").c_str());
  std::ifstream in(out);
  std::stringstream text;
  text << in.rdbuf();
  fs::remove(out);
  return {WEXITSTATUS(status), text.str()};
}

}  // namespace

// Without a GPU (or without CUDA in the build), --device cuda fails with a message, never a
// crash; a device name that does not exist is refused by name.
// --deterministic is a setting of the run (its config.json), so a --resume keeps it; given to
// --resume, it turns it on from there.
TEST(CliTrain, DeterministicIsKeptInTheRunsConfig) {
  const kda::testing::ScratchDir scratch;  // this test's own folder
  const fs::path a = scratch.file("kda_train_det"), b = scratch.file("kda_train_plain");
  ASSERT_EQ(run("train --out " + a.string() + " --steps 2 --deterministic" + kArgs), 0);
  ASSERT_EQ(run("train --out " + b.string() + " --steps 3 --stop-after 2" + kArgs), 0);
  const auto has = [](const fs::path& dir) {
    std::ifstream in(dir / "config.json");
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (text.find("\"deterministic\": true") != std::string::npos) return 1;
    if (text.find("\"deterministic\": false") != std::string::npos) return 0;
    return -1;  // absent
  };
  EXPECT_EQ(has(a), 1);
  EXPECT_EQ(has(b), 0);
  ASSERT_EQ(run("train --resume " + b.string() + " --deterministic"), 0);
  EXPECT_EQ(has(b), 1);
}

TEST(CliTrain, DeviceCudaWithoutAGpuFailsCleanly) {
  const kda::testing::ScratchDir scratch;  // this test's own folder
  const fs::path dir = scratch.file("kda_train_cuda");
  fs::remove_all(dir);
  const auto [code, out] =
      run_capture("train --out " + dir.string() + " --steps 2 --device cuda" + kArgs);
  fs::remove_all(dir);
  if (code == 0) GTEST_SKIP() << "a GPU is present: " << out;
  EXPECT_EQ(code, 1) << out;
  EXPECT_TRUE(out.find("cuda") != std::string::npos || out.find("CUDA") != std::string::npos)
      << out;
  EXPECT_EQ(out.find("internal error"), std::string::npos) << out;
  const auto [code2, out2] =
      run_capture("train --out " + dir.string() + " --steps 2 --device tpu" + kArgs);
  fs::remove_all(dir);
  EXPECT_EQ(code2, 1) << out2;
  EXPECT_NE(out2.find("device 'tpu' is not in this build"), std::string::npos) << out2;
}
