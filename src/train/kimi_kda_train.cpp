// Kimi Linear's KDA mixer for training:
//   q, k, v = silu(conv(x W_{q,k,v}^T)) per document; q, k <- x rsqrt(sum x^2 + 1e-6)
//   graw = (x f_a^T) f_b^T;  beta_raw = x b^T;  out_gate = (x g_a^T) g_b^T
//   o = KDA(q, k, v, gate(graw; A_log, dt_bias), sigmoid(beta_raw))   (ops/kda)
//   y = o_proj( o_norm(o) * sigmoid(out_gate) )
#include <algorithm>

#include "core/error.h"
#include "ops/conv1d/conv1d.h"
#include "ops/kda/kda.h"
#include "ops/norm/norm.h"
#include "train/kimi_train_layers.h"
#include "train/layers.h"

namespace kda::train {
namespace {

constexpr float kQkL2NormEps = 1e-6f;

template <class V>
float* sized(V& v, int64_t n) {
  v.assign(size_t(n), 0.0f);
  return v.data();
}

void add_into(float* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

ops::KdaInputs<float> kda_inputs(const model::KimiLinearConfig& c, int64_t N,
                                 std::span<const int64_t> segments, const float* q, const float* k,
                                 const float* v, const float* graw, const float* braw,
                                 const KdaLayerParams& p) {
  ops::KdaInputs<float> in;
  in.shape.B = 1;
  in.shape.T = N;
  in.shape.H = in.shape.HV = c.kda_heads;
  in.shape.K = in.shape.V = c.kda_head_dim;
  in.shape.gate = ops::Gate::channel;
  in.options.l2norm_qk = false;  // transformers' rsqrt(sum + eps) form runs outside the op
  if (c.forget_gate_lower_bound) {
    in.options.gate = ops::KdaGate::lower_bound;
    in.options.lower_bound = *c.forget_gate_lower_bound;
  }
  in.q = q;
  in.k = k;
  in.v = v;
  in.graw = graw;
  in.braw = braw;
  in.A_log = p.A_log->value.f32();
  in.dt_bias = p.dt_bias->value.f32();
  in.cu_seqlens = segments;
  return in;
}

}  // namespace

void KimiKdaTrainLayer::forward(const float* x, int64_t N, std::span<const int64_t> segments,
                                float* y) {
  const int64_t D = c_.hidden_size, H = c_.kda_heads, K = c_.kda_head_dim, HK = c_.kda_width();
  const int64_t W = c_.conv_kernel;
  N_ = N;
  segments_.assign(segments.begin(), segments.end());
  x_.assign(x, x + N * D);
  Param* projections[3] = {p_.q_proj, p_.k_proj, p_.v_proj};
  Param* convs[3] = {p_.q_conv, p_.k_conv, p_.v_conv};
  std::vector<float> window(size_t((W - 1) * HK));
  for (int part = 0; part < 3; ++part) {
    float* pre = sized(pre_[part], N * HK);
    float* out = sized(conv_[part], N * HK);
    linear_forward(x, N, D, projections[part]->value.f32(), HK, pre);
    for (size_t s = 0; s + 1 < segments_.size(); ++s) {
      const int64_t t0 = segments_[s], len = segments_[s + 1] - t0;
      std::fill(window.begin(), window.end(), 0.0f);
      ops::short_conv_silu_forward(pre + t0 * HK, len, HK, HK, convs[part]->value.f32(), W,
                                   window.data(), out + t0 * HK);
    }
  }
  ops::l2_normalize_rows(conv_[0].data(), N * H, K, kQkL2NormEps, sized(qn_, N * HK));
  ops::l2_normalize_rows(conv_[1].data(), N * H, K, kQkL2NormEps, sized(kn_, N * HK));
  linear_forward(x, N, D, p_.f_a->value.f32(), K, sized(fa_, N * K));
  linear_forward(fa_.data(), N, K, p_.f_b->value.f32(), HK, sized(graw_, N * HK));
  linear_forward(x, N, D, p_.g_a->value.f32(), K, sized(ga_, N * K));
  linear_forward(ga_.data(), N, K, p_.g_b->value.f32(), HK, sized(gate_, N * HK));
  linear_forward(x, N, D, p_.b_proj->value.f32(), H, sized(braw_, N * H));
  const ops::KdaInputs<float> in = kda_inputs(c_, N, segments_, qn_.data(), kn_.data(),
                                              conv_[2].data(), graw_.data(), braw_.data(), p_);
  ops::kda_chunk_forward(in, sized(o_, N * HK), nullptr);
  ops::gated_rms_norm_sigmoid(o_.data(), gate_.data(), N * H, K, p_.o_norm->value.f32(),
                              float(c_.rms_norm_eps), sized(on_, N * HK));
  linear_forward(on_.data(), N, HK, p_.o_proj->value.f32(), D, y);
}

void KimiKdaTrainLayer::backward(const float* dy, float* dx) {
  const int64_t N = N_, D = c_.hidden_size, H = c_.kda_heads, K = c_.kda_head_dim;
  const int64_t HK = c_.kda_width(), W = c_.conv_kernel;
  std::vector<float> d_on(size_t(N * HK)), d_o(size_t(N * HK)), d_gate(size_t(N * HK));
  linear_backward(on_.data(), dy, N, HK, p_.o_proj->value.f32(), D, d_on.data(),
                  p_.o_proj->grad.f32());
  ops::gated_rms_norm_sigmoid_backward(o_.data(), gate_.data(), N * H, K, p_.o_norm->value.f32(),
                                       float(c_.rms_norm_eps), d_on.data(), d_o.data(),
                                       d_gate.data(), p_.o_norm->grad.f32());

  std::vector<float> dq(size_t(N * HK)), dk(size_t(N * HK)), dv(size_t(N * HK));
  std::vector<float> dgraw(size_t(N * HK)), dbraw(size_t(N * H));
  std::vector<float> dA = std::vector<float>(size_t(H)), ddt = std::vector<float>(size_t(HK));
  const ops::KdaInputs<float> in = kda_inputs(c_, N, segments_, qn_.data(), kn_.data(),
                                              conv_[2].data(), graw_.data(), braw_.data(), p_);
  ops::kda_chunk_backward(in, d_o.data(), nullptr,
                          {dq.data(), dk.data(), dv.data(), dgraw.data(), dbraw.data(), dA.data(),
                           ddt.data(), nullptr});
  add_into(p_.A_log->grad.f32(), dA.data(), H);
  add_into(p_.dt_bias->grad.f32(), ddt.data(), HK);
  ops::l2_normalize_rows_backward(conv_[0].data(), N * H, K, kQkL2NormEps, dq.data(), dq.data());
  ops::l2_normalize_rows_backward(conv_[1].data(), N * H, K, kQkL2NormEps, dk.data(), dk.data());

  // Everything that read x: the three conv paths, the two low-rank gates and beta.
  const float* d_conv[3] = {dq.data(), dk.data(), dv.data()};
  Param* projections[3] = {p_.q_proj, p_.k_proj, p_.v_proj};
  Param* convs[3] = {p_.q_conv, p_.k_conv, p_.v_conv};
  std::vector<float> d_pre(size_t(N * HK));
  for (int part = 0; part < 3; ++part) {
    for (size_t s = 0; s + 1 < segments_.size(); ++s) {
      const int64_t t0 = segments_[s], len = segments_[s + 1] - t0;
      ops::short_conv_silu_backward(pre_[part].data() + t0 * HK, len, HK, HK,
                                    convs[part]->value.f32(), W, d_conv[part] + t0 * HK,
                                    d_pre.data() + t0 * HK, HK, convs[part]->grad.f32());
    }
    linear_backward(x_.data(), d_pre.data(), N, D, projections[part]->value.f32(), HK, dx,
                    projections[part]->grad.f32(), part > 0);
  }
  std::vector<float> d_low(size_t(N * K));
  linear_backward(fa_.data(), dgraw.data(), N, K, p_.f_b->value.f32(), HK, d_low.data(),
                  p_.f_b->grad.f32());
  linear_backward(x_.data(), d_low.data(), N, D, p_.f_a->value.f32(), K, dx, p_.f_a->grad.f32(),
                  true);
  linear_backward(ga_.data(), d_gate.data(), N, K, p_.g_b->value.f32(), HK, d_low.data(),
                  p_.g_b->grad.f32());
  linear_backward(x_.data(), d_low.data(), N, D, p_.g_a->value.f32(), K, dx, p_.g_a->grad.f32(),
                  true);
  linear_backward(x_.data(), dbraw.data(), N, D, p_.b_proj->value.f32(), H, dx,
                  p_.b_proj->grad.f32(), true);
}

}  // namespace kda::train
