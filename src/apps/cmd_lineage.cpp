// kda lineage: the mission's story, measured on this machine. For each context length, every
// step of the lineage: prefill time, time per decoded token, memory held per sequence, and
// whether decode (the recurrent path) continues the chunked prefill exactly.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "apps/bench_util.h"
#include "apps/commands.h"
#include "core/error.h"
#include "core/parallel.h"
#include "core/random.h"
#include "core/timer.h"
#include "ops/attention/attention.h"
#include "ops/delta_rule/delta_rule.h"
#include "ops/linear_attn/linear_attn.h"

namespace kda::apps {
namespace {

constexpr int64_t kDecodeTokens = 16;  // decoded after the prefill, and checked against it
constexpr double kAgreeTolerance = 1e-5;

void print_usage() {
  std::puts(
      "usage: kda lineage [--contexts 1024,4096,16384,65536] [--heads 4] [--dim 128]\n"
      "                   [--cap-seconds 60] [--out DIR]\n"
      "\n"
      "For each context T, each step of the lineage (softmax recomputed without a cache as\n"
      "GPT-2 generates without one, softmax with a KV cache, linear attention, DeltaNet, Gated\n"
      "DeltaNet, KDA) prefills T tokens, then decodes 16 more one at a time. Columns: prefill\n"
      "time, time per decoded token, bytes of cache or state held per sequence and layer, and\n"
      "whether the 16 decoded outputs match the chunked/flash path on the same tokens (<= 1e-5).\n"
      "Softmax prefills predicted to take longer than --cap-seconds are skipped and marked.\n"
      "Writes DIR/lineage.md and DIR/lineage.csv (default out/lineage).");
}

struct Row {
  std::string mixer, prefill, per_token, memory, agree;
  int64_t T = 0;
};

std::string seconds_text(double s) {
  if (s >= 1.0) return fmt(s, 2) + " s";
  if (s >= 1e-3) return fmt(s * 1e3, 1) + " ms";
  return fmt(s * 1e6, 1) + " us";
}

std::string agree_text(double err) {
  return (err <= kAgreeTolerance ? "yes (" : "NO (") + fmt(err * 1e7, 1) + "e-7)";
}

double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = double(a[i]) - double(b[i]);
    if (!std::isfinite(d)) return INFINITY;
    num += d * d;
    den += double(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : INFINITY;
}

struct Tokens {
  int64_t T, H, D;
  std::vector<float> q, k, v, g_channel, g_scalar, beta;
  Tokens(int64_t T_, int64_t H_, int64_t D_, uint64_t seed) : T(T_), H(H_), D(D_) {
    Random rng(seed);
    auto unit_rows = [&](std::vector<float>& x) {
      x.resize(T * H * D);
      rng.fill_normal(x);
      for (int64_t r = 0; r < T * H; ++r) {
        float n2 = 0;
        for (int64_t c = 0; c < D; ++c) n2 += x[r * D + c] * x[r * D + c];
        for (int64_t c = 0; c < D; ++c) x[r * D + c] /= std::sqrt(n2);
      }
    };
    unit_rows(q);
    unit_rows(k);
    v.resize(T * H * D);
    rng.fill_normal(v);
    g_channel.resize(T * H * D);
    rng.fill_uniform(g_channel, -0.1f, -0.001f);
    g_scalar.resize(T * H);
    rng.fill_uniform(g_scalar, -0.1f, -0.001f);
    beta.resize(T * H);
    rng.fill_uniform(beta, 0.1f, 0.9f);
  }
};

// Softmax rows: flash prefill of T - 16 tokens into a KV cache, the last 16 as a chunked
// prefill continuing it (the reference for decode), and the same 16 decoded one at a time.
void softmax_rows(const Tokens& x, double cap_seconds, double& seconds_per_flop,
                  std::vector<Row>& out) {
  const int64_t T = x.T, H = x.H, D = x.D, P = T - kDecodeTokens;
  const ops::AttentionShape shape{1, T, H, H, D, D, 0};
  ops::KvCache cache(2, H, D, D);
  const double flops = ops::attention_forward_flops(shape);
  const double predicted = seconds_per_flop > 0 ? flops * seconds_per_flop : 0;
  Row recompute{"softmax, no cache (GPT-2 recompute)", "", "", "0 (recomputes)", "", T};
  Row cached{"softmax + KV cache", "", "", "", "", T};
  std::vector<float> o_ref(kDecodeTokens * H * D), o_dec(o_ref.size(), NAN);
  cache.reserve(0, T);
  cache.reserve(1, T);
  bool prefilled = predicted <= cap_seconds;
  if (prefilled) {
    std::vector<float> o_prefix(P * H * D);
    Stopwatch w;
    ops::attention_prefill({{1, P, H, H, D, D, 0}, x.q.data(), x.k.data(), x.v.data()}, cache,
                           o_prefix.data(), nullptr, std::vector<int64_t>{0});
    const double t_prefix = w.seconds();
    cache.append(1, cache.keys(0), cache.values(0), P);  // branch: slot 1 will decode
    w.reset();
    ops::attention_prefill({{1, kDecodeTokens, H, H, D, D, 0},
                            x.q.data() + P * H * D,
                            x.k.data() + P * H * D,
                            x.v.data() + P * H * D},
                           cache, o_ref.data(), nullptr, std::vector<int64_t>{0});
    const double t_prefill = t_prefix + w.seconds();
    seconds_per_flop = t_prefill / flops;
    recompute.prefill = cached.prefill = seconds_text(t_prefill);
    // without a cache, every new token re-runs the forward over the whole context
    recompute.per_token = seconds_text(t_prefill) + " (= prefill)";
  } else {
    // too slow to prefill here: fill the cache with the same keys and values directly
    cache.append(1, x.k.data(), x.v.data(), P);
    recompute.prefill = cached.prefill = "capped (~" + seconds_text(predicted) + ")";
    recompute.per_token = "capped (~" + seconds_text(predicted) + ")";
  }
  Stopwatch w;
  for (int64_t t = P; t < T; ++t) {
    ops::attention_decode_step({1, 1, H, H, D, D, 0}, cache, x.q.data() + t * H * D,
                               x.k.data() + t * H * D, x.v.data() + t * H * D,
                               o_dec.data() + (t - P) * H * D, std::vector<int64_t>{1});
  }
  cached.per_token = seconds_text(w.seconds() / kDecodeTokens);
  cached.memory = human_bytes(double(T) * cache.bytes_per_token());
  recompute.agree = cached.agree =
      prefilled ? agree_text(rel_error(o_dec, o_ref)) : "not checked (capped)";
  out.push_back(recompute);
  out.push_back(cached);
}

Row linear_row(const Tokens& x) {
  const int64_t T = x.T, H = x.H, D = x.D, P = T - kDecodeTokens;
  ops::LinearAttnShape shape{1, P, H, D, D, 0, false};
  std::vector<float> o_prefix(P * H * D), state(H * D * D), o_ref(kDecodeTokens * H * D),
      o_dec(o_ref.size(), NAN), state_end(state.size());
  Stopwatch w;
  ops::linear_attn_chunk_forward({shape, x.q.data(), x.k.data(), x.v.data()},
                                 {o_prefix.data(), state.data()});
  shape.T = kDecodeTokens;
  ops::linear_attn_chunk_forward(
      {shape, x.q.data() + P * H * D, x.k.data() + P * H * D, x.v.data() + P * H * D, state.data()},
      {o_ref.data(), state_end.data()});
  const double t_prefill = w.seconds();
  w.reset();
  for (int64_t t = P; t < T; ++t) {
    ops::linear_attn_decode_step({1, 1, H, D, D, 0, false}, x.q.data() + t * H * D,
                                 x.k.data() + t * H * D, x.v.data() + t * H * D, state.data(),
                                 nullptr, o_dec.data() + (t - P) * H * D);
  }
  const double t_token = w.seconds() / kDecodeTokens;
  return {"linear attention",
          seconds_text(t_prefill),
          seconds_text(t_token),
          human_bytes(double(state.size() * sizeof(float))),
          agree_text(rel_error(o_dec, o_ref)),
          T};
}

Row delta_row(const Tokens& x, ops::Gate gate, const char* name) {
  const int64_t T = x.T, H = x.H, D = x.D, P = T - kDecodeTokens;
  const int64_t gw = gate == ops::Gate::channel ? D : gate == ops::Gate::scalar ? 1 : 0;
  const float* g = gate == ops::Gate::channel  ? x.g_channel.data()
                   : gate == ops::Gate::scalar ? x.g_scalar.data()
                                               : nullptr;
  ops::DeltaRuleShape shape{1, P, H, H, D, D, gate, 0};
  std::vector<float> o_prefix(P * H * D), state(H * D * D), o_ref(kDecodeTokens * H * D),
      o_dec(o_ref.size(), NAN), state_end(state.size());
  Stopwatch w;
  ops::delta_rule_chunk_forward({shape, x.q.data(), x.k.data(), x.v.data(), g, x.beta.data()},
                                o_prefix.data(), state.data());
  shape.T = kDecodeTokens;
  const int64_t off = P * H;
  ops::delta_rule_chunk_forward(
      {shape, x.q.data() + off * D, x.k.data() + off * D, x.v.data() + off * D,
       g ? g + off * gw : nullptr, x.beta.data() + off, state.data()},
      o_ref.data(), state_end.data());
  const double t_prefill = w.seconds();
  w.reset();
  for (int64_t t = P; t < T; ++t) {
    ops::delta_rule_decode_step({1, 1, H, H, D, D, gate, 0}, x.q.data() + t * H * D,
                                x.k.data() + t * H * D, x.v.data() + t * H * D,
                                g ? g + t * H * gw : nullptr, x.beta.data() + t * H, state.data(),
                                o_dec.data() + (t - P) * H * D);
  }
  const double t_token = w.seconds() / kDecodeTokens;
  return {name,
          seconds_text(t_prefill),
          seconds_text(t_token),
          human_bytes(double(state.size() * sizeof(float))),
          agree_text(rel_error(o_dec, o_ref)),
          T};
}

}  // namespace

int cmd_lineage(const Args& args) {
  std::vector<int64_t> contexts = {1024, 4096, 16384, 65536};
  int64_t heads = 4, dim = 128;
  double cap_seconds = 60;
  std::string out_dir = "out/lineage";
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      print_usage();
      return 0;
    }
    const std::string value = flag_value(args, i);
    if (a == "--contexts")
      contexts = parse_int_list(value, a);
    else if (a == "--heads")
      heads = parse_int(value, a);
    else if (a == "--dim")
      dim = parse_int(value, a);
    else if (a == "--cap-seconds")
      cap_seconds = double(parse_int(value, a));
    else if (a == "--out")
      out_dir = value;
    else
      throw Error("lineage: unknown option '" + a + "' (see kda lineage --help)");
  }
  require(heads >= 1 && dim >= 1, "lineage: --heads and --dim must be >= 1");
  std::sort(contexts.begin(), contexts.end());
  require(contexts.front() > kDecodeTokens, "lineage: contexts must exceed 16 tokens");

  std::printf("kda lineage: H = %lld heads of %lld, fp32, %d threads, %s\n", (long long)heads,
              (long long)dim, hardware_threads(), machine_description().c_str());
  std::printf("each context: prefill T tokens, then decode 16 tokens one at a time\n\n");
  Stopwatch total;
  std::vector<Row> rows_out;
  double softmax_seconds_per_flop = 0;
  for (int64_t T : contexts) {
    const Tokens x(T, heads, dim, 1000 + uint64_t(T));
    softmax_rows(x, cap_seconds, softmax_seconds_per_flop, rows_out);
    rows_out.push_back(linear_row(x));
    rows_out.push_back(delta_row(x, ops::Gate::none, "DeltaNet"));
    rows_out.push_back(delta_row(x, ops::Gate::scalar, "Gated DeltaNet"));
    rows_out.push_back(delta_row(x, ops::Gate::channel, "KDA"));
    std::fprintf(stderr, "  T = %lld done (%.1f s)\n", (long long)T, total.seconds());
  }
  Table table({"mixer", "context", "prefill", "per decoded token", "cache/state per sequence",
               "decode = prefill?"});
  for (const Row& r : rows_out)
    table.add({r.mixer, std::to_string(r.T), r.prefill, r.per_token, r.memory, r.agree});
  table.print();
  std::printf(
      "\nMemory is per sequence and layer, fp32: the KV cache grows with the context\n"
      "(T x H x 2D floats); every linear mixer holds a fixed H x K x V state. 'decode = prefill?'\n"
      "compares the 16 decoded outputs with the flash/chunked path on the same tokens.\n"
      "Softmax prefills predicted (from the previous context, T^2) to exceed %.0f s are capped;\n"
      "their decode still runs over a cache of the full length. Total %.1f s.\n",
      cap_seconds, total.seconds());
  const std::string preface =
      "kda lineage on " + machine_description() + ", " + std::to_string(hardware_threads()) +
      " threads, H = " + std::to_string(heads) + ", head size " + std::to_string(dim) + "\n\n";
  table.write(out_dir, "lineage", preface);
  std::printf("wrote %s/lineage.md and %s/lineage.csv\n", out_dir.c_str(), out_dir.c_str());
  return 0;
}

}  // namespace kda::apps
