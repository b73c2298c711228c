#include "verify/model_fixture.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <vector>

#include "core/error.h"
#include "core/safetensors.h"
#include "model/causal_lm.h"
#include "runtime/next_token_loss.h"
#include "runtime/sampling.h"
#include "train/model_factory.h"

namespace kda::verify {

namespace {

namespace fs = std::filesystem;

// Token ids of fixture tensor `name` ([1, N] int64) as the model's int32 ids.
std::vector<int32_t> token_ids(const Fixture& fx, const std::string& name, int64_t vocab) {
  const std::vector<int64_t> shape = fx.shape(name);
  require(shape.size() == 2 && shape[0] == 1 && shape[1] >= 1,
          fx.path() + ": '" + name + "' must have shape [1, N] with N >= 1");
  std::vector<int32_t> ids;
  for (const int64_t id : fx.i64(name)) {
    require(id >= 0 && id < vocab, fx.path() + ": '" + name + "' holds token id " +
                                       std::to_string(id) + ", outside the vocabulary of " +
                                       std::to_string(vocab));
    ids.push_back(int32_t(id));
  }
  return ids;
}

std::vector<float> as_vector(const Tensor& t) {
  return std::vector<float>(t.f32(), t.f32() + t.numel());
}

}  // namespace

bool is_model_fixture(const std::string& path) {
  return fs::is_directory(path) && fs::exists(fs::path(path) / "config.json") &&
         fs::exists(fs::path(path) / "reference.safetensors");
}

FixtureReport check_model_folder(const std::string& path, const ModelLoader& load) {
  const std::unique_ptr<model::CausalLM> lm = load ? load(path) : model::load_causal_lm(path);
  const Fixture fx((fs::path(path) / "reference.safetensors").string());
  const int64_t V = lm->vocab_size();
  FixtureReport report;
  report.file = path;
  report.op = lm->info().model_type;

  // One forward pass without caches: logits and the next-token loss.
  const std::vector<int32_t> ids = token_ids(fx, "input_ids", V);
  const int64_t N = int64_t(ids.size());
  const std::vector<int64_t> logits_shape = fx.shape("logits");
  require(logits_shape == std::vector<int64_t>{1, N, V},
          fx.path() + ": 'logits' has the wrong shape for " + std::to_string(N) +
              " tokens and vocabulary " + std::to_string(V));
  const Tensor logits = lm->forward(ids);
  add_row(report, fx, "forward", "logits", as_vector(logits), kLogitsTolerance);
  if (N >= 2) {
    const std::vector<float> want = fx.f32("loss");
    require(want.size() == 1, fx.path() + ": 'loss' must hold one value");
    const double ours = runtime::mean_next_token_loss(logits, ids);
    const double error = std::abs(ours - double(want[0])) / std::abs(double(want[0]));
    report.rows.push_back({"forward", "loss", std::isfinite(error) ? error : NAN, kLossTolerance});
  }

  // The same tokens through a session: the first half as one prefill, the rest one at a time.
  {
    const std::unique_ptr<model::Session> session = lm->start_session(N);
    const int64_t prefill = (N + 1) / 2;
    std::vector<float> ours;
    ours.reserve(size_t(N * V));
    const Tensor first = session->feed(std::span<const int32_t>(ids).first(size_t(prefill)));
    ours.insert(ours.end(), first.f32(), first.f32() + first.numel());
    for (int64_t t = prefill; t < N; ++t) {
      const Tensor step = session->feed(std::span<const int32_t>(ids).subspan(size_t(t), 1));
      ours.insert(ours.end(), step.f32(), step.f32() + step.numel());
    }
    add_row(report, fx, "prefill+decode", "logits", ours, kLogitsTolerance);
  }

  // Greedy continuation through the decode path: the prompt at once, then one token at a time.
  const std::vector<int32_t> prompt = token_ids(fx, "greedy_prompt", V);
  const std::vector<int32_t> want = token_ids(fx, "greedy_out", V);
  require(want.size() >= prompt.size(),
          fx.path() + ": 'greedy_out' is shorter than 'greedy_prompt'");
  const std::unique_ptr<model::Session> session = lm->start_session(int64_t(want.size()));
  std::vector<int32_t> out = prompt;
  Tensor last = session->feed_last(prompt);
  while (out.size() < want.size()) {
    const int32_t next = runtime::argmax(last.span_f32());
    out.push_back(next);
    if (out.size() < want.size()) last = session->feed_last(std::span<const int32_t>(&next, 1));
  }
  int64_t mismatches = 0;
  for (size_t i = 0; i < want.size(); ++i) mismatches += out[i] != want[i];
  report.rows.push_back({"decode", "greedy", double(mismatches), 0.0});

  // Gradients of the loss with respect to every weight, when the folder has grads/.
  const fs::path grads_path = fs::path(path) / "grads" / "model.safetensors";
  if (fs::exists(grads_path) && N >= 2 && !load) {
    const std::unique_ptr<train::TrainableModel> model = train::load_trainable(path);
    std::vector<int32_t> targets(ids.begin() + 1, ids.end());
    targets.push_back(-1);
    model->zero_grad();
    const double loss = model->forward_backward(ids.data(), targets.data(), 1, N, true).loss;
    const std::vector<float> want = fx.f32("loss");
    report.rows.push_back(
        {"backward", "loss", std::abs(loss - want[0]) / std::abs(want[0]), kLossTolerance});
    const SafetensorsFile grads = SafetensorsFile::open(grads_path.string());
    const std::vector<std::string> names = grads.names();
    double worst = 0;
    std::string worst_name = "(none)";
    int64_t compared = 0;
    for (train::Param* p : model->params()) {
      require(std::find(names.begin(), names.end(), p->name) != names.end(),
              grads_path.string() + ": no gradient for '" + p->name + "'");
      const Tensor g = grads.load(p->name, DType::f32);
      require(g.numel() == p->grad.numel(),
              grads_path.string() + ": '" + p->name + "' has the wrong size");
      double num = 0, den = 0;
      for (int64_t i = 0; i < g.numel(); ++i) {
        const double d = double(p->grad.f32()[i]) - g.f32()[i];
        num += d * d;
        den += double(g.f32()[i]) * g.f32()[i];
      }
      // a non-finite error counts as infinite: the worst there is, never overtaken by a later
      // tensor (a NaN would be, since every comparison with it is false)
      double error = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
      if (!std::isfinite(error)) error = INFINITY;
      if (error > worst || compared == 0) worst = error, worst_name = p->name;
      ++compared;
    }
    require(compared == int64_t(names.size()),
            grads_path.string() + " holds gradients for tensors the model does not have");
    report.rows.push_back(
        {"backward",
         "gradients (" + std::to_string(compared) + " tensors; worst " + worst_name + ")", worst,
         kModelGradientTolerance});
  }
  return report;
}

}  // namespace kda::verify
