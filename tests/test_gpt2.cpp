// GPT-2 against transformers' reference (the gpt2_tiny fixture through verify), decode through
// the session against the whole forward, the checkpoint variants a folder may hold (bf16/fp16,
// sharded index, saved lm_head and mask buffers), the errors bad folders must give, and the
// sampler.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/random.h"
#include "core/safetensors.h"
#include "model/causal_lm.h"
#include "model/gpt2.h"
#include "model/model_folder.h"
#include "runtime/sampling.h"
#include "scratch_dir.h"
#include "verify/model_fixture.h"

namespace kda {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const std::string kFixture = std::string(KDA_SHARED_DIR) + "/fixtures/models/gpt2_tiny";

using testing::ScratchDir;

json fixture_config() {
  std::ifstream in(kFixture + "/config.json");
  return json::parse(in);
}

// Every tensor of the fixture's checkpoint, fp32.
std::map<std::string, Tensor> fixture_tensors() {
  const SafetensorsFile file = SafetensorsFile::open(kFixture + "/model.safetensors");
  std::map<std::string, Tensor> out;
  for (const std::string& name : file.names()) out[name] = file.load(name, DType::f32);
  return out;
}

void write_json(const std::string& path, const json& value) {
  std::ofstream(path) << value.dump(2);
}

// A model folder: config.json and one model.safetensors with the tensors stored as `dtype`.
void write_folder(const std::string& dir, const json& config,
                  const std::map<std::string, Tensor>& tensors, DType dtype = DType::f32) {
  write_json(dir + "/config.json", config);
  std::vector<Tensor> converted;
  converted.reserve(tensors.size());
  std::vector<NamedTensor> named;
  for (const auto& [name, t] : tensors) {
    converted.push_back(t.to(dtype));
    named.push_back({name, &converted.back()});
  }
  write_safetensors(dir + "/model.safetensors", named, {{"format", "pt"}});
}

std::vector<int32_t> random_ids(Random& rng, int64_t n, int64_t vocab) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int32_t& id : ids) id = int32_t(rng.integer(0, vocab - 1));
  return ids;
}

// ||a - b|| / ||b||; infinity when anything is not finite or the sizes differ.
double relative_error(std::span<const float> a, std::span<const float> b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = double(a[i]) - double(b[i]);
    diff += d * d;
    norm += double(b[i]) * double(b[i]);
  }
  const double error = std::sqrt(diff / norm);
  return std::isfinite(error) ? error : std::numeric_limits<double>::infinity();
}

std::span<const float> row(const Tensor& t, int64_t r) {
  const int64_t width = t.dim(-1);
  return {t.f32() + r * width, size_t(width)};
}

// Runs `fn`, expecting kda::Error whose message contains `needle`.
template <class Fn>
void expect_error_naming(Fn&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no kda::Error (expected one naming '" << needle << "')";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message '" << e.what() << "' does not name '" << needle << "'";
  }
}

TEST(Gpt2Fixture, VerifyMatchesTransformers) {
  const verify::FixtureReport report = verify::check_model_folder(kFixture);
  EXPECT_EQ(report.op, "gpt2");
  ASSERT_GE(report.rows.size(), 4u);
  for (const verify::CheckRow& r : report.rows) {
    EXPECT_TRUE(r.passed()) << r.path << " " << r.quantity << ": " << r.error << " > "
                            << r.tolerance;
  }
  EXPECT_TRUE(verify::is_model_fixture(kFixture));
  EXPECT_FALSE(verify::is_model_fixture(kFixture + "/model.safetensors"));
}

// A NaN in one tensor's gradient fails the gradient row, whichever tensors come after it.
TEST(Gpt2Fixture, VerifyFailsOnANonFiniteGradient) {
  for (const char* poisoned : {"transformer.wte.weight", "transformer.h.0.attn.c_attn.weight"}) {
    ScratchDir dir;
    for (const char* f : {"config.json", "model.safetensors", "reference.safetensors"})
      fs::copy_file(kFixture + "/" + f, dir.file(f));
    fs::create_directories(dir.file("grads"));
    const SafetensorsFile grads = SafetensorsFile::open(kFixture + "/grads/model.safetensors");
    std::vector<Tensor> tensors;
    const std::vector<std::string> names = grads.names();
    for (const std::string& name : names) tensors.push_back(grads.load(name));
    std::vector<NamedTensor> out;
    for (size_t i = 0; i < names.size(); ++i) {
      if (names[i] == poisoned) tensors[i].f32()[tensors[i].numel() / 2] = NAN;
      out.push_back({names[i], &tensors[i]});
    }
    write_safetensors(dir.file("grads/model.safetensors"), out);
    const verify::FixtureReport report = verify::check_model_folder(dir.str());
    int gradient_rows = 0;
    for (const verify::CheckRow& r : report.rows) {
      if (r.quantity.rfind("gradients", 0) != 0) {
        EXPECT_TRUE(r.passed()) << r.path << " " << r.quantity;  // the rest is untouched
        continue;
      }
      ++gradient_rows;
      EXPECT_FALSE(r.passed()) << poisoned << ": " << r.quantity << " " << r.error;
      EXPECT_NE(r.quantity.find(poisoned), std::string::npos) << r.quantity;
    }
    EXPECT_EQ(gradient_rows, 1) << poisoned;
  }
}

TEST(Gpt2Fixture, DescribeMatchesLoadedModel) {
  const model::ArchitectureInfo info = model::describe_config(fixture_config());
  const auto lm = model::load_causal_lm(kFixture);
  EXPECT_EQ(info.model_type, "gpt2");
  EXPECT_EQ(info.layer_kinds.size(), 2u);
  EXPECT_EQ(info.num_cache_layers, 2);
  EXPECT_EQ(info.num_state_layers, 0);
  EXPECT_EQ(info.cache_bytes_per_token_per_layer, 2 * 64 * 2);  // K and V, bf16
  // Tied embeddings: every parameter is one fp32 weight held once.
  EXPECT_EQ(info.total_params * 4, lm->weight_bytes());
  EXPECT_EQ(info.total_params, 180480);
  EXPECT_EQ(lm->vocab_size(), 1000);
}

// Prefill in uneven chunks and token-by-token decode through the KV cache give the logits of the
// one causal forward at every position.
TEST(Gpt2Session, DecodeMatchesForwardAtEveryPosition) {
  const auto lm = model::load_causal_lm(kFixture);
  Random rng(101);
  const std::vector<int32_t> ids = random_ids(rng, 70, lm->vocab_size());
  const Tensor full = lm->forward(ids);
  ASSERT_EQ(full.shape(), (Shape{70, 1000}));

  // One token at a time from the start (T = 1 everywhere).
  auto session = lm->start_session();
  for (int64_t t = 0; t < 70; ++t) {
    const Tensor step = session->feed(std::span<const int32_t>(ids).subspan(size_t(t), 1));
    ASSERT_EQ(step.shape(), (Shape{1, 1000}));
    EXPECT_LE(relative_error(row(step, 0), row(full, t)), 1e-5) << "position " << t;
  }
  EXPECT_EQ(session->length(), 70);
  EXPECT_EQ(session->memory().cache_bytes, 70 * 2 * (2 * 64) * 4);  // fp32 K and V per layer
  EXPECT_EQ(session->memory().state_bytes, 0);

  // Chunks of 13 (prefill), then 1s, then 9 (prefill on a filled cache), then feed_last.
  session = lm->start_session();
  int64_t t = 0;
  for (const int64_t chunk : {13, 1, 1, 1, 9, 1, 30}) {
    const Tensor out =
        session->feed(std::span<const int32_t>(ids).subspan(size_t(t), size_t(chunk)));
    for (int64_t i = 0; i < chunk; ++i)
      EXPECT_LE(relative_error(row(out, i), row(full, t + i)), 1e-5) << "position " << t + i;
    t += chunk;
  }
  const Tensor last = session->feed_last(std::span<const int32_t>(ids).subspan(size_t(t)));
  ASSERT_EQ(last.shape(), (Shape{1, 1000}));
  EXPECT_LE(relative_error(row(last, 0), row(full, 69)), 1e-5);
}

// decode_batch: sequences at different positions advanced together (each at its own position
// embedding, against its own KV cache), against the same sequences one at a time.
TEST(Gpt2Session, DecodeBatchEqualsOneAtATime) {
  const auto lm = model::load_causal_lm(kFixture);
  Random rng(103);
  std::vector<std::unique_ptr<model::Session>> batched, single;
  std::vector<model::Session*> batch;
  for (const int64_t length : {1, 17, 40}) {
    const std::vector<int32_t> prompt = random_ids(rng, length, lm->vocab_size());
    batched.push_back(lm->start_session());
    single.push_back(lm->start_session());
    batched.back()->feed(prompt);
    single.back()->feed(prompt);
    batch.push_back(batched.back().get());
  }
  for (int step = 0; step < 5; ++step) {
    const std::vector<int32_t> ids = random_ids(rng, 3, lm->vocab_size());
    const Tensor logits = lm->decode_batch(batch, ids);
    ASSERT_EQ(logits.shape(), (Shape{3, 1000}));
    for (int64_t n = 0; n < 3; ++n) {
      const Tensor want = single[size_t(n)]->feed_last(std::span(ids).subspan(size_t(n), 1));
      EXPECT_LE(relative_error(row(logits, n), row(want, 0)), 1e-5) << "sequence " << n;
      EXPECT_EQ(batched[size_t(n)]->length(), single[size_t(n)]->length());
    }
  }
  // a sequence at its context limit stops the whole batch before anything is fed
  auto full = lm->start_session(2);
  full->feed(std::vector<int32_t>{3, 4});
  std::vector<model::Session*> with_full = {batch[0], full.get()};
  expect_error_naming(
      [&] {
        lm->decode_batch(with_full, std::vector<int32_t>{5, 6});
      },
      "context limit");
  EXPECT_EQ(batched[0]->length(), single[0]->length());
}

TEST(Gpt2Session, ContextAndIdLimits) {
  const auto lm = model::load_causal_lm(kFixture);
  auto session = lm->start_session(10);
  EXPECT_EQ(session->max_context(), 10);
  const std::vector<int32_t> eight(8, 5), three(3, 7);
  session->feed(eight);
  expect_error_naming([&] { session->feed(three); }, "context of 10");
  EXPECT_EQ(session->length(), 8);  // the refused feed left the session as it was
  session->feed(std::span<const int32_t>(three).first(2));
  EXPECT_EQ(session->length(), 10);

  EXPECT_EQ(lm->start_session()->max_context(), 256);  // n_positions
  expect_error_naming([&] { lm->start_session(257); }, "257");
  const std::vector<int32_t> bad = {1, 1000};
  expect_error_naming([&] { lm->forward(bad); }, "1000");
  expect_error_naming([&] { lm->forward({}); }, "no tokens");
  const std::vector<int32_t> too_long(257, 1);
  expect_error_naming([&] { lm->forward(too_long); }, "256");
}

// bf16 and fp16 checkpoints convert at load: identical to an fp32 folder holding the same
// rounded values, and near the fp32 model (measured: bf16 2.7e-3, fp16 3.5e-4 relative).
TEST(Gpt2Load, HalfPrecisionCheckpoints) {
  const auto reference = model::load_causal_lm(kFixture);
  Random rng(202);
  const std::vector<int32_t> ids = random_ids(rng, 40, 1000);
  const Tensor want = reference->forward(ids);
  for (const auto& [dtype, tolerance] : {std::pair{DType::bf16, 1e-2}, {DType::f16, 2e-3}}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    ScratchDir half, rounded;
    const std::map<std::string, Tensor> tensors = fixture_tensors();
    write_folder(half.str(), fixture_config(), tensors, dtype);
    std::map<std::string, Tensor> round_trip;
    for (const auto& [name, t] : tensors) round_trip[name] = t.to(dtype).to(DType::f32);
    write_folder(rounded.str(), fixture_config(), round_trip);

    const auto lm = model::load_causal_lm(half.str());
    const Tensor got = lm->forward(ids);
    const double error = relative_error(got.span_f32(), want.span_f32());
    EXPECT_LE(error, tolerance);
    EXPECT_GT(error, 0.0);  // the weights really were rounded
    EXPECT_EQ(relative_error(got.span_f32(),
                             model::load_causal_lm(rounded.str())->forward(ids).span_f32()),
              0.0);
  }
}

// Two shard files and a model.safetensors.index.json load to the same model.
TEST(Gpt2Load, ShardedIndexLoadsIdentically) {
  ScratchDir dir;
  write_json(dir.file("config.json"), fixture_config());
  const std::map<std::string, Tensor> tensors = fixture_tensors();
  std::vector<NamedTensor> shards[2];
  json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", json::object()}};
  const std::string names[2] = {"model-00001-of-00002.safetensors",
                                "model-00002-of-00002.safetensors"};
  int i = 0;
  for (const auto& [name, t] : tensors) {
    const int shard = (i++ % 3 == 0) ? 1 : 0;
    shards[shard].push_back({name, &t});
    index["weight_map"][name] = names[shard];
  }
  for (int s = 0; s < 2; ++s) write_safetensors(dir.file(names[s]), shards[s]);
  write_json(dir.file("model.safetensors.index.json"), index);

  Random rng(303);
  const std::vector<int32_t> ids = random_ids(rng, 33, 1000);
  const Tensor want = model::load_causal_lm(kFixture)->forward(ids);
  const Tensor got = model::load_causal_lm(dir.str())->forward(ids);
  EXPECT_EQ(relative_error(got.span_f32(), want.span_f32()), 0.0);

  // An index naming a shard that is not there.
  index["weight_map"]["transformer.wte.weight"] = "model-00003-of-00003.safetensors";
  write_json(dir.file("model.safetensors.index.json"), index);
  expect_error_naming([&] { model::load_causal_lm(dir.str()); },
                      "model-00003-of-00003.safetensors");
}

// What transformers may save besides the weights: a (tied) lm_head.weight, the causal-mask
// buffers of older versions, no "transformer." prefix; and an untied lm_head.
TEST(Gpt2Load, OptionalTensorsAndUntiedHead) {
  Random rng(404);
  const std::vector<int32_t> ids = random_ids(rng, 21, 1000);
  const Tensor want = model::load_causal_lm(kFixture)->forward(ids);
  {
    ScratchDir dir;
    std::map<std::string, Tensor> tensors = fixture_tensors();
    tensors["lm_head.weight"] = tensors.at("transformer.wte.weight").to(DType::f32);
    for (const char* layer : {"0", "1"}) {
      tensors["transformer.h." + std::string(layer) + ".attn.bias"] =
          Tensor::filled({1, 1, 256, 256}, 1.0f);
      tensors["transformer.h." + std::string(layer) + ".attn.masked_bias"] =
          Tensor::filled({}, -1e4f);
    }
    write_folder(dir.str(), fixture_config(), tensors);
    EXPECT_EQ(
        relative_error(model::load_causal_lm(dir.str())->forward(ids).span_f32(), want.span_f32()),
        0.0);
  }
  {
    ScratchDir dir;
    std::map<std::string, Tensor> tensors;
    for (auto& [name, t] : fixture_tensors())
      tensors[name.substr(std::string("transformer.").size())] = t;
    write_folder(dir.str(), fixture_config(), tensors);
    EXPECT_EQ(
        relative_error(model::load_causal_lm(dir.str())->forward(ids).span_f32(), want.span_f32()),
        0.0);
  }
  {
    // Untied: the head is its own matrix; a head equal to wte reproduces the tied model, and
    // a different head changes the logits.
    ScratchDir dir;
    json config = fixture_config();
    config["tie_word_embeddings"] = false;
    std::map<std::string, Tensor> tensors = fixture_tensors();
    write_folder(dir.str(), config, tensors);
    expect_error_naming([&] { model::load_causal_lm(dir.str()); }, "lm_head.weight");
    tensors["lm_head.weight"] = tensors.at("transformer.wte.weight").to(DType::f32);
    write_folder(dir.str(), config, tensors);
    const auto lm = model::load_causal_lm(dir.str());
    EXPECT_EQ(relative_error(lm->forward(ids).span_f32(), want.span_f32()), 0.0);
    EXPECT_EQ(lm->info().total_params, 180480 + 64000);
    EXPECT_EQ(lm->weight_bytes(), (180480 + 64000) * 4);
    // a head of wte's rows in reverse order: the same logits with the vocabulary reversed (a
    // loader that read wte as the head would give the tied logits unchanged)
    Tensor reversed = tensors.at("transformer.wte.weight").to(DType::f32);
    const int64_t V = reversed.shape()[0], E = reversed.shape()[1];
    for (int64_t v = 0; v < V / 2; ++v)
      std::swap_ranges(reversed.f32() + v * E, reversed.f32() + (v + 1) * E,
                       reversed.f32() + (V - 1 - v) * E);
    tensors["lm_head.weight"] = reversed;
    write_folder(dir.str(), config, tensors);
    const Tensor got = model::load_causal_lm(dir.str())->forward(ids);
    std::vector<float> want_reversed(want.span_f32().begin(), want.span_f32().end());
    for (size_t r = 0; r < want_reversed.size() / size_t(V); ++r)
      std::reverse(want_reversed.begin() + r * V, want_reversed.begin() + (r + 1) * V);
    EXPECT_LE(relative_error(got.span_f32(), want_reversed), 1e-6);  // GEMM blocking differs
  }
}

TEST(Gpt2Load, BadFoldersNameTheProblem) {
  const json config = fixture_config();
  const std::map<std::string, Tensor> good = fixture_tensors();
  {
    ScratchDir dir;
    std::map<std::string, Tensor> tensors = fixture_tensors();
    tensors.erase("transformer.h.1.mlp.c_fc.bias");
    write_folder(dir.str(), config, tensors);
    expect_error_naming([&] { model::load_causal_lm(dir.str()); }, "transformer.h.1.mlp.c_fc.bias");
  }
  {
    ScratchDir dir;
    std::map<std::string, Tensor> tensors = fixture_tensors();
    tensors["transformer.h.0.attn.c_attn.weight"] = Tensor::filled({192, 64}, 0.5f);  // [out, in]
    write_folder(dir.str(), config, tensors);
    expect_error_naming([&] { model::load_causal_lm(dir.str()); },
                        "transformer.h.0.attn.c_attn.weight");
  }
  {
    ScratchDir dir;
    std::map<std::string, Tensor> tensors = fixture_tensors();
    tensors["transformer.h.2.ln_1.weight"] = Tensor::filled({64}, 1.0f);  // a third layer
    write_folder(dir.str(), config, tensors);
    expect_error_naming([&] { model::load_causal_lm(dir.str()); }, "transformer.h.2.ln_1.weight");
  }
  {
    ScratchDir dir;
    json other = config;
    other["model_type"] = "gpt3";
    write_folder(dir.str(), other, good);
    expect_error_naming([&] { model::load_causal_lm(dir.str()); }, "gpt3");
    expect_error_naming([&] { model::describe_config(other); }, "gpt3");
  }
  {
    ScratchDir dir;
    json other = config;
    other["n_head"] = 5;  // 64 is not a multiple of 5
    write_folder(dir.str(), other, good);
    expect_error_naming([&] { model::load_causal_lm(dir.str()); }, "n_head");
    other = config;
    other["activation_function"] = "gelu_10";
    expect_error_naming([&] { model::describe_config(other); }, "gelu_10");
    other = config;
    other["n_embd"] = "64";
    expect_error_naming([&] { model::describe_config(other); }, "n_embd");
  }
}

// ---------------------------------------------------------------------------------------------
// Sampling

std::vector<float> random_logits(Random& rng, int64_t n) {
  std::vector<float> logits(static_cast<size_t>(n));
  rng.fill_normal(logits, 3.0f);
  return logits;
}

TEST(Gpt2Sampling, GreedyIsArgmax) {
  Random rng(11);
  for (int trial = 0; trial < 20; ++trial) {
    const std::vector<float> logits = random_logits(rng, 1000);
    const int32_t best = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    EXPECT_EQ(runtime::argmax(logits), best);
    runtime::Sampler greedy({.temperature = 0, .seed = uint64_t(trial)});
    EXPECT_EQ(greedy.sample(logits), best);
    // top-k = 1 at any temperature is greedy too.
    runtime::Sampler top1({.temperature = 1.5f, .top_k = 1, .seed = uint64_t(trial)});
    EXPECT_EQ(top1.sample(logits), best);
  }
  // Ties go to the first index, as torch.argmax; NaN never wins.
  EXPECT_EQ(runtime::argmax(std::vector<float>{1, 3, 3, 2}), 1);
  EXPECT_EQ(runtime::argmax(std::vector<float>{NAN, 0, 1}), 2);
}

TEST(Gpt2Sampling, SeedReproducesExactly) {
  Random rng(12);
  std::vector<std::vector<float>> steps;
  for (int i = 0; i < 200; ++i) steps.push_back(random_logits(rng, 500));
  const runtime::SamplingParams params{.temperature = 0.9f, .top_k = 50, .top_p = 0.95f, .seed = 7};
  runtime::Sampler a(params), b(params),
      c({.temperature = 0.9f, .top_k = 50, .top_p = 0.95f, .seed = 8});
  int same_as_other_seed = 0;
  for (const auto& logits : steps) {
    const int32_t x = a.sample(logits);
    EXPECT_EQ(x, b.sample(logits));
    same_as_other_seed += x == c.sample(logits);
  }
  EXPECT_LT(same_as_other_seed, 150);  // a different seed gives a different run
}

TEST(Gpt2Sampling, TopKAndTopPKeepTheRightSet) {
  // Probabilities 0.4, 0.3, 0.2, 0.1 at ids 2, 0, 3, 1 (temperature 1).
  const std::vector<float> logits = {std::log(0.3f), std::log(0.1f), std::log(0.4f),
                                     std::log(0.2f)};
  const auto ids_of = [&](const runtime::SamplingParams& p) {
    std::vector<int32_t> ids;
    double sum = 0;
    for (const auto& [id, prob] : runtime::candidates(logits, p)) {
      ids.push_back(id);
      sum += prob;
    }
    EXPECT_NEAR(sum, 1.0, 1e-6);
    return ids;
  };
  using V = std::vector<int32_t>;
  EXPECT_EQ(ids_of({.temperature = 1}), (V{2, 0, 3, 1}));
  EXPECT_EQ(ids_of({.temperature = 1, .top_p = 0.35f}), (V{2}));
  EXPECT_EQ(ids_of({.temperature = 1, .top_p = 0.65f}), (V{2, 0}));
  EXPECT_EQ(ids_of({.temperature = 1, .top_p = 0.75f}), (V{2, 0, 3}));
  EXPECT_EQ(ids_of({.temperature = 1, .top_p = 0.95f}), (V{2, 0, 3, 1}));
  EXPECT_EQ(ids_of({.temperature = 1, .top_k = 2}), (V{2, 0}));
  // top-p applies within the top-k set: 0.4 / 0.7 < 0.6 <= 1.
  EXPECT_EQ(ids_of({.temperature = 1, .top_k = 2, .top_p = 0.6f}), (V{2, 0}));
  const auto kept = runtime::candidates(logits, {.temperature = 1, .top_p = 0.65f});
  EXPECT_NEAR(kept[0].second, 0.4 / 0.7, 1e-6);

  // Draws follow the kept distribution.
  runtime::Sampler sampler({.temperature = 1, .top_p = 0.75f, .seed = 3});
  std::vector<int> counts(4, 0);
  const int draws = 20000;
  for (int i = 0; i < draws; ++i) ++counts[size_t(sampler.sample(logits))];
  EXPECT_EQ(counts[1], 0);
  EXPECT_NEAR(counts[2] / double(draws), 0.4 / 0.9, 0.015);
  EXPECT_NEAR(counts[0] / double(draws), 0.3 / 0.9, 0.015);
  EXPECT_NEAR(counts[3] / double(draws), 0.2 / 0.9, 0.015);
}

// Every candidate's probability against a float64 softmax written here, at temperatures other
// than 1 and with top-k / top-p cuts (the set tests above run at temperature 1, where dividing
// and multiplying by it agree); and the draws at temperature 0.5 follow that distribution.
TEST(Gpt2Sampling, ProbabilitiesFollowTheTemperatureAndTheCuts) {
  Random rng(13);
  const std::vector<float> logits = random_logits(rng, 50);
  struct Case {
    float temperature;
    int64_t top_k;
    float top_p;
  };
  for (const Case c : {Case{0.5f, 0, 1.0f}, Case{2.0f, 0, 1.0f}, Case{0.7f, 5, 1.0f},
                       Case{1.3f, 0, 0.6f}, Case{0.8f, 10, 0.5f}}) {
    // float64: softmax(logits / T) over every id, most likely first, then the cuts
    std::vector<std::pair<double, int32_t>> p;
    double z = 0;
    for (size_t i = 0; i < logits.size(); ++i) z += std::exp(double(logits[i]) / c.temperature);
    for (size_t i = 0; i < logits.size(); ++i)
      p.push_back({std::exp(double(logits[i]) / c.temperature) / z, int32_t(i)});
    std::sort(p.begin(), p.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    if (c.top_k > 0) p.resize(size_t(c.top_k));
    double kept = 0, cut = 0;
    for (const auto& [prob, id] : p) kept += prob;
    size_t n = 0;
    while (n < p.size() && cut < c.top_p * kept) cut += p[n++].first;
    p.resize(n);
    const auto got = runtime::candidates(
        logits, {.temperature = c.temperature, .top_k = c.top_k, .top_p = c.top_p});
    ASSERT_EQ(got.size(), p.size()) << "T " << c.temperature << " k " << c.top_k;
    for (size_t i = 0; i < p.size(); ++i) {
      EXPECT_EQ(got[i].first, p[i].second) << i;
      EXPECT_NEAR(got[i].second, p[i].first / cut, 1e-6)
          << "T " << c.temperature << " id " << p[i].second;
    }
  }
  // draws at temperature 0.5 over four tokens: probabilities 0.4^2, 0.3^2, ... renormalised
  const std::vector<float> four = {std::log(0.3f), std::log(0.1f), std::log(0.4f), std::log(0.2f)};
  const double z = 0.09 + 0.01 + 0.16 + 0.04;
  runtime::Sampler sampler({.temperature = 0.5f, .seed = 5});
  std::vector<int> counts(4, 0);
  const int draws = 40000;
  for (int i = 0; i < draws; ++i) ++counts[size_t(sampler.sample(four))];
  EXPECT_NEAR(counts[2] / double(draws), 0.16 / z, 0.01);
  EXPECT_NEAR(counts[0] / double(draws), 0.09 / z, 0.01);
  EXPECT_NEAR(counts[3] / double(draws), 0.04 / z, 0.01);
  EXPECT_NEAR(counts[1] / double(draws), 0.01 / z, 0.005);
}

TEST(Gpt2Sampling, BadSettingsThrow) {
  EXPECT_THROW(runtime::Sampler({.temperature = -1}), Error);
  EXPECT_THROW(runtime::Sampler({.temperature = NAN}), Error);
  EXPECT_THROW(runtime::Sampler({.temperature = 1, .top_k = -2}), Error);
  EXPECT_THROW(runtime::Sampler({.temperature = 1, .top_p = 0}), Error);
  EXPECT_THROW(runtime::Sampler({.temperature = 1, .top_p = 1.5f}), Error);
  runtime::Sampler ok({.temperature = 1});
  EXPECT_THROW(ok.sample(std::vector<float>{1, NAN}), Error);
  EXPECT_THROW(runtime::argmax({}), Error);
}

}  // namespace
}  // namespace kda
