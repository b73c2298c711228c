// Fixture checks for linear attention (plain and normalised forms).
#include <cmath>

#include "core/error.h"
#include "ops/linear_attn/linear_attn.h"
#include "verify/op_fixture.h"

namespace kda::verify {

void check_linear_attention(const Fixture& fx, FixtureReport& r) {
  const std::vector<int64_t> cu =
      fx.has("cu_seqlens") ? fx.i64("cu_seqlens") : std::vector<int64_t>{};
  ops::LinearAttnShape s = ops::linear_attn_shape_of(fx.shape("q"), fx.shape("k"), fx.shape("v"),
                                                     cu, fx.has("h0") ? fx.shape("h0") : Shape{});
  s.scale = fx.meta_double("scale", 0.0);
  s.normalize = fx.meta_bool("normalize", false);
  const ops::SequenceLayout seqs(s.B, s.T, cu);
  const int64_t N = seqs.num_sequences(), H = s.H, K = s.K, V = s.V;
  const std::vector<float> q = fx.f32("q"), k = fx.f32("k"), v = fx.f32("v");
  const std::vector<float> h0 = fx.has("h0") ? fx.f32("h0") : std::vector<float>{};
  const ops::LinearAttnInputs<float> in{
      s, q.data(), k.data(), v.data(), h0.empty() ? nullptr : h0.data(), nullptr, cu};
  const size_t o_n = size_t(s.B * s.T * H * V), state_n = size_t(N * H * K * V);
  const bool has_ht = fx.has("ht");
  auto add_outputs = [&](const char* path, const std::vector<float>& o,
                         const std::vector<float>& ht) {
    add_row(r, fx, path, "o", o, kOutputTolerance);
    if (has_ht) add_row(r, fx, path, "ht", ht, kOutputTolerance);
  };
  {
    const std::vector<double> qd(q.begin(), q.end()), kd(k.begin(), k.end()),
        vd(v.begin(), v.end()), hd(h0.begin(), h0.end());
    std::vector<double> o(o_n), ht(state_n);
    ops::linear_attn_reference(
        {s, qd.data(), kd.data(), vd.data(), hd.empty() ? nullptr : hd.data(), nullptr, cu},
        {o.data(), s.normalize ? nullptr : ht.data()});
    add_outputs("reference", {o.begin(), o.end()}, {ht.begin(), ht.end()});
  }
  std::vector<float> o(o_n, NAN), ht(state_n, NAN);
  ops::linear_attn_chunk_forward(in, {o.data(), ht.data()});
  add_outputs("chunked", o, ht);
  // decode: one token at a time through the in-place state (and normaliser)
  std::vector<float> state(state_n, 0.0f), z(N * H * K, 0.0f);
  if (!h0.empty()) state = h0;
  std::fill(o.begin(), o.end(), NAN);
  ops::LinearAttnShape one = s;
  one.B = 1;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t t = 0; t < seqs.length(n); ++t) {
      const int64_t tok = seqs.start(n) + t;
      ops::linear_attn_decode_step(one, q.data() + tok * H * K, k.data() + tok * H * K,
                                   v.data() + tok * H * V, state.data() + n * H * K * V,
                                   s.normalize ? z.data() + n * H * K : nullptr,
                                   o.data() + tok * H * V);
    }
  add_outputs("decode", o, state);
  if (!fx.has("do_out")) return;
  const std::vector<float> d_o = fx.f32("do_out");
  const std::vector<float> d_ht = fx.has("dht_out") ? fx.f32("dht_out") : std::vector<float>{};
  std::vector<float> dq(q.size(), NAN), dk(k.size(), NAN), dv(v.size(), NAN), dh0(state_n, NAN);
  ops::linear_attn_chunk_backward(
      in, d_o.data(), d_ht.empty() ? nullptr : d_ht.data(), nullptr,
      {dq.data(), dk.data(), dv.data(), h0.empty() ? nullptr : dh0.data()});
  for (const auto& [name, g] : {std::pair<const char*, const std::vector<float>*>{"dq", &dq},
                                {"dk", &dk},
                                {"dv", &dv},
                                {"dh0", &dh0}}) {
    if (fx.has(name)) add_row(r, fx, "chunked", name, *g, kGradientTolerance);
  }
}

}  // namespace kda::verify
