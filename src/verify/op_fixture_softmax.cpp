// Fixture checks for causal softmax attention with grouped-query heads.
#include <cmath>

#include "core/error.h"
#include "ops/attention/attention.h"
#include "ops/common/sequences.h"
#include "verify/op_fixture.h"

namespace kda::verify {

void check_softmax_attention(const Fixture& fx, FixtureReport& r) {
  const std::vector<int64_t> qs = fx.shape("q"), ks = fx.shape("k"), vs = fx.shape("v");
  require(qs.size() == 4 && ks.size() == 4 && vs.size() == 4,
          fx.path() + ": q, k and v must have 4 dimensions [B, T, heads, D]");
  ops::AttentionShape s{qs[0], qs[1], qs[2], ks[2], qs[3], vs[3], fx.meta_double("scale", 0.0)};
  require(ks[0] == s.B && ks[1] == s.T && ks[3] == s.D && vs[0] == s.B && vs[1] == s.T &&
              vs[2] == s.HKV,
          fx.path() + ": q " + shape_string(qs) + ", k " + shape_string(ks) + " and v " +
              shape_string(vs) + " do not fit together");
  if (fx.has_meta("HKV"))
    require(fx.meta_int("HKV") == s.HKV, fx.path() + ": metadata HKV disagrees with k");
  require(fx.meta_bool("causal", true), fx.path() + ": only causal attention is supported");
  s.validate();
  const std::vector<int64_t> cu =
      fx.has("cu_seqlens") ? fx.i64("cu_seqlens") : std::vector<int64_t>{};
  const ops::SequenceLayout seqs(s.B, s.T, cu);
  const std::vector<float> q = fx.f32("q"), k = fx.f32("k"), v = fx.f32("v");
  const ops::AttentionInputs<float> in{s, q.data(), k.data(), v.data(), cu};
  const int64_t H = s.H, HKV = s.HKV, D = s.D, DV = s.DV;
  const size_t o_n = size_t(s.B * s.T * H * DV);
  {
    const std::vector<double> qd(q.begin(), q.end()), kd(k.begin(), k.end()),
        vd(v.begin(), v.end());
    std::vector<double> o(o_n);
    ops::attention_reference({s, qd.data(), kd.data(), vd.data(), cu}, o.data());
    add_row(r, fx, "reference", "o", o, kOutputTolerance);
  }
  std::vector<float> o(o_n, NAN), lse(size_t(s.B * s.T * H), NAN);
  ops::attention_flash_forward(in, o.data(), lse.data());
  add_row(r, fx, "flash", "o", o, kOutputTolerance);
  // decode: each sequence token by token through its own KV cache slot
  std::vector<float> od(o_n, NAN);
  ops::KvCache cache(seqs.num_sequences(), HKV, D, DV);
  ops::AttentionShape one = s;
  one.B = 1;
  for (int64_t n = 0; n < seqs.num_sequences(); ++n) {
    const std::vector<int64_t> slot = {n};
    for (int64_t t = 0; t < seqs.length(n); ++t) {
      const int64_t tok = seqs.start(n) + t;
      ops::attention_decode_step(one, cache, q.data() + tok * H * D, k.data() + tok * HKV * D,
                                 v.data() + tok * HKV * DV, od.data() + tok * H * DV, slot);
    }
  }
  add_row(r, fx, "decode", "o", od, kOutputTolerance);
  if (!fx.has("do_out")) return;
  const std::vector<float> d_o = fx.f32("do_out");
  std::vector<float> dq(q.size(), NAN), dk(k.size(), NAN), dv(v.size(), NAN);
  ops::attention_flash_backward(in, o.data(), lse.data(), d_o.data(),
                                {dq.data(), dk.data(), dv.data()});
  for (const auto& [name, g] :
       {std::pair<const char*, const std::vector<float>*>{"dq", &dq}, {"dk", &dk}, {"dv", &dv}}) {
    if (fx.has(name)) add_row(r, fx, "flash", name, *g, kGradientTolerance);
  }
}

}  // namespace kda::verify
