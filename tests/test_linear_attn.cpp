// Linear attention: golden fixtures (fla), chunked forward and backward against the float64
// recurrence and its finite differences, decode against prefill, and argument checks.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/random.h"
#include "core/safetensors.h"
#include "ops/linear_attn/linear_attn.h"

namespace kda::ops {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

std::vector<float> poisoned(int64_t n) {
  return std::vector<float>(size_t(n), kNaN);
}
std::vector<double> poisoned_double(int64_t n) {
  return std::vector<double>(size_t(n), std::numeric_limits<double>::quiet_NaN());
}

// ||ours - ref|| / ||ref||; NaN anywhere gives NaN, which fails every <= check.
template <class A, class B>
double relative_error(const A& ours, const B& ref) {
  if (ours.size() != ref.size()) return std::numeric_limits<double>::infinity();
  double diff = 0, norm = 0;
  for (size_t i = 0; i < ours.size(); ++i) {
    const double d = double(ours[i]) - double(ref[i]);
    diff += d * d;
    norm += double(ref[i]) * double(ref[i]);
  }
  return std::sqrt(diff / norm);
}

std::vector<double> to_double(const std::vector<float>& x) {
  return {x.begin(), x.end()};
}

// One random problem, held in fp32 and (the same values) in float64.
struct Problem {
  LinearAttnShape shape;
  std::vector<int64_t> cu_seqlens;
  int64_t N = 0;
  std::vector<float> q, k, v, h0, z0;
  std::vector<double> qd, kd, vd, h0d, z0d;

  Problem(LinearAttnShape s, uint64_t seed, bool with_h0, std::vector<int64_t> cu = {})
      : shape(s), cu_seqlens(std::move(cu)) {
    N = cu_seqlens.empty() ? s.B : int64_t(cu_seqlens.size()) - 1;
    Random rng(seed);
    q.resize(s.B * s.T * s.H * s.K);
    k.resize(q.size());
    v.resize(s.B * s.T * s.H * s.V);
    rng.fill_normal(q);
    rng.fill_normal(k);
    rng.fill_normal(v);
    if (with_h0) {
      h0.resize(N * s.H * s.K * s.V);
      rng.fill_normal(h0, 0.5f);
      if (s.normalize) {  // a normaliser is a sum of positive features
        z0.resize(N * s.H * s.K);
        rng.fill_uniform(z0, 0.5f, 3.0f);
      }
    }
    qd = to_double(q), kd = to_double(k), vd = to_double(v);
    h0d = to_double(h0), z0d = to_double(z0);
  }
  int64_t state_size() const { return N * shape.H * shape.K * shape.V; }
  int64_t z_size() const { return N * shape.H * shape.K; }
  LinearAttnInputs<float> inputs() const {
    return {shape,
            q.data(),
            k.data(),
            v.data(),
            h0.empty() ? nullptr : h0.data(),
            z0.empty() ? nullptr : z0.data(),
            cu_seqlens};
  }
  LinearAttnInputs<double> inputs_double() const {
    return {shape,
            qd.data(),
            kd.data(),
            vd.data(),
            h0d.empty() ? nullptr : h0d.data(),
            z0d.empty() ? nullptr : z0d.data(),
            cu_seqlens};
  }
};

struct ForwardResult {
  std::vector<float> o, ht, zt;
};
struct ReferenceResult {
  std::vector<double> o, ht, zt;
};

ForwardResult run_chunk(const Problem& p, int chunk) {
  ForwardResult r{poisoned(p.v.size()), poisoned(p.state_size()),
                  p.shape.normalize ? poisoned(p.z_size()) : std::vector<float>{}};
  linear_attn_chunk_forward(p.inputs(),
                            {r.o.data(), r.ht.data(), r.zt.empty() ? nullptr : r.zt.data()}, chunk);
  return r;
}

ReferenceResult run_reference(const Problem& p) {
  ReferenceResult r{poisoned_double(p.v.size()), poisoned_double(p.state_size()),
                    p.shape.normalize ? poisoned_double(p.z_size()) : std::vector<double>{}};
  linear_attn_reference(p.inputs_double(),
                        {r.o.data(), r.ht.data(), r.zt.empty() ? nullptr : r.zt.data()});
  return r;
}

LinearAttnShape make_shape(int64_t B, int64_t T, int64_t H, int64_t K, int64_t V, bool normalize) {
  LinearAttnShape s;
  s.B = B, s.T = T, s.H = H, s.K = K, s.V = V, s.normalize = normalize;
  return s;
}

// ---------------------------------------------------------------------------------------------
// Golden fixtures from fla's naive_recurrent_linear_attn (no initial state).

void check_fixture(const std::string& name) {
  const auto file = SafetensorsFile::open(std::string(KDA_SHARED_DIR) + "/fixtures/ops/" + name);
  auto meta = [&](const char* key) { return nlohmann::json::parse(file.metadata().at(key)); };
  LinearAttnShape s = make_shape(meta("B"), meta("T"), meta("H"), meta("K"), meta("V"),
                                 meta("normalize").get<bool>());
  s.scale = meta("scale");
  auto load = [&](const std::string& t) {
    const Tensor x = file.load(t);
    return std::vector<float>(x.f32(), x.f32() + x.numel());
  };
  const std::vector<float> q = load("q"), k = load("k"), v = load("v"), o = load("o");
  const std::vector<float> d_o = load("do_out"), dq = load("dq"), dk = load("dk"), dv = load("dv");
  const bool has_state = !s.normalize;
  const std::vector<float> ht = has_state ? load("ht") : std::vector<float>{};
  const std::vector<float> d_ht = has_state ? load("dht_out") : std::vector<float>{};
  ASSERT_EQ(q.size(), size_t(s.B * s.T * s.H * s.K));
  const int64_t state_size = s.B * s.H * s.K * s.V;

  const LinearAttnInputs<float> in{s, q.data(), k.data(), v.data()};
  std::vector<float> o_chunk = poisoned(v.size()), ht_chunk = poisoned(state_size);
  linear_attn_chunk_forward(in, {o_chunk.data(), ht_chunk.data()});
  EXPECT_LE(relative_error(o_chunk, o), 1e-5) << name << " chunked o";
  if (has_state) {
    EXPECT_LE(relative_error(ht_chunk, ht), 1e-5) << name << " chunked ht";
  }

  const std::vector<double> qd = to_double(q), kd = to_double(k), vd = to_double(v);
  std::vector<double> o_ref = poisoned_double(v.size()), ht_ref = poisoned_double(state_size);
  linear_attn_reference({s, qd.data(), kd.data(), vd.data()}, {o_ref.data(), ht_ref.data()});
  EXPECT_LE(relative_error(o_ref, o), 1e-5) << name << " reference o";
  if (has_state) {
    EXPECT_LE(relative_error(ht_ref, ht), 1e-5) << name << " reference ht";
  }

  std::vector<float> gq = poisoned(q.size()), gk = poisoned(k.size()), gv = poisoned(v.size());
  linear_attn_chunk_backward(in, d_o.data(), has_state ? d_ht.data() : nullptr, nullptr,
                             {gq.data(), gk.data(), gv.data()});
  EXPECT_LE(relative_error(gq, dq), 1e-4) << name << " dq";
  EXPECT_LE(relative_error(gk, dk), 1e-4) << name << " dk";
  EXPECT_LE(relative_error(gv, dv), 1e-4) << name << " dv";
}

TEST(LinearAttnFixture, PlainMatchesFla) {
  check_fixture("linear_attn.safetensors");
}
TEST(LinearAttnFixture, NormalisedMatchesFla) {
  check_fixture("linear_attn_norm.safetensors");
}

// ---------------------------------------------------------------------------------------------
// Chunked forward against the float64 recurrence.

struct Case {
  int64_t B, T, H, K, V;
  bool with_h0;
  std::vector<int64_t> cu_seqlens;
  int chunk = 64;
};

std::vector<Case> forward_cases() {
  return {
      {1, 1, 2, 32, 32, false, {}},                      // one token
      {2, 63, 2, 32, 48, true, {}},                      // just under a chunk, K != V
      {1, 64, 3, 16, 16, false, {}},                     // exactly a chunk
      {2, 65, 2, 32, 16, true, {}},                      // one past a chunk
      {1, 300, 2, 32, 32, true, {}},                     // many chunks, partial tail
      {1, 300, 1, 64, 24, false, {}, 16},                // small chunks
      {1, 200, 2, 16, 40, true, {0, 70, 71, 150, 200}},  // varlen, one sequence of length 1
      {1, 129, 2, 24, 16, false, {0, 1, 129}},           // varlen starting with length 1
  };
}

TEST(LinearAttnChunk, MatchesReferenceOnRandomShapes) {
  uint64_t seed = 100;
  for (bool normalize : {false, true}) {
    for (const Case& c : forward_cases()) {
      const Problem p(make_shape(c.B, c.T, c.H, c.K, c.V, normalize), ++seed, c.with_h0,
                      c.cu_seqlens);
      const ForwardResult ours = run_chunk(p, c.chunk);
      const ReferenceResult ref = run_reference(p);
      const std::string what =
          "T = " + std::to_string(c.T) + ", K = " + std::to_string(c.K) +
          ", V = " + std::to_string(c.V) + ", varlen = " + std::to_string(!c.cu_seqlens.empty()) +
          ", h0 = " + std::to_string(c.with_h0) + ", normalize = " + std::to_string(normalize);
      EXPECT_LE(relative_error(ours.o, ref.o), 1e-5) << what;
      EXPECT_LE(relative_error(ours.ht, ref.ht), 1e-5) << what;
      if (normalize) {
        EXPECT_LE(relative_error(ours.zt, ref.zt), 1e-5) << what;
      }
    }
  }
}

TEST(LinearAttnChunk, ExplicitScaleAndChunkSizesAgree) {
  LinearAttnShape s = make_shape(2, 150, 2, 32, 32, false);
  s.scale = 0.3;
  const Problem p(s, 7, true);
  const ReferenceResult ref = run_reference(p);
  for (int chunk : {1, 7, 64, 128, 1000}) {
    const ForwardResult ours = run_chunk(p, chunk);
    EXPECT_LE(relative_error(ours.o, ref.o), 1e-5) << "chunk " << chunk;
    EXPECT_LE(relative_error(ours.ht, ref.ht), 1e-5) << "chunk " << chunk;
  }
}

// ---------------------------------------------------------------------------------------------
// Backward against central finite differences of the float64 reference.

// sum(o * d_o) + sum(ht * d_ht) + sum(zt * d_zt) of the reference.
double reference_objective(const Problem& p, const std::vector<double>& d_o,
                           const std::vector<double>& d_ht, const std::vector<double>& d_zt) {
  const ReferenceResult r = run_reference(p);
  double sum = 0;
  for (size_t i = 0; i < d_o.size(); ++i) sum += r.o[i] * d_o[i];
  for (size_t i = 0; i < d_ht.size(); ++i) sum += r.ht[i] * d_ht[i];
  for (size_t i = 0; i < d_zt.size(); ++i) sum += r.zt[i] * d_zt[i];
  return sum;
}

std::vector<double> finite_differences(Problem& p, std::vector<double>& x,
                                       const std::vector<double>& d_o,
                                       const std::vector<double>& d_ht,
                                       const std::vector<double>& d_zt) {
  const double eps = 1e-5;
  std::vector<double> grad(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + eps;
    const double plus = reference_objective(p, d_o, d_ht, d_zt);
    x[i] = saved - eps;
    const double minus = reference_objective(p, d_o, d_ht, d_zt);
    x[i] = saved;
    grad[i] = (plus - minus) / (2 * eps);
  }
  return grad;
}

TEST(LinearAttnBackward, MatchesFiniteDifferences) {
  const std::vector<Case> cases = {
      {1, 1, 2, 4, 5, true, {}, 64},               // one token
      {2, 23, 2, 4, 6, true, {}, 8},               // several chunks with a partial tail
      {1, 21, 2, 5, 3, false, {}, 64},             // one partial chunk, no h0
      {1, 30, 1, 4, 4, true, {0, 11, 12, 30}, 4},  // varlen, one sequence of length 1
      {1, 70, 1, 3, 4, true, {0, 66, 70}, 64},     // varlen across the chunk edge
  };
  uint64_t seed = 500;
  for (bool normalize : {false, true}) {
    for (const Case& c : cases) {
      Problem p(make_shape(c.B, c.T, c.H, c.K, c.V, normalize), ++seed, c.with_h0, c.cu_seqlens);
      Random rng(++seed);
      std::vector<float> d_o(p.v.size()), d_ht(p.state_size()), d_zt;
      rng.fill_normal(d_o);
      rng.fill_normal(d_ht);
      if (normalize) {
        d_zt.resize(p.z_size());
        rng.fill_normal(d_zt);
      }
      const std::vector<double> d_od = to_double(d_o), d_htd = to_double(d_ht),
                                d_ztd = to_double(d_zt);

      std::vector<float> dq = poisoned(p.q.size()), dk = poisoned(p.k.size()),
                         dv = poisoned(p.v.size()), dh0 = poisoned(p.state_size()),
                         dz0 = poisoned(normalize ? p.z_size() : 0);
      LinearAttnInputs<float> in = p.inputs();
      linear_attn_chunk_backward(
          in, d_o.data(), d_ht.data(), normalize ? d_zt.data() : nullptr,
          {dq.data(), dk.data(), dv.data(), dh0.data(), normalize ? dz0.data() : nullptr}, c.chunk);

      const std::string what =
          "T = " + std::to_string(c.T) + ", chunk = " + std::to_string(c.chunk) +
          ", varlen = " + std::to_string(!c.cu_seqlens.empty()) +
          ", h0 = " + std::to_string(c.with_h0) + ", normalize = " + std::to_string(normalize);
      EXPECT_LE(relative_error(dq, finite_differences(p, p.qd, d_od, d_htd, d_ztd)), 1e-4)
          << "dq, " << what;
      EXPECT_LE(relative_error(dk, finite_differences(p, p.kd, d_od, d_htd, d_ztd)), 1e-4)
          << "dk, " << what;
      EXPECT_LE(relative_error(dv, finite_differences(p, p.vd, d_od, d_htd, d_ztd)), 1e-4)
          << "dv, " << what;
      if (c.with_h0) {
        EXPECT_LE(relative_error(dh0, finite_differences(p, p.h0d, d_od, d_htd, d_ztd)), 1e-4)
            << "dh0, " << what;
        if (normalize) {
          EXPECT_LE(relative_error(dz0, finite_differences(p, p.z0d, d_od, d_htd, d_ztd)), 1e-4)
              << "dz0, " << what;
        }
      }
    }
  }
}

TEST(LinearAttnBackward, NullStateCotangentsMeanZero) {
  const Problem p(make_shape(1, 40, 2, 8, 8, false), 31, true);
  Random rng(32);
  std::vector<float> d_o(p.v.size());
  rng.fill_normal(d_o);
  const std::vector<float> zeros(p.state_size(), 0.0f);
  std::vector<float> a[3], b[3];
  for (auto* g : {a, b}) {
    g[0] = poisoned(p.q.size()), g[1] = poisoned(p.k.size()), g[2] = poisoned(p.v.size());
  }
  linear_attn_chunk_backward(p.inputs(), d_o.data(), nullptr, nullptr,
                             {a[0].data(), a[1].data(), a[2].data()}, 16);
  linear_attn_chunk_backward(p.inputs(), d_o.data(), zeros.data(), nullptr,
                             {b[0].data(), b[1].data(), b[2].data()}, 16);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(relative_error(a[i], b[i]), 0.0) << i;
}

// ---------------------------------------------------------------------------------------------
// Decode token by token against the chunked prefill.

TEST(LinearAttnDecode, TokenByTokenMatchesChunkedPrefill) {
  uint64_t seed = 900;
  for (bool normalize : {false, true}) {
    for (bool with_h0 : {false, true}) {
      const int64_t B = 3, T = 90, H = 2, K = 32, V = 24, prefill = 70;
      const Problem p(make_shape(B, T, H, K, V, normalize), ++seed, with_h0);
      const ForwardResult whole = run_chunk(p, 64);

      // Prefill the first tokens with the chunked path, then decode the rest one by one.
      const Problem head = [&] {
        Problem h = p;
        h.shape.T = prefill;
        for (auto* x : {&h.q, &h.k, &h.v}) x->clear();
        for (int64_t b = 0; b < B; ++b) {
          auto copy_rows = [&](const std::vector<float>& src, std::vector<float>& dst, int64_t D) {
            dst.insert(dst.end(), src.begin() + b * T * H * D,
                       src.begin() + (b * T + prefill) * H * D);
          };
          copy_rows(p.q, h.q, K);
          copy_rows(p.k, h.k, K);
          copy_rows(p.v, h.v, V);
        }
        return h;
      }();
      ForwardResult state = run_chunk(head, 64);
      std::vector<float> o_decoded = poisoned(p.v.size());
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t t = 0; t < prefill; ++t) {
          for (int64_t i = 0; i < H * V; ++i) {
            o_decoded[(b * T + t) * H * V + i] = state.o[(b * prefill + t) * H * V + i];
          }
        }
      }
      std::vector<float> q_step(B * H * K), k_step(B * H * K), v_step(B * H * V);
      for (int64_t t = prefill; t < T; ++t) {
        for (int64_t b = 0; b < B; ++b) {
          std::copy_n(&p.q[(b * T + t) * H * K], H * K, &q_step[b * H * K]);
          std::copy_n(&p.k[(b * T + t) * H * K], H * K, &k_step[b * H * K]);
          std::copy_n(&p.v[(b * T + t) * H * V], H * V, &v_step[b * H * V]);
        }
        std::vector<float> o_step = poisoned(B * H * V);
        LinearAttnShape step_shape = p.shape;
        step_shape.T = 1;
        linear_attn_decode_step(step_shape, q_step.data(), k_step.data(), v_step.data(),
                                state.ht.data(), normalize ? state.zt.data() : nullptr,
                                o_step.data());
        for (int64_t b = 0; b < B; ++b) {
          std::copy_n(&o_step[b * H * V], H * V, &o_decoded[(b * T + t) * H * V]);
        }
      }
      EXPECT_LE(relative_error(o_decoded, whole.o), 1e-5) << normalize << with_h0;
      EXPECT_LE(relative_error(state.ht, whole.ht), 1e-5) << normalize << with_h0;
      if (normalize) {
        EXPECT_LE(relative_error(state.zt, whole.zt), 1e-5) << with_h0;
      }
    }
  }
}

TEST(LinearAttnDecode, FromScratchMatchesReference) {
  const int64_t T = 50, H = 2, K = 16, V = 16;
  const Problem p(make_shape(1, T, H, K, V, true), 77, false);
  const ReferenceResult ref = run_reference(p);
  std::vector<float> state(H * K * V, 0.0f), z(H * K, 0.0f), o = poisoned(p.v.size());
  LinearAttnShape step_shape = p.shape;
  step_shape.T = 1;
  for (int64_t t = 0; t < T; ++t) {
    linear_attn_decode_step(step_shape, &p.q[t * H * K], &p.k[t * H * K], &p.v[t * H * V],
                            state.data(), z.data(), &o[t * H * V]);
  }
  EXPECT_LE(relative_error(o, ref.o), 1e-5);
  EXPECT_LE(relative_error(state, ref.ht), 1e-5);
  EXPECT_LE(relative_error(z, ref.zt), 1e-5);
}

// ---------------------------------------------------------------------------------------------
// Bad arguments throw kda::Error.

TEST(LinearAttnArgs, MismatchedShapesThrow) {
  EXPECT_NO_THROW(linear_attn_shape_of({2, 10, 3, 16}, {2, 10, 3, 16}, {2, 10, 3, 8}));
  EXPECT_THROW(linear_attn_shape_of({2, 10, 3}, {2, 10, 3}, {2, 10, 3}), Error);
  EXPECT_THROW(linear_attn_shape_of({2, 10, 3, 16}, {2, 10, 3, 8}, {2, 10, 3, 8}), Error);
  EXPECT_THROW(linear_attn_shape_of({2, 10, 3, 16}, {2, 10, 3, 16}, {2, 11, 3, 8}), Error);
  EXPECT_THROW(linear_attn_shape_of({2, 10, 3, 16}, {2, 10, 3, 16}, {2, 10, 2, 8}), Error);
  EXPECT_THROW(linear_attn_shape_of({2, 10, 3, 0}, {2, 10, 3, 0}, {2, 10, 3, 8}), Error);
  EXPECT_THROW(
      linear_attn_shape_of({2, 10, 3, 16}, {2, 10, 3, 16}, {2, 10, 3, 8}, {}, {2, 3, 8, 16}),
      Error);  // h0 with K and V swapped
  EXPECT_THROW(linear_attn_shape_of({2, 10, 3, 16}, {2, 10, 3, 16}, {2, 10, 3, 8}, {},
                                    {2, 3, 16, 8}, {2, 3, 8}),
               Error);  // z0 of width V
  const std::vector<int64_t> cu = {0, 4, 10};
  EXPECT_NO_THROW(linear_attn_shape_of({1, 10, 3, 16}, {1, 10, 3, 16}, {1, 10, 3, 8}, cu,
                                       {2, 3, 16, 8}, {2, 3, 16}));
  EXPECT_THROW(
      linear_attn_shape_of({1, 10, 3, 16}, {1, 10, 3, 16}, {1, 10, 3, 8}, cu, {1, 3, 16, 8}),
      Error);  // one h0 row for two sequences

  const Problem p(make_shape(1, 10, 2, 8, 8, false), 1, true);
  std::vector<float> o = poisoned(p.v.size());
  LinearAttnInputs<float> in = p.inputs();
  in.shape.K = 0;
  EXPECT_THROW(linear_attn_chunk_forward(in, {o.data()}), Error);
  in = p.inputs();
  in.shape.scale = -1;
  EXPECT_THROW(linear_attn_chunk_forward(in, {o.data()}), Error);
  in = p.inputs();
  EXPECT_THROW(linear_attn_chunk_forward(in, {nullptr}), Error);
  EXPECT_THROW(linear_attn_chunk_forward(in, {o.data()}, 0), Error);
  const std::vector<float> z0(p.z_size(), 1.0f);
  in.z0 = z0.data();  // z0 with the plain form
  EXPECT_THROW(linear_attn_chunk_forward(in, {o.data()}), Error);
  std::vector<float> state(p.state_size(), 0.0f), o_step(2 * 8);
  EXPECT_THROW(linear_attn_decode_step(make_shape(1, 1, 2, 8, 8, true), p.q.data(), p.k.data(),
                                       p.v.data(), state.data(), nullptr, o_step.data()),
               Error);  // normalised decode without z
}

TEST(LinearAttnArgs, BadCuSeqlensThrow) {
  const Problem p(make_shape(1, 10, 2, 8, 8, false), 2, false);
  std::vector<float> o = poisoned(p.v.size());
  std::vector<double> od = poisoned_double(p.v.size());
  const std::vector<std::vector<int64_t>> bad = {
      {0, 5, 5, 10},  // not increasing
      {0, 6, 4, 10},  // decreasing
      {0, 4, 9},      // does not end at T
      {0, 4, 11},     // runs past T
      {1, 4, 10},     // does not start at 0
      {0},            // no sequence
  };
  for (const auto& cu : bad) {
    LinearAttnInputs<float> in = p.inputs();
    in.cu_seqlens = cu;
    EXPECT_THROW(linear_attn_chunk_forward(in, {o.data()}), Error);
    LinearAttnInputs<double> ind = p.inputs_double();
    ind.cu_seqlens = cu;
    EXPECT_THROW(linear_attn_reference(ind, {od.data()}), Error);
  }
  const Problem batched(make_shape(2, 5, 2, 8, 8, false), 3, false);
  LinearAttnInputs<float> in = batched.inputs();
  const std::vector<int64_t> cu = {0, 5};
  in.cu_seqlens = cu;  // packed sequences need B = 1
  EXPECT_THROW(linear_attn_chunk_forward(in, {o.data()}), Error);
}

TEST(LinearAttnArgs, NonFiniteInputsThrow) {
  for (bool normalize : {false, true}) {
    const Problem clean(make_shape(1, 100, 2, 8, 8, normalize), 4, true);
    std::vector<float> o = poisoned(clean.v.size());
    std::vector<double> od = poisoned_double(clean.v.size());
    std::vector<float> dq = poisoned(clean.q.size()), dk = poisoned(clean.k.size()),
                       dv = poisoned(clean.v.size());
    const std::vector<float> d_o(clean.v.size(), 0.5f);
    for (int which = 0; which < 4; ++which) {
      for (float bad : {kNaN, std::numeric_limits<float>::infinity()}) {
        Problem p = clean;
        std::vector<float>& x = which == 0 ? p.q : which == 1 ? p.k : which == 2 ? p.v : p.h0;
        std::vector<double>& xd = which == 0 ? p.qd : which == 1 ? p.kd : which == 2 ? p.vd : p.h0d;
        x[x.size() - 3] = bad;  // in the last chunk
        xd[xd.size() - 3] = bad;
        EXPECT_THROW(linear_attn_chunk_forward(p.inputs(), {o.data()}), Error) << which;
        EXPECT_THROW(linear_attn_reference(p.inputs_double(), {od.data()}), Error) << which;
        EXPECT_THROW(linear_attn_chunk_backward(p.inputs(), d_o.data(), nullptr, nullptr,
                                                {dq.data(), dk.data(), dv.data()}),
                     Error)
            << which;
      }
    }
    std::vector<float> bad_do = d_o;
    bad_do[7] = kNaN;
    EXPECT_THROW(linear_attn_chunk_backward(clean.inputs(), bad_do.data(), nullptr, nullptr,
                                            {dq.data(), dk.data(), dv.data()}),
                 Error);
    std::vector<float> state(2 * 8 * 8, 0.0f), z(2 * 8, 0.0f), o_step(2 * 8);
    std::vector<float> q_step(clean.q.begin(), clean.q.begin() + 16);
    q_step[3] = kNaN;
    EXPECT_THROW(
        linear_attn_decode_step(clean.shape, q_step.data(), clean.k.data(), clean.v.data(),
                                state.data(), normalize ? z.data() : nullptr, o_step.data()),
        Error);
  }
}

TEST(LinearAttnFlops, CountsTheChunkedProducts) {
  const LinearAttnShape s = make_shape(1, 65536, 4, 128, 128, false);
  // 64 * 128 (scores) + 64 * 128 (scores V) + 2 * 128 * 128 (state products) multiply-adds
  EXPECT_DOUBLE_EQ(linear_attn_chunk_forward_flops_per_token(s, 64),
                   2.0 * (64 * 128 + 64 * 128 + 2 * 128 * 128));
  LinearAttnShape n = s;
  n.normalize = true;
  EXPECT_GT(linear_attn_chunk_forward_flops_per_token(n, 64),
            linear_attn_chunk_forward_flops_per_token(s, 64));
}

}  // namespace
}  // namespace kda::ops
