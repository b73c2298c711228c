// The KDA token mixer of a Kimi Linear layer (transformers' KimiLinearDeltaAttention):
//   q, k, v = SiLU(causal short conv(W_{q,k,v} x))          (conv state carried per sequence)
//   graw = f_b(f_a x), beta_raw = b_proj x                  (gate and beta activations in-op)
//   q, k <- q, k * rsqrt(sum(q^2) + 1e-6)                  (transformers' l2norm, done here)
//   o = KDA(q, k, v, graw, beta_raw; A_log, dt_bias)       (gate and beta in-op; scale K^-0.5)
//   y = o_proj( RMSNorm_K(o) * o_norm * sigmoid(g_b(g_a x)) )
#include <algorithm>
#include <string>

#include "core/blas.h"
#include "core/error.h"
#include "model/kimi_linear_blocks.h"
#include "ops/conv1d/conv1d.h"
#include "ops/kda/kda.h"
#include "ops/nn/nn.h"
#include "ops/norm/norm.h"

namespace kda::model::kimi {
namespace {

const char* const kConvNames[3] = {"q_conv1d", "k_conv1d", "v_conv1d"};

// A_log is [1, 1, H, 1] in the released checkpoints ([H, 1] or [H] elsewhere); dt_bias is
// [H * K] ([H, K] elsewhere). The stored spelling is accepted when it holds the same values.
Shape stored_or(const ModelFolder& folder, const std::string& name, const Shape& preferred,
                std::initializer_list<Shape> alternatives) {
  if (folder.has(name)) {
    const Shape stored = folder.view(name).shape;
    for (const Shape& alt : alternatives)
      if (stored == alt) return stored;
  }
  return preferred;
}

// transformers (and fla's l2norm kernel) normalise with x * rsqrt(sum(x^2) + 1e-6); ops::kda's
// in-op x / max(|x|, 1e-6) differs by ~6e-4 relative at the fixture's small activations, so the
// normalisation happens before the op.
constexpr float kQkL2NormEps = 1e-6f;

ops::KdaOptions kda_options(const KimiLinearConfig& c) {
  ops::KdaOptions o;
  o.l2norm_qk = false;
  if (c.forget_gate_lower_bound) {
    o.gate = ops::KdaGate::lower_bound;
    o.lower_bound = *c.forget_gate_lower_bound;
  }
  return o;
}

}  // namespace

ops::DeltaRuleShape kda_delta_shape(const KimiLinearConfig& c, int64_t T) {
  ops::DeltaRuleShape s;
  s.B = 1;
  s.T = T;
  s.H = s.HV = c.kda_heads;
  s.K = s.V = c.kda_head_dim;
  s.gate = ops::Gate::channel;
  return s;
}

void expect_kda(const KimiLinearConfig& c, const std::string& p, const ModelFolder& folder,
                TensorMap& e) {
  const int64_t D = c.hidden_size, H = c.kda_heads, K = c.kda_head_dim, HK = c.kda_width();
  e[p + "q_proj.weight"] = {HK, D};
  e[p + "k_proj.weight"] = {HK, D};
  e[p + "v_proj.weight"] = {HK, D};
  for (const char* conv : kConvNames) e[p + conv + ".weight"] = {HK, 1, c.conv_kernel};
  e[p + "f_a_proj.weight"] = {K, D};
  e[p + "f_b_proj.weight"] = {HK, K};
  e[p + "g_a_proj.weight"] = {K, D};
  e[p + "g_b_proj.weight"] = {HK, K};
  e[p + "b_proj.weight"] = {H, D};
  e[p + "A_log"] = stored_or(folder, p + "A_log", {1, 1, H, 1}, {{1, 1, H, 1}, {H, 1}, {H}});
  e[p + "dt_bias"] = stored_or(folder, p + "dt_bias", {HK}, {{HK}, {H, K}});
  e[p + "o_norm.weight"] = {K};
  e[p + "o_proj.weight"] = {D, HK};
}

KdaWeights load_kda(const KimiLinearConfig& c, const std::string& p, const ModelFolder& folder) {
  TensorMap e;
  expect_kda(c, p, folder, e);
  auto load = [&](const std::string& name) { return folder.load(p + name, e.at(p + name)); };
  KdaWeights w;
  {
    const Tensor q = load("q_proj.weight"), k = load("k_proj.weight"), v = load("v_proj.weight");
    const Tensor fa = load("f_a_proj.weight"), ga = load("g_a_proj.weight");
    const Tensor b = load("b_proj.weight");
    w.in_proj = stack_rows({&q, &k, &v, &fa, &ga, &b});
  }
  {
    const Tensor q = load("q_conv1d.weight"), k = load("k_conv1d.weight");
    const Tensor v = load("v_conv1d.weight");
    w.conv = stack_rows({&q, &k, &v});
    w.conv.reshape({3, c.kda_width(), c.conv_kernel});
  }
  w.f_b = load("f_b_proj.weight");
  w.g_b = load("g_b_proj.weight");
  w.A_log = load("A_log");
  w.A_log.reshape({c.kda_heads});
  w.dt_bias = load("dt_bias");
  w.dt_bias.reshape({c.kda_width()});
  w.o_norm = load("o_norm.weight");
  w.o_proj = load("o_proj.weight");
  return w;
}

KdaState new_kda_state(const KimiLinearConfig& c) {
  KdaState s;
  s.recurrent.assign(size_t(c.kda_heads * c.kda_head_dim * c.kda_head_dim), 0.0f);
  s.conv.assign(size_t(3 * (c.conv_kernel - 1) * c.kda_width()), 0.0f);
  return s;
}

namespace {

// Up to this many rows (a batched decode step) the low-rank gates go through ops::linear.
constexpr int64_t kFewRows = 16;

// The rows' projections: [rows, 3 HK + 2 K + H] = q | k | v | f_a | g_a | b, then the low-rank
// forget gate graw and output gate [rows, HK] read straight from the stacked projection.
struct KdaProjections {
  float *proj, *graw, *gate;
  int64_t width;
};

KdaProjections kda_project(const KimiLinearConfig& c, const KdaWeights& w, const float* x,
                           int64_t rows, Scratch& s) {
  const int64_t D = c.hidden_size, H = c.kda_heads, K = c.kda_head_dim, HK = c.kda_width();
  KdaProjections p;
  p.width = 3 * HK + 2 * K + H;
  p.proj = grow(s.proj, rows * p.width);
  ops::linear(x, rows, D, w.in_proj.f32(), p.width, nullptr, p.proj);
  p.graw = grow(s.graw, rows * HK);
  p.gate = grow(s.gate, rows * HK);
  if (rows == 1) {  // decode: matrix-vector products (no GEMM packing, no thread team)
    ops::linear(p.proj + 3 * HK, 1, K, w.f_b.f32(), HK, nullptr, p.graw);
    ops::linear(p.proj + 3 * HK + K, 1, K, w.g_b.f32(), HK, nullptr, p.gate);
  } else if (rows <= kFewRows) {
    // a batched decode step: the f_a, g_a columns made contiguous for ops::linear's few-row
    // product (BLAS's threads, woken by a GEMM here, spun against the decode's own helpers)
    float* low = grow(s.low_rank, rows * 2 * K);
    for (int64_t r = 0; r < rows; ++r) {
      std::copy_n(p.proj + r * p.width + 3 * HK, K, low + r * K);
      std::copy_n(p.proj + r * p.width + 3 * HK + K, K, low + (rows + r) * K);
    }
    ops::linear(low, rows, K, w.f_b.f32(), HK, nullptr, p.graw);
    ops::linear(low + rows * K, rows, K, w.g_b.f32(), HK, nullptr, p.gate);
  } else {
    gemm_nt(int(rows), int(HK), int(K), 1.0f, p.proj + 3 * HK, int(p.width), w.f_b.f32(), int(K),
            0.0f, p.graw, int(HK));
    gemm_nt(int(rows), int(HK), int(K), 1.0f, p.proj + 3 * HK + K, int(p.width), w.g_b.f32(),
            int(K), 0.0f, p.gate, int(HK));
  }
  return p;
}

// RMSNorm_K(o) * o_norm * sigmoid(gate), then o_proj: y [rows, D].
void kda_output(const KimiLinearConfig& c, const KdaWeights& w, float* o, const float* gate,
                int64_t rows, float* y) {
  const int64_t H = c.kda_heads, K = c.kda_head_dim;
  ops::gated_rms_norm_sigmoid(o, gate, rows * H, K, w.o_norm.f32(), float(c.rms_norm_eps), o);
  ops::linear(o, rows, H * K, w.o_proj.f32(), c.hidden_size, nullptr, y);
}

}  // namespace

void kda_decode_batch(const KimiLinearConfig& c, const KdaWeights& w, const float* x, int64_t N,
                      std::span<KdaState* const> states, float* y, Scratch& s) {
  const int64_t H = c.kda_heads, K = c.kda_head_dim, HK = c.kda_width(), W = c.conv_kernel;
  require(N >= 1 && int64_t(states.size()) == N, "kda_decode_batch: one state per row");
  const KdaProjections p = kda_project(c, w, x, N, s);
  float* qkv[3] = {grow(s.q, N * HK), grow(s.k, N * HK), grow(s.v, N * HK)};
  for (int64_t n = 0; n < N; ++n) {
    for (int part = 0; part < 3; ++part) {
      ops::short_conv_silu_decode_step(
          p.proj + n * p.width + part * HK, HK, w.conv.f32() + part * HK * W, W,
          states[n]->conv.data() + part * (W - 1) * HK, qkv[part] + n * HK);
    }
  }
  ops::l2_normalize_rows(qkv[0], N * H, K, kQkL2NormEps, qkv[0]);
  ops::l2_normalize_rows(qkv[1], N * H, K, kQkL2NormEps, qkv[1]);
  float* braw = grow(s.braw, N * H);
  for (int64_t n = 0; n < N; ++n)
    std::copy_n(p.proj + n * p.width + 3 * HK + 2 * K, H, braw + n * H);
  float* o = grow(s.attn, N * HK);
  const ops::DeltaRuleShape shape = kda_delta_shape(c, 1);
  const ops::KdaOptions options = kda_options(c);
  for (int64_t n = 0; n < N; ++n) {
    ops::kda_decode_step(shape, options, qkv[0] + n * HK, qkv[1] + n * HK, qkv[2] + n * HK,
                         p.graw + n * HK, braw + n * H, w.A_log.f32(), w.dt_bias.f32(),
                         states[n]->recurrent.data(), o + n * HK);
  }
  kda_output(c, w, o, p.gate, N, y);
}

void kda_forward(const KimiLinearConfig& c, const KdaWeights& w, const float* x, int64_t T,
                 KdaState& state, float* y, Scratch& s) {
  if (T == 1) {
    KdaState* one[1] = {&state};
    return kda_decode_batch(c, w, x, 1, one, y, s);
  }
  const int64_t H = c.kda_heads, K = c.kda_head_dim, HK = c.kda_width(), W = c.conv_kernel;
  const KdaProjections p = kda_project(c, w, x, T, s);
  const int64_t width = p.width;
  const float* proj = p.proj;
  // Short conv + SiLU of q, k, v, each against its own window of past inputs.
  float* qkv[3] = {grow(s.q, T * HK), grow(s.k, T * HK), grow(s.v, T * HK)};
  for (int part = 0; part < 3; ++part) {
    const float* weight = w.conv.f32() + part * HK * W;
    float* window = state.conv.data() + part * (W - 1) * HK;
    ops::short_conv_silu_forward(proj + part * HK, T, HK, width, weight, W, window, qkv[part]);
  }
  ops::l2_normalize_rows(qkv[0], T * H, K, kQkL2NormEps, qkv[0]);
  ops::l2_normalize_rows(qkv[1], T * H, K, kQkL2NormEps, qkv[1]);
  float* braw = grow(s.braw, T * H);
  for (int64_t t = 0; t < T; ++t) std::copy_n(proj + t * width + 3 * HK + 2 * K, H, braw + t * H);

  float* o = grow(s.attn, T * HK);
  const ops::DeltaRuleShape shape = kda_delta_shape(c, T);
  const ops::KdaOptions options = kda_options(c);
  float* final_state = grow(s.state, int64_t(state.recurrent.size()));
  ops::KdaInputs<float> in;
  in.shape = shape;
  in.options = options;
  in.q = qkv[0];
  in.k = qkv[1];
  in.v = qkv[2];
  in.graw = p.graw;
  in.braw = braw;
  in.A_log = w.A_log.f32();
  in.dt_bias = w.dt_bias.f32();
  in.h0 = state.recurrent.data();
  ops::kda_chunk_forward(in, o, final_state);
  std::copy_n(final_state, state.recurrent.size(), state.recurrent.data());
  kda_output(c, w, o, p.gate, T, y);
}

}  // namespace kda::model::kimi
