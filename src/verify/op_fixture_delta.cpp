// Fixture checks for the delta-rule family: kda (layer-level or plain), gated_delta_rule and
// delta_rule (head-major in its fixture).
#include <algorithm>
#include <cmath>
#include <functional>
#include <string>

#include "core/error.h"
#include "ops/common/sequences.h"
#include "ops/delta_rule/delta_rule.h"
#include "ops/kda/kda.h"
#include "verify/op_fixture.h"

namespace kda::verify {
namespace {

using ops::DeltaRuleShape;
using ops::Gate;

std::vector<double> widen(const std::vector<float>& x) {
  return {x.begin(), x.end()};
}

// [B, H, T, D] <-> [B, T, H, D]
std::vector<float> swap_head_and_time(const std::vector<float>& x, int64_t B, int64_t A, int64_t C,
                                      int64_t D) {
  std::vector<float> y(x.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t a = 0; a < A; ++a)
      for (int64_t c = 0; c < C; ++c)
        for (int64_t d = 0; d < D; ++d)
          y[((b * C + c) * A + a) * D + d] = x[((b * A + a) * C + c) * D + d];
  return y;
}

struct Problem {
  DeltaRuleShape shape;
  std::vector<int64_t> cu_seqlens;
  int64_t num_sequences = 0;
  bool head_major = false;                      // delta fixtures store [B, H, T, D]
  std::map<std::string, std::vector<float>> t;  // token-major tensors by fixture name

  const float* get(const std::string& name) const {
    const auto it = t.find(name);
    return it == t.end() ? nullptr : it->second.data();
  }
  size_t o_size() const { return size_t(shape.B * shape.T * shape.HV * shape.V); }
  size_t state_size() const { return size_t(num_sequences * shape.HV * shape.K * shape.V); }
  // Back to the fixture's layout for comparison.
  std::vector<float> stored(const std::vector<float>& x, int64_t heads, int64_t width) const {
    return head_major ? swap_head_and_time(x, shape.B, shape.T, heads, width) : x;
  }
};

Problem load_problem(const Fixture& fx, Gate gate) {
  Problem p;
  p.shape.gate = gate;
  // Sizes come from the tensors; metadata, where present, must agree.
  const std::vector<int64_t> q_shape = fx.shape("q"), v_shape = fx.shape("v");
  require(q_shape.size() == 4 && v_shape.size() == 4,
          fx.path() + ": q and v must have 4 dimensions");
  p.head_major = fx.has_meta("layout") && fx.meta_string("layout").find("[B,H,T") == 0;
  p.shape.B = q_shape[0];
  p.shape.T = p.head_major ? q_shape[2] : q_shape[1];
  p.shape.H = p.head_major ? q_shape[1] : q_shape[2];
  p.shape.K = q_shape[3];
  p.shape.HV = p.head_major ? v_shape[1] : v_shape[2];
  p.shape.V = v_shape[3];
  p.shape.scale = fx.meta_double("scale", 0.0);
  for (const auto& [key, value] : {std::pair<const char*, int64_t>{"B", p.shape.B},
                                   {"T", p.shape.T},
                                   {"H", p.shape.H},
                                   {"HV", p.shape.HV},
                                   {"K", p.shape.K},
                                   {"V", p.shape.V}}) {
    if (fx.has_meta(key)) {
      require(fx.meta_int(key) == value,
              fx.path() + ": metadata " + key + " = " + std::to_string(fx.meta_int(key)) +
                  " disagrees with the tensors (" + std::to_string(value) + ")");
    }
  }
  p.shape.validate();
  if (fx.has("cu_seqlens")) {
    p.cu_seqlens = fx.i64("cu_seqlens");
    require(p.shape.B == 1, fx.path() + ": cu_seqlens needs B = 1");
  }
  p.num_sequences = p.cu_seqlens.empty() ? p.shape.B : int64_t(p.cu_seqlens.size()) - 1;
  const int64_t B = p.shape.B, T = p.shape.T, H = p.shape.H, HV = p.shape.HV, K = p.shape.K,
                V = p.shape.V;
  const int64_t gw = p.shape.gate_width();
  auto expect_shape = [&](const std::string& name, std::vector<int64_t> want) {
    if (!fx.has(name)) return;
    require(fx.shape(name) == want, fx.path() + ": tensor '" + name + "' has shape " +
                                        shape_string(fx.shape(name)) + ", expected " +
                                        shape_string(want));
  };
  auto token_major = [&](const std::string& name, int64_t heads, int64_t width) {
    if (!fx.has(name)) return;
    std::vector<float> x = fx.f32(name);
    if (p.head_major) {
      expect_shape(name, width ? std::vector<int64_t>{B, heads, T, width}
                               : std::vector<int64_t>{B, heads, T});
      x = swap_head_and_time(x, B, heads, T, std::max<int64_t>(width, 1));
    } else {
      expect_shape(name, width ? std::vector<int64_t>{B, T, heads, width}
                               : std::vector<int64_t>{B, T, heads});
    }
    p.t[name] = std::move(x);
  };
  for (const char* name : {"q", "k", "q_l2", "k_l2", "dq", "dk"}) token_major(name, H, K);
  for (const char* name : {"v", "o", "do_out", "dv"}) token_major(name, HV, V);
  for (const char* name : {"beta", "braw", "dbeta", "dbraw"}) token_major(name, HV, 0);
  if (gw == 1) {
    for (const char* name : {"g", "dg"}) token_major(name, HV, 0);
  } else if (gw > 1) {
    for (const char* name : {"g", "graw", "dg", "dgraw"}) token_major(name, HV, K);
  }
  for (const char* name : {"h0", "ht", "dht_out", "dh0"}) {
    expect_shape(name, {p.num_sequences, HV, K, V});
    if (fx.has(name)) p.t[name] = fx.f32(name);
  }
  for (const char* name : {"A_log", "dA_log"}) {
    expect_shape(name, {HV});
    if (fx.has(name)) p.t[name] = fx.f32(name);
  }
  for (const char* name : {"dt_bias", "ddt_bias"}) {
    expect_shape(name, {HV * K});
    if (fx.has(name)) p.t[name] = fx.f32(name);
  }
  require(p.get("q") && p.get("k") && p.get("v") && p.get("o"),
          fx.path() + ": needs q, k, v and o");
  return p;
}

// Runs `step(n, tok, state)` for every token of every sequence in order.
void for_each_token(const Problem& p, const std::function<void(int64_t, int64_t)>& step) {
  const ops::SequenceLayout seqs(p.shape.B, p.shape.T, p.cu_seqlens);
  for (int64_t n = 0; n < seqs.num_sequences(); ++n)
    for (int64_t t = 0; t < seqs.length(n); ++t) step(n, seqs.start(n) + t);
}

void add_outputs(FixtureReport& r, const Fixture& fx, const Problem& p, const std::string& path,
                 const std::vector<float>& o, const std::vector<float>& ht) {
  add_row(r, fx, path, "o", p.stored(o, p.shape.HV, p.shape.V), kOutputTolerance);
  if (fx.has("ht")) add_row(r, fx, path, "ht", ht, kOutputTolerance);
}

void check_plain(const Fixture& fx, const Problem& p, FixtureReport& r) {
  const DeltaRuleShape& s = p.shape;
  const int64_t gw = s.gate_width(), HV = s.HV, H = s.H, K = s.K, V = s.V;
  require(p.get("beta") && (gw == 0 || p.get("g")), fx.path() + ": needs beta (and g)");
  const ops::DeltaRuleInputs<float> in{s,          p.get("q"),    p.get("k"),  p.get("v"),
                                       p.get("g"), p.get("beta"), p.get("h0"), p.cu_seqlens};
  {  // float64 reference
    std::map<std::string, std::vector<double>> d;
    for (const auto& [name, x] : p.t) d[name] = widen(x);
    auto ptr = [&](const char* n) { return d.count(n) ? d[n].data() : nullptr; };
    std::vector<double> o(p.o_size()), ht(p.state_size());
    ops::delta_rule_reference(
        {s, ptr("q"), ptr("k"), ptr("v"), ptr("g"), ptr("beta"), ptr("h0"), p.cu_seqlens}, o.data(),
        ht.data());
    std::vector<float> of(o.begin(), o.end()), hf(ht.begin(), ht.end());
    add_outputs(r, fx, p, "reference", of, hf);
  }
  std::vector<float> o(p.o_size(), NAN), ht(p.state_size(), NAN);
  ops::delta_rule_chunk_forward(in, o.data(), ht.data());
  add_outputs(r, fx, p, "chunked", o, ht);
  std::fill(o.begin(), o.end(), NAN);
  std::fill(ht.begin(), ht.end(), NAN);
  ops::delta_rule_recurrent_forward(in, o.data(), ht.data());
  add_outputs(r, fx, p, "recurrent", o, ht);
  // decode: one token at a time through the in-place state
  std::vector<float> state(p.state_size(), 0.0f);
  if (p.get("h0")) std::copy_n(p.get("h0"), state.size(), state.data());
  std::fill(o.begin(), o.end(), NAN);
  DeltaRuleShape one = s;
  one.B = 1;
  for_each_token(p, [&](int64_t n, int64_t tok) {
    ops::delta_rule_decode_step(one, p.get("q") + tok * H * K, p.get("k") + tok * H * K,
                                p.get("v") + tok * HV * V,
                                gw ? p.get("g") + tok * HV * gw : nullptr, p.get("beta") + tok * HV,
                                state.data() + n * HV * K * V, o.data() + tok * HV * V);
  });
  add_outputs(r, fx, p, "decode", o, state);

  if (!p.get("do_out")) return;
  std::vector<float> dq(p.t.at("q").size(), NAN), dk(dq.size(), NAN), dv(p.o_size(), NAN),
      dg(p.t.count("g") ? p.t.at("g").size() : 0, NAN), db(p.t.at("beta").size(), NAN),
      dh0(p.state_size(), NAN);
  ops::delta_rule_chunk_backward(in, p.get("do_out"), p.get("dht_out"),
                                 {dq.data(), dk.data(), dv.data(), dg.empty() ? nullptr : dg.data(),
                                  db.data(), p.get("h0") ? dh0.data() : nullptr});
  const double tol = kGradientTolerance;
  if (fx.has("dq")) add_row(r, fx, "chunked", "dq", p.stored(dq, H, K), tol);
  if (fx.has("dk")) add_row(r, fx, "chunked", "dk", p.stored(dk, H, K), tol);
  if (fx.has("dv")) add_row(r, fx, "chunked", "dv", p.stored(dv, HV, V), tol);
  if (fx.has("dbeta")) add_row(r, fx, "chunked", "dbeta", p.stored(db, HV, 1), tol);
  if (fx.has("dg") && gw) add_row(r, fx, "chunked", "dg", p.stored(dg, HV, gw), tol);
  if (fx.has("dh0")) add_row(r, fx, "chunked", "dh0", dh0, tol);
}

void check_kda_layer(const Fixture& fx, const Problem& p, FixtureReport& r) {
  const DeltaRuleShape& s = p.shape;
  const int64_t HV = s.HV, H = s.H, K = s.K, V = s.V;
  require(p.get("braw") && p.get("A_log") && p.get("dt_bias"),
          fx.path() + ": a layer-level kda fixture needs graw, braw, A_log and dt_bias");
  const ops::KdaOptions options;  // the fixtures' semantics: L2 norm, softplus gate, sigmoid beta
  const ops::KdaInputs<float> in{s,
                                 options,
                                 p.get("q"),
                                 p.get("k"),
                                 p.get("v"),
                                 p.get("graw"),
                                 p.get("braw"),
                                 p.get("A_log"),
                                 p.get("dt_bias"),
                                 p.get("h0"),
                                 p.cu_seqlens};
  {
    std::map<std::string, std::vector<double>> d;
    for (const auto& [name, x] : p.t) d[name] = widen(x);
    auto ptr = [&](const char* n) { return d.count(n) ? d[n].data() : nullptr; };
    std::vector<double> o(p.o_size()), ht(p.state_size());
    ops::kda_reference({s, options, ptr("q"), ptr("k"), ptr("v"), ptr("graw"), ptr("braw"),
                        ptr("A_log"), ptr("dt_bias"), ptr("h0"), p.cu_seqlens},
                       o.data(), ht.data());
    add_outputs(r, fx, p, "reference", {o.begin(), o.end()}, {ht.begin(), ht.end()});
  }
  std::vector<float> o(p.o_size(), NAN), ht(p.state_size(), NAN);
  ops::kda_chunk_forward(in, o.data(), ht.data());
  add_outputs(r, fx, p, "chunked", o, ht);
  std::fill(o.begin(), o.end(), NAN);
  std::fill(ht.begin(), ht.end(), NAN);
  ops::kda_recurrent_forward(in, o.data(), ht.data());
  add_outputs(r, fx, p, "recurrent", o, ht);
  std::vector<float> state(p.state_size(), 0.0f);
  if (p.get("h0")) std::copy_n(p.get("h0"), state.size(), state.data());
  std::fill(o.begin(), o.end(), NAN);
  DeltaRuleShape one = s;
  one.B = 1;
  for_each_token(p, [&](int64_t n, int64_t tok) {
    ops::kda_decode_step(one, options, p.get("q") + tok * H * K, p.get("k") + tok * H * K,
                         p.get("v") + tok * HV * V, p.get("graw") + tok * HV * K,
                         p.get("braw") + tok * HV, p.get("A_log"), p.get("dt_bias"),
                         state.data() + n * HV * K * V, o.data() + tok * HV * V);
  });
  add_outputs(r, fx, p, "decode", o, state);
  if (p.get("q_l2") && p.get("k_l2") && p.get("g") && p.get("beta")) {
    std::fill(o.begin(), o.end(), NAN);
    std::fill(ht.begin(), ht.end(), NAN);
    ops::delta_rule_chunk_forward({s, p.get("q_l2"), p.get("k_l2"), p.get("v"), p.get("g"),
                                   p.get("beta"), p.get("h0"), p.cu_seqlens},
                                  o.data(), ht.data());
    add_outputs(r, fx, p, "chunked(plain op)", o, ht);
  }
  if (!p.get("do_out")) return;
  std::vector<float> dq(p.t.at("q").size(), NAN), dk(dq.size(), NAN), dv(p.o_size(), NAN),
      dgraw(p.t.at("graw").size(), NAN), dbraw(p.t.at("braw").size(), NAN), dA(HV, NAN),
      ddt(HV * K, NAN), dh0(p.state_size(), NAN);
  ops::kda_chunk_backward(in, p.get("do_out"), p.get("dht_out"),
                          {dq.data(), dk.data(), dv.data(), dgraw.data(), dbraw.data(), dA.data(),
                           ddt.data(), p.get("h0") ? dh0.data() : nullptr});
  const double tol = kGradientTolerance;
  const std::vector<std::pair<const char*, const std::vector<float>*>> grads = {
      {"dq", &dq},       {"dk", &dk},     {"dv", &dv},        {"dgraw", &dgraw},
      {"dbraw", &dbraw}, {"dA_log", &dA}, {"ddt_bias", &ddt}, {"dh0", &dh0}};
  for (const auto& [name, g] : grads)
    if (fx.has(name)) add_row(r, fx, "chunked", name, *g, tol);
}

}  // namespace

void check_delta_family(const Fixture& fx, FixtureReport& report) {
  const std::string op = fx.op();
  const Gate gate = op == "kda"                ? Gate::channel
                    : op == "gated_delta_rule" ? Gate::scalar
                                               : Gate::none;
  const Problem p = load_problem(fx, gate);
  if (gate == Gate::channel && fx.has("graw")) {
    check_kda_layer(fx, p, report);
  } else {
    check_plain(fx, p, report);
  }
}

}  // namespace kda::verify
