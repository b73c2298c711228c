// Suite "gpt2_train": GPT-2 training on the GPU (model/cuda/gpt2_cuda_train.h) against the
// gpt2_tiny fixture (<shared>/models/gpt2_tiny): the mean next-token loss over its input_ids
// (targets = ids shifted by one, the last position unscored, as verify/model_fixture.cpp) and
// every parameter's gradient against transformers' (grads/model.safetensors), in fp32 (loss 1e-5,
// gradients 1e-3) and bf16 (2e-2, 5e-2); in fp32 also the same sequence as a batch of two rows
// (same loss and gradients), and one AdamW update against the host formula. With --bench: a
// GPT-2 124M step (forward + backward + AdamW, bf16, B 16, T 1024, random weights) in ms,
// tokens/s and MFU.
#include <chrono>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/gpu/model/gpu_suite.h"
#include "core/error.h"
#include "core/safetensors.h"
#include "model/cuda/gpt2_cuda_train.h"

namespace kda::gpu_check {
namespace {

namespace fs = std::filesystem;
using model::cuda::Gpt2CudaTrainer;

void fail(Tally& tally, const std::string& name, const std::string& why) {
  std::printf("CHECK %-60s FAIL (%s)\n", name.c_str(), why.c_str());
  std::fflush(stdout);
  tally.failed++;
}

// The fixture's ids and next-token targets (last position -1).
struct Tokens {
  std::vector<int32_t> ids, targets;
};

Tokens fixture_tokens(const SafetensorsFile& ref) {
  const Tensor t = ref.load("input_ids", DType::i64);
  Tokens out;
  for (int64_t i = 0; i < t.numel(); ++i) out.ids.push_back(int32_t(t.data<int64_t>()[i]));
  out.targets.assign(out.ids.begin() + 1, out.ids.end());
  out.targets.push_back(-1);
  return out;
}

void check_fixture(const fs::path& dir, ElementType type, Tally& tally) {
  const bool exact = type == ElementType::f32;
  const std::string tag = std::string("gpt2_train ") + (exact ? "fp32" : "bf16");
  const double loss_tol = exact ? 1e-5 : 2e-2, grad_tol = exact ? 1e-3 : 5e-2;
  const fs::path grads_path = dir / "grads" / "model.safetensors";
  if (!fs::exists(grads_path)) {
    fail(tally, tag,
         "missing " + grads_path.string() +
             " (carry gpu_carry/shared/models/gpt2_tiny/grads/model.safetensors)");
    return;
  }
  const SafetensorsFile ref = SafetensorsFile::open((dir / "reference.safetensors").string());
  const SafetensorsFile grads = SafetensorsFile::open(grads_path.string());
  const Tokens tok = fixture_tokens(ref);
  const int64_t N = int64_t(tok.ids.size());
  const double want_loss = ref.load("loss", DType::f32).f32()[0];

  Gpt2CudaTrainer trainer(dir.string(), type);
  const double loss = trainer.step(tok.ids.data(), tok.targets.data(), 1, N);
  std::printf("  %s loss %.7f (transformers %.7f)\n", tag.c_str(), loss, want_loss);
  report(tally, tag + " loss", std::abs(loss - want_loss) / std::abs(want_loss), loss_tol);

  const std::vector<std::string> names = trainer.parameter_names();
  std::vector<std::vector<float>> ours;  // kept for the batch and AdamW checks
  for (const std::string& name : names) {
    if (!grads.contains(name)) {
      fail(tally, tag + " grad " + name, "no gradient in " + grads_path.string());
      ours.emplace_back();
      continue;
    }
    const Tensor want = grads.load(name, DType::f32);
    ours.push_back(trainer.gradient(name));
    if (int64_t(ours.back().size()) != want.numel()) {
      fail(tally, tag + " grad " + name, "wrong size");
      continue;
    }
    report(tally, tag + " grad " + name, rel_error(widen(ours.back()), widen(want)), grad_tol);
  }
  if (grads.names().size() != names.size())
    fail(tally, tag + " grads", grads_path.string() + " holds tensors the trainer lacks");
  if (!exact) return;

  // The same sequence twice as a batch of two rows: the mean loss and its gradients are unchanged
  // (positions restart at each row; per-row attention; the position gradient sums both rows).
  {
    Tokens two;
    for (int r = 0; r < 2; ++r) {
      two.ids.insert(two.ids.end(), tok.ids.begin(), tok.ids.end());
      two.targets.insert(two.targets.end(), tok.targets.begin(), tok.targets.end());
    }
    const double loss2 = trainer.step(two.ids.data(), two.targets.data(), 2, N);
    report(tally, tag + " B=2 loss", std::abs(loss2 - loss) / std::abs(loss), 1e-5);
    double worst = 0;
    for (size_t i = 0; i < names.size(); ++i) {
      if (ours[i].empty()) continue;
      worst = std::max(worst, rel_error(widen(trainer.gradient(names[i])), widen(ours[i])));
    }
    report(tally, tag + " B=2 gradients (worst tensor)", worst, 1e-4);
  }

  // One AdamW update (lr 3e-4, weight decay 0.1, clip 1e-2 so that clipping acts) against the
  // host formula from the B=1 gradients (step() again restores them).
  {
    trainer.step(tok.ids.data(), tok.targets.data(), 1, N);
    std::vector<std::vector<float>> before;
    double norm2 = 0;
    for (const std::string& name : names) {
      before.push_back(trainer.value(name));
      for (float g : trainer.gradient(name)) norm2 += double(g) * g;
    }
    const float lr = 3e-4f, wd = 0.1f, clip_norm = 1e-2f;
    const double norm = trainer.adamw(lr, wd, clip_norm);
    report(tally, tag + " adamw gradient norm",
           std::abs(norm - std::sqrt(norm2)) / std::sqrt(norm2), 1e-5);
    const float clip = std::sqrt(norm2) > clip_norm ? float(clip_norm / std::sqrt(norm2)) : 1.f;
    const float b1 = 0.9f, b2 = 0.95f, eps = 1e-8f;
    std::vector<double> got, want;
    for (size_t i = 0; i < names.size(); ++i) {
      const std::vector<float> g = trainer.gradient(names[i]);
      const std::vector<float> after = trainer.value(names[i]);
      const std::vector<double> a = widen(after);
      got.insert(got.end(), a.begin(), a.end());
      // decay on matrices and embeddings (rank 2 in the checkpoint): not on vectors
      const bool decay =
          names[i].find("ln_") == std::string::npos && names[i].find(".bias") == std::string::npos;
      for (size_t j = 0; j < g.size(); ++j) {
        const float gj = g[j] * clip;
        const float m = (1.f - b1) * gj, v = (1.f - b2) * gj * gj;
        float w = before[i][j];
        w -= (decay ? lr * wd : 0.f) * w;
        w -= lr * (m / (1.f - b1)) / (std::sqrt(v / (1.f - b2)) + eps);
        want.push_back(w);
      }
    }
    report(tally, tag + " adamw update", rel_error(got, want), 1e-6);
    const double loss_after = trainer.step(tok.ids.data(), tok.targets.data(), 1, N);
    std::printf("  %s loss after one update %.7f (before %.7f)\n", tag.c_str(), loss_after, loss);
    report(tally, tag + " adamw lowers the loss", loss_after < loss ? 0.0 : 1.0, 0.0);
  }
}

void run_checks(const SuiteOptions& options, Tally& tally) {
  const fs::path dir = fs::path(options.shared_dir) / "models" / "gpt2_tiny";
  if (!fs::exists(dir / "reference.safetensors")) {
    fail(tally, "gpt2_train", "missing " + (dir / "reference.safetensors").string());
    return;
  }
  for (const ElementType type : {ElementType::f32, ElementType::bf16}) {
    try {
      check_fixture(dir, type, tally);
    } catch (const std::exception& e) {
      fail(tally, std::string("gpt2_train ") + (type == ElementType::f32 ? "fp32" : "bf16"),
           std::string("exception: ") + e.what());
    }
  }
}

void run_bench(Tally& tally) {
  const nlohmann::json config = {{"model_type", "gpt2"}, {"n_layer", 12},
                                 {"n_embd", 768},        {"n_head", 12},
                                 {"vocab_size", 50257},  {"n_positions", 1024}};
  const int64_t B = 16, T = 1024, R = B * T;
  Gpt2CudaTrainer trainer(config, ElementType::bf16, 1234);
  Random rng(99);
  std::vector<int32_t> ids(static_cast<size_t>(R)), targets(static_cast<size_t>(R));
  for (auto& id : ids) id = int32_t(rng.integer(0, 50256));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      targets[size_t(b * T + t)] = t + 1 < T ? ids[size_t(b * T + t + 1)] : -1;
  const auto train_step = [&] {
    const double loss = trainer.step(ids.data(), targets.data(), B, T);
    trainer.adamw(6e-4f, 0.1f, 1.0f);
    return loss;
  };
  double first_loss = 0;
  for (int i = 0; i < 3; ++i) {
    const double loss = train_step();
    if (i == 0) first_loss = loss;
  }
  cudaDeviceSynchronize();
  constexpr int kSteps = 10;
  double last_loss = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kSteps; ++i) last_loss = train_step();
  ops::cuda::check_cuda(cudaDeviceSynchronize(), "gpt2_train bench");
  const double ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
      kSteps;
  const double tokens_per_s = double(R) / (ms * 1e-3);
  const double params = double(trainer.parameter_count());
  const auto& c = trainer.config();
  // causal attention, forward + backward: 6 L T E per token (half of the full 12 L T E)
  const double attention_flops_per_token = 6.0 * double(c.layers) * double(T) * double(c.embd);
  const double mfu = 6.0 * params * tokens_per_s / 685e12;
  const double mfu_attn = (6.0 * params + attention_flops_per_token) * tokens_per_s / 685e12;
  std::printf(
      "BENCH gpt2_train model=gpt2-124M params=%.0f dtype=bf16 B=%lld T=%lld ms_per_step=%.2f "
      "tokens_per_s=%.0f mfu=%.3f mfu_with_attention=%.3f peak_tflops=685\n",
      params, (long long)B, (long long)T, ms, tokens_per_s, mfu, mfu_attn);
  std::printf("BENCH gpt2_train loss first=%.4f last=%.4f (random tokens; ln V = %.4f)\n",
              first_loss, last_loss, std::log(50257.0));
  std::fflush(stdout);
  report(tally, "gpt2_train bench loss finite", std::isfinite(last_loss) ? 0.0 : 1.0, 0.0);
}

void run_suite(const SuiteOptions& options, Tally& tally) {
  if (options.check) run_checks(options, tally);
  if (options.bench) {
    try {
      run_bench(tally);
    } catch (const std::exception& e) {
      fail(tally, "gpt2_train bench", std::string("exception: ") + e.what());
    }
  }
}

const bool registered = register_suite("gpt2_train", run_suite);

}  // namespace
}  // namespace kda::gpu_check
