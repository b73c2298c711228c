// The trainer's device hooks (train/model_factory.h move_to_device, TrainableModel's
// make_optimizer / scale_grads / pull_values / push_values), which the GPU trainer relies on,
// exercised without a GPU: a "mirror" device keeps the real weights, gradients and optimizer in
// a second model and exposes only stale host mirrors, so any place where the trainer read or wrote
// Param::value / grad behind the hooks' back would change the results.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/safetensors.h"
#include "scratch_dir.h"
#include "train/adamw.h"
#include "train/lineage_model.h"
#include "train/model_factory.h"
#include "train/trainer.h"

namespace kda {
namespace {

namespace fs = std::filesystem;
using train::LineageModel;
using train::Param;

int pulls = 0, pushes = 0;
std::vector<bool> asked_deterministic;  // DeviceTrainingOptions::deterministic, call by call

// Weights live in `device_` (a model of its own); params() are the host model's, synced only by
// pull_values / push_values.
class MirrorModel final : public train::TrainableModel {
 public:
  explicit MirrorModel(std::unique_ptr<LineageModel> host)
      : host_(std::move(host)), device_(std::make_unique<LineageModel>(host_->config(), 0)) {
    push_values();
    pushes = 0;
  }
  std::vector<Param*> params() override { return host_->params(); }
  train::StepResult forward_backward(const int32_t* inputs, const int32_t* targets, int64_t B,
                                     int64_t T, bool backward,
                                     std::span<const int64_t> cu_seqlens) override {
    return device_->forward_backward(inputs, targets, B, T, backward, cu_seqlens);
  }
  void zero_grad() override { device_->zero_grad(); }
  void scale_grads(float s) override { device_->scale_grads(s); }
  std::unique_ptr<train::Optimizer> make_optimizer(const train::AdamWConfig& config) override {
    return std::make_unique<train::AdamW>(device_->params(), config);
  }
  void pull_values() override {
    ++pulls;
    copy(device_->params(), host_->params());
  }
  void push_values() override {
    ++pushes;
    copy(host_->params(), device_->params());
  }

 private:
  static void copy(const std::vector<Param*>& from, const std::vector<Param*>& to) {
    for (size_t i = 0; i < from.size(); ++i)
      std::copy(from[i]->value.f32(), from[i]->value.f32() + from[i]->value.numel(),
                to[i]->value.f32());
  }
  std::unique_ptr<LineageModel> host_, device_;
};

train::TrainSettings settings(const std::string& device) {
  train::TrainSettings s;
  s.model = {64, 32, 2, 16, 64, "KA"};
  s.task = {train::Task::mqar, 64, 32, 0};
  s.steps = 8;
  s.batch = 4;
  s.grad_accum = 2;  // the mean over micro-batches goes through scale_grads
  s.eval_examples = 16;
  s.optimizer.lr = 3e-3f;
  s.optimizer.warmup_steps = 2;
  s.optimizer.total_steps = s.steps;
  s.seed = 3;
  s.device = device;
  return s;
}

std::vector<std::string> log_losses(const fs::path& dir) {
  std::ifstream in(dir / "log.jsonl");
  std::vector<std::string> out;
  std::string line;
  while (std::getline(in, line)) {
    const auto at = line.find("\"loss\":");
    if (at != std::string::npos) out.push_back(line.substr(at, line.find(',', at) - at));
  }
  return out;
}

TEST(TrainDevice, TrainerGoesThroughTheDeviceHooksOnly) {
  const kda::testing::ScratchDir scratch;  // this test's own folder
  train::register_training_device(
      "mirror", [](const nlohmann::json&, std::unique_ptr<train::TrainableModel> host,
                   const train::DeviceTrainingOptions& options) {
        asked_deterministic.push_back(options.deterministic);
        auto* lineage = dynamic_cast<LineageModel*>(host.release());
        EXPECT_NE(lineage, nullptr);
        return std::unique_ptr<train::TrainableModel>(
            std::make_unique<MirrorModel>(std::unique_ptr<LineageModel>(lineage)));
      });
  const fs::path cpu = scratch.file("kda_train_device_cpu"),
                 mirror = scratch.file("kda_train_device_mirror");
  fs::remove_all(cpu);
  fs::remove_all(mirror);
  {
    train::Trainer t(settings("cpu"), cpu.string());
    t.run(0, nullptr, {});
  }
  pulls = pushes = 0;
  asked_deterministic.clear();
  {
    train::TrainSettings s = settings("mirror");
    s.deterministic = true;  // handed to the device's factory, and kept for the resume
    train::Trainer t(s, mirror.string());
    t.run(5, nullptr, {});  // stops and saves after 5 steps
  }
  EXPECT_GE(pulls, 1);  // the checkpoint pulled the device's weights
  {
    auto t = train::Trainer::resume(mirror.string());
    EXPECT_EQ(pushes, 1);  // the checkpoint's weights went to the device
    EXPECT_EQ(t->settings().device, "mirror");
    EXPECT_TRUE(t->settings().deterministic);
    t->run(0, nullptr, {});
  }
  EXPECT_EQ(asked_deterministic, (std::vector<bool>{true, true}));
  const auto a = log_losses(cpu), b = log_losses(mirror);
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 8u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "step " << i + 1;
  const SafetensorsFile wa = SafetensorsFile::open((cpu / "model.safetensors").string());
  const SafetensorsFile wb = SafetensorsFile::open((mirror / "model.safetensors").string());
  for (const std::string& name : wa.names()) {
    const Tensor x = wa.load(name), y = wb.load(name);
    ASSERT_EQ(x.numel(), y.numel()) << name;
    for (int64_t i = 0; i < x.numel(); ++i) ASSERT_EQ(x.f32()[i], y.f32()[i]) << name;
  }
  fs::remove_all(cpu);
  fs::remove_all(mirror);
}

TEST(TrainDevice, UnknownDeviceIsRefusedByName) {
  const kda::testing::ScratchDir scratch;  // this test's own folder
  const fs::path dir = scratch.file("kda_train_device_unknown");
  fs::remove_all(dir);
  try {
    train::Trainer t(settings("tpu"), dir.string());
    FAIL() << "a device that does not exist was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("device 'tpu' is not in this build"), std::string::npos)
        << e.what();
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kda
