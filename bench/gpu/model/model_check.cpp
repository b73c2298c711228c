// Whole models on the GPU. Suite "model": each fixture folder of ../shared/fixtures/models
// (kimi_linear_tiny, gpt2_tiny) through the CUDA path, fp32 and bf16, against its
// reference.safetensors: logits of one forward pass, the next-token loss, the same tokens as a
// prefill followed by single-token decode steps, and the greedy continuation through the decode
// path. Suite "model_bench": prefill and decode tokens/s of a Kimi-Linear-shaped model
// (configs/kimi-linear-gpu-bench.json: hidden 2304, 32 KDA heads of 128, MLA 32 heads with
// kv_lora_rank 512, MoE 64 experts top-8; 4 layers) as the 3:1 hybrid and with every layer MLA,
// at 4K, 32K and 128K tokens of context.
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/gpu/model/gpu_suite.h"
#include "core/error.h"
#include "core/safetensors.h"
#include "model/causal_lm.h"
#include "model/cuda/cuda_models.h"
#include "runtime/next_token_loss.h"
#include "runtime/sampling.h"

namespace kda::gpu_check {
namespace {

namespace fs = std::filesystem;

std::vector<int32_t> ids_of(const SafetensorsFile& f, const std::string& name) {
  const Tensor t = f.load(name, DType::i64);
  std::vector<int32_t> ids;
  for (int64_t i = 0; i < t.numel(); ++i) ids.push_back(int32_t(t.data<int64_t>()[i]));
  return ids;
}

void check_folder(const std::string& dir, ElementType type, Tally& tally) {
  const bool exact = type == ElementType::f32;
  const std::string tag = fs::path(dir).filename().string() + (exact ? " fp32" : " bf16");
  // fp32 is held to the fixtures' own bounds; bf16 weights round every product (~3 decimal
  // digits), so its logits are held to a bf16-level bound.
  const double logits_tol = exact ? 1e-4 : 1e-2, loss_tol = exact ? 1e-5 : 1e-3;
  const auto lm = model::cuda::load_causal_lm_cuda(dir, type);
  const SafetensorsFile ref =
      SafetensorsFile::open((fs::path(dir) / "reference.safetensors").string());
  const std::vector<int32_t> ids = ids_of(ref, "input_ids");
  const int64_t N = int64_t(ids.size());
  const std::vector<double> want = widen(ref.load("logits", DType::f32));

  const Tensor logits = lm->forward(ids);
  report(tally, tag + " forward logits", rel_error(widen(logits), want), logits_tol);
  const double loss = runtime::mean_next_token_loss(logits, ids);
  const double want_loss = ref.load("loss", DType::f32).f32()[0];
  report(tally, tag + " forward loss", std::abs(loss - want_loss) / std::abs(want_loss), loss_tol);

  // Half the tokens as one prefill, then one token at a time through the caches.
  {
    auto session = lm->start_session(N);
    const int64_t prefill = (N + 1) / 2;
    std::vector<double> ours =
        widen(session->feed(std::span<const int32_t>(ids).first(size_t(prefill))));
    for (int64_t t = prefill; t < N; ++t) {
      const std::vector<double> step =
          widen(session->feed(std::span<const int32_t>(ids).subspan(size_t(t), 1)));
      ours.insert(ours.end(), step.begin(), step.end());
    }
    report(tally, tag + " prefill+decode logits", rel_error(ours, want), logits_tol);
  }

  // A snapshot after the prefill (Session::clone): the copy decodes the rest
  // as the reference does (both fixture models: GPT-2's key / value rows, Kimi's states and
  // latent rows).
  {
    auto session = lm->start_session(N);
    const int64_t prefill = (N + 1) / 2;
    session->feed(std::span<const int32_t>(ids).first(size_t(prefill)));
    const std::unique_ptr<model::Session> copy = session->clone();
    if (!copy) {
      std::printf("CHECK %-60s FAIL (clone returned nothing)\n", (tag + " clone").c_str());
      tally.failed++;
    } else {
      std::vector<double> ours;
      for (int64_t t = prefill; t < N; ++t) {
        const std::vector<double> step =
            widen(copy->feed(std::span<const int32_t>(ids).subspan(size_t(t), 1)));
        ours.insert(ours.end(), step.begin(), step.end());
      }
      const int64_t V = lm->vocab_size();
      const std::vector<double> tail(want.begin() + prefill * V, want.end());
      report(tally, tag + " clone after prefill, decode logits", rel_error(ours, tail), logits_tol);
    }
  }

  // Greedy continuation through the decode path; fp32 must match token for token.
  const std::vector<int32_t> prompt = ids_of(ref, "greedy_prompt");
  const std::vector<int32_t> greedy = ids_of(ref, "greedy_out");
  auto session = lm->start_session(int64_t(greedy.size()));
  std::vector<int32_t> out = prompt;
  Tensor last = session->feed_last(prompt);
  while (out.size() < greedy.size()) {
    const int32_t next = runtime::argmax(last.span_f32());
    out.push_back(next);
    if (out.size() < greedy.size()) last = session->feed_last(std::span<const int32_t>(&next, 1));
  }
  int64_t mismatches = 0;
  for (size_t i = 0; i < greedy.size(); ++i) mismatches += out[i] != greedy[i];
  const std::string name = tag + " greedy mismatches (of " + std::to_string(greedy.size()) + ")";
  if (exact) {
    report(tally, name, double(mismatches), 0.0);
  } else {  // near-ties of a random tiny model may flip under bf16: reported, not held
    std::printf("INFO  %-60s %lld\n", name.c_str(), (long long)mismatches);
  }
}

// A model folder on the GPU against the CPU model on the same weights: `tokens` random ids
// through one forward pass, and the same ids as a prefill of all but the last 24 followed by
// single-token steps. Covers what the tiny fixture does not reach: KDA heads of 64 (the bf16
// chunked kernel when the gate is bounded), MLA's expanded prefill (>= 64 tokens), the MoE
// prefill path, and a trained model's activations.
void check_against_cpu(const std::string& dir, const std::string& tag, int64_t tokens,
                       Tally& tally) {
  const auto cpu = model::load_causal_lm(dir);
  std::vector<int32_t> ids(static_cast<size_t>(tokens));
  Random rng(uint64_t(tokens) * 7 + tag.size());
  for (int32_t& id : ids) id = int32_t(rng.integer(0, cpu->vocab_size() - 1));
  const std::vector<double> want = widen(cpu->forward(ids));
  for (const ElementType type : {ElementType::f32, ElementType::bf16}) {
    const bool exact = type == ElementType::f32;
    const std::string name = tag + (exact ? " fp32" : " bf16");
    const double tol = exact ? 1e-4 : 2e-2;
    const auto gpu = model::cuda::load_causal_lm_cuda(dir, type);
    report(tally, name + " forward logits vs CPU", rel_error(widen(gpu->forward(ids)), want), tol);
    auto session = gpu->start_session(tokens);
    const int64_t prefill = tokens - 24;
    std::vector<double> ours =
        widen(session->feed(std::span<const int32_t>(ids).first(size_t(prefill))));
    for (int64_t t = prefill; t < tokens; ++t) {
      const std::vector<double> step =
          widen(session->feed(std::span<const int32_t>(ids).subspan(size_t(t), 1)));
      ours.insert(ours.end(), step.begin(), step.end());
    }
    report(tally, name + " prefill+decode logits vs CPU", rel_error(ours, want), tol);

    // A snapshot after the prefill (Session::clone, what kda serve's prefix cache keeps): the
    // copy decodes the rest as the CPU does, and the original, fed after it, the same.
    auto base = gpu->start_session(tokens);
    base->feed(std::span<const int32_t>(ids).first(size_t(prefill)));
    // decode_batch with its steps side by side on the sessions' streams:
    // two sequences 9 tokens apart, 8 steps (eager, captured, then graph launches), each row
    // against the CPU's logits at its position.
    {
      auto s0 = gpu->start_session(tokens), s1 = gpu->start_session(tokens);
      const int64_t p0 = prefill, p1 = prefill - 9, V = cpu->vocab_size();
      s0->feed(std::span<const int32_t>(ids).first(size_t(p0)));
      s1->feed(std::span<const int32_t>(ids).first(size_t(p1)));
      std::vector<double> got, expect;
      for (int64_t t = 0; t < 8; ++t) {
        model::Session* both[2] = {s0.get(), s1.get()};
        const int32_t step_ids[2] = {ids[size_t(p0 + t)], ids[size_t(p1 + t)]};
        const std::vector<double> rows = widen(gpu->decode_batch(both, step_ids));
        got.insert(got.end(), rows.begin(), rows.end());
        for (const int64_t pos : {p0 + t, p1 + t})
          expect.insert(expect.end(), want.begin() + pos * V, want.begin() + (pos + 1) * V);
      }
      report(tally, name + " decode_batch of 2 (side by side) vs CPU", rel_error(got, expect), tol);
    }

    const std::unique_ptr<model::Session> copy = base->clone();
    if (!copy) {
      std::printf("CHECK %-60s FAIL (clone returned nothing)\n", (name + " clone").c_str());
      tally.failed++;
      continue;
    }
    std::vector<double> from_copy, from_base;
    for (int64_t t = prefill; t < tokens; ++t) {
      const std::span<const int32_t> one = std::span<const int32_t>(ids).subspan(size_t(t), 1);
      const std::vector<double> a = widen(copy->feed(one));
      from_copy.insert(from_copy.end(), a.begin(), a.end());
    }
    for (int64_t t = prefill; t < tokens; ++t) {
      const std::span<const int32_t> one = std::span<const int32_t>(ids).subspan(size_t(t), 1);
      const std::vector<double> b = widen(base->feed(one));
      from_base.insert(from_base.end(), b.begin(), b.end());
    }
    const std::vector<double> want_tail(want.begin() + prefill * cpu->vocab_size(), want.end());
    report(tally, name + " clone after prefill, decode vs CPU", rel_error(from_copy, want_tail),
           tol);
    report(tally, name + " original after its clone, decode vs CPU",
           rel_error(from_base, want_tail), tol);
  }
}

void run_model_checks(const SuiteOptions& options, Tally& tally) {
  if (!options.check) return;
  // The embedded default (softplus gate), and a copy whose config bounds the gate (fla's safe
  // gate, lower bound -5: the bf16 prefill then runs the chunked tensor-core kernel).
  const fs::path mini = "models/kimi-mini";
  if (fs::exists(mini / "config.json")) {
    check_against_cpu(mini.string(), "kimi-mini", 300, tally);
    const fs::path bounded = fs::temp_directory_path() / "kda_gpu_kimi_mini_bounded";
    fs::remove_all(bounded);
    fs::create_directories(bounded);
    fs::copy_file(mini / "model.safetensors", bounded / "model.safetensors");
    nlohmann::json config = nlohmann::json::parse(std::ifstream(mini / "config.json"));
    config["forget_gate_lower_bound"] = -5.0;
    std::ofstream(bounded / "config.json") << config.dump(2);
    check_against_cpu(bounded.string(), "kimi-mini bounded gate", 300, tally);
    fs::remove_all(bounded);
  } else {
    std::printf("CHECK %-60s FAIL (run from the repository root)\n", "kimi-mini vs CPU");
    tally.failed++;
  }
  const fs::path models = fs::path(options.shared_dir) / "models";
  for (const char* name : {"kimi_linear_tiny", "gpt2_tiny"}) {
    const fs::path dir = models / name;
    if (!fs::exists(dir / "reference.safetensors")) {
      std::printf("CHECK %-60s FAIL (missing %s)\n", name, dir.string().c_str());
      tally.failed++;
      continue;
    }
    for (const ElementType type : {ElementType::f32, ElementType::bf16}) {
      try {
        check_folder(dir.string(), type, tally);
      } catch (const std::exception& e) {
        std::printf("CHECK %-60s FAIL (exception: %s)\n", name, e.what());
        tally.failed++;
      }
    }
  }
}

nlohmann::json bench_config(bool all_mla) {
  std::ifstream in("configs/kimi-linear-gpu-bench.json");
  require(bool(in),
          "model_bench: run from the repository root (configs/kimi-linear-gpu-bench.json)");
  nlohmann::json c = nlohmann::json::parse(in);
  if (all_mla) {
    const int64_t layers = c["num_hidden_layers"];
    nlohmann::json full = nlohmann::json::array();
    for (int64_t i = 1; i <= layers; ++i) full.push_back(i);
    c["linear_attn_config"]["kda_layers"] = nlohmann::json::array();
    c["linear_attn_config"]["full_attn_layers"] = full;
  }
  return c;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void run_model_bench(const SuiteOptions& options, Tally& tally) {
  if (!options.bench) return;
  constexpr int kDecodeSteps = 32;
  for (const bool all_mla : {false, true}) {
    const char* kind = all_mla ? "all-MLA" : "hybrid-3:1";
    const auto lm =
        model::cuda::synthetic_kimi_linear_cuda(bench_config(all_mla), ElementType::bf16, 7);
    std::printf("BENCH model %s weights %.2f GB\n", kind, double(lm->weight_bytes()) / 1e9);
    {  // first launches (module loading, cuBLAS heuristics) out of the timings
      std::vector<int32_t> warm(4096, 1);
      auto session = lm->start_session(4096 + 2);
      Tensor last = session->feed_last(warm);
      const int32_t next = runtime::argmax(last.span_f32());
      session->feed_last(std::span<const int32_t>(&next, 1));
    }
    for (const int64_t context : {4096, 32768, 131072}) {
      std::vector<int32_t> prompt(static_cast<size_t>(context));
      for (int64_t i = 0; i < context; ++i) prompt[i] = int32_t((i * 7919) % lm->vocab_size());
      auto session = lm->start_session(context + kDecodeSteps + 1);
      auto t0 = std::chrono::steady_clock::now();
      Tensor last = session->feed_last(prompt);
      const double prefill_s = seconds_since(t0);
      int32_t next = runtime::argmax(last.span_f32());
      last = session->feed_last(std::span<const int32_t>(&next, 1));  // warm the decode path
      t0 = std::chrono::steady_clock::now();
      for (int step = 0; step < kDecodeSteps; ++step) {
        next = runtime::argmax(last.span_f32());
        last = session->feed_last(std::span<const int32_t>(&next, 1));
      }
      const double decode_s = seconds_since(t0) / kDecodeSteps;
      bool finite = true;
      for (const float v : last.span_f32()) finite = finite && std::isfinite(v);
      if (!finite)
        std::printf("BENCH model %s context %lld: NON-FINITE logits\n", kind, (long long)context);
      // The same decode without the step graph (launch by launch), where the prefill is cheap.
      double eager_s = 0;
      if (context <= 32768) {
        setenv("KDA_CUDA_GRAPH", "0", 1);
        auto eager = lm->start_session(context + kDecodeSteps + 1);
        unsetenv("KDA_CUDA_GRAPH");
        Tensor e = eager->feed_last(prompt);
        int32_t tok = runtime::argmax(e.span_f32());
        e = eager->feed_last(std::span<const int32_t>(&tok, 1));
        const auto e0 = std::chrono::steady_clock::now();
        for (int step = 0; step < kDecodeSteps; ++step) {
          tok = runtime::argmax(e.span_f32());
          e = eager->feed_last(std::span<const int32_t>(&tok, 1));
        }
        eager_s = seconds_since(e0) / kDecodeSteps;
      }
      const model::MemoryReport m = session->memory();
      std::printf(
          "BENCH model %-10s context %6lld prefill %8.0f tok/s (%.3f s)  decode %7.1f tok/s "
          "(%.3f ms/token; launch by launch %.3f ms)  state %.1f MB cache %.1f MB\n",
          kind, (long long)context, double(context) / prefill_s, prefill_s, 1.0 / decode_s,
          decode_s * 1e3, eager_s * 1e3, double(m.state_bytes) / 1e6, double(m.cache_bytes) / 1e6);
      std::fflush(stdout);
    }
  }
}

const bool registered =
    register_suite("model", run_model_checks) && register_suite("model_bench", run_model_bench);

}  // namespace
}  // namespace kda::gpu_check
