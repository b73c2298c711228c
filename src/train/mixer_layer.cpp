#include "train/mixer_layer.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "ops/attention/attention.h"
#include "ops/conv1d/conv1d.h"
#include "ops/delta_rule/delta_rule.h"
#include "ops/kda/kda.h"
#include "ops/kda/kda_activations.h"
#include "ops/linear_attn/linear_attn.h"
#include "train/layers.h"

namespace kda::train {

namespace act = kda::ops::detail;

namespace {

// Rotates pairs (i, i + dh/2) of every head row of token r by angle positions[r] *
// base^(-2i/dh) (GPT-NeoX layout); direction -1 applies the inverse rotation (the backward of a
// rotation is its transpose).
void rotary(float* x, const std::vector<int64_t>& positions, int64_t H, int64_t dh, int direction) {
  const int64_t half = dh / 2;
  for (int64_t r = 0; r < int64_t(positions.size()); ++r)
    for (int64_t i = 0; i < half; ++i) {
      const double angle = double(positions[r]) * std::pow(10000.0, -2.0 * double(i) / double(dh));
      const float c = float(std::cos(angle)), s = float(direction) * float(std::sin(angle));
      for (int64_t h = 0; h < H; ++h) {
        float* row = x + (r * H + h) * dh;
        const float x0 = row[i], x1 = row[i + half];
        row[i] = x0 * c - x1 * s;
        row[i + half] = x0 * s + x1 * c;
      }
    }
}

// Position of every token within its sequence: rows of T tokens, or packed by cu_seqlens.
std::vector<int64_t> token_positions(int64_t B, int64_t T, const std::vector<int64_t>& cu_seqlens) {
  std::vector<int64_t> positions(B * T);
  if (cu_seqlens.empty()) {
    for (int64_t r = 0; r < B * T; ++r) positions[r] = r % T;
  } else {
    for (size_t n = 0; n + 1 < cu_seqlens.size(); ++n)
      for (int64_t r = cu_seqlens[n]; r < cu_seqlens[n + 1]; ++r) positions[r] = r - cu_seqlens[n];
  }
  return positions;
}

}  // namespace

ops::DeltaRuleShape MixerLayer::op_shape(ops::Gate gate) const {
  // the ops see a packed batch as one row of B * T tokens delimited by cu_seqlens
  const bool packed = !cu_seqlens_.empty();
  return {packed ? 1 : B_, packed ? B_ * T_ : T_, H_, H_, dh_, dh_, gate, 0};
}

ops::DeltaRuleInputs<float> MixerLayer::delta_inputs() const {
  const bool gated = kind_ == MixerKind::gated_delta;
  return {op_shape(gated ? ops::Gate::scalar : ops::Gate::none),
          qn_.data(),
          kn_.data(),
          v_.data(),
          gated ? g_.data() : nullptr,
          beta_.data(),
          nullptr,
          cu_seqlens_};
}

ops::KdaInputs<float> MixerLayer::kda_inputs() const {
  return {op_shape(ops::Gate::channel),
          kda_options_,
          q_.data(),
          k_.data(),
          v_.data(),
          graw_.data(),
          braw_.data(),
          w_.A_log->value.f32(),
          w_.dt_bias->value.f32(),
          nullptr,
          cu_seqlens_};
}

void MixerLayer::forward(const float* x, int64_t B, int64_t T, float* y,
                         std::span<const int64_t> cu_seqlens) {
  B_ = B;
  T_ = T;
  cu_seqlens_.assign(cu_seqlens.begin(), cu_seqlens.end());
  const int64_t rows = B * T, inner = H_ * dh_;
  // the ops see a packed batch as one row of B * T tokens delimited by cu_seqlens
  const bool packed = !cu_seqlens_.empty();
  const int64_t OB = packed ? 1 : B, OT = packed ? rows : T;
  const std::span<const int64_t> cu(cu_seqlens_);
  x_.assign(x, x + rows * d_);
  q_.resize(rows * inner);
  k_.resize(rows * inner);
  v_.resize(rows * inner);
  o_.resize(rows * inner);
  linear_forward(x, rows, d_, w_.Wq->value.f32(), inner, q_.data());
  linear_forward(x, rows, d_, w_.Wk->value.f32(), inner, k_.data());
  linear_forward(x, rows, d_, w_.Wv->value.f32(), inner, v_.data());
  if (w_.q_conv) {  // causal short convolution + SiLU on q, k, v, per sequence
    segments_ = document_segments(cu_seqlens_, B, T, "mixer layer");
    float* qkv[3] = {q_.data(), k_.data(), v_.data()};
    const Param* conv[3] = {w_.q_conv, w_.k_conv, w_.v_conv};
    std::vector<float> window(size_t((kShortConvWidth - 1) * inner));
    for (int part = 0; part < 3; ++part) {
      pre_conv_[part].assign(qkv[part], qkv[part] + rows * inner);
      for (size_t s = 0; s + 1 < segments_.size(); ++s) {
        const int64_t t0 = segments_[s], len = segments_[s + 1] - t0;
        std::fill(window.begin(), window.end(), 0.0f);
        ops::short_conv_silu_forward(pre_conv_[part].data() + t0 * inner, len, inner, inner,
                                     conv[part]->value.f32(), kShortConvWidth, window.data(),
                                     qkv[part] + t0 * inner);
      }
    }
  }
  if (w_.Wb) {
    braw_.resize(rows * H_);
    linear_forward(x, rows, d_, w_.Wb->value.f32(), H_, braw_.data());
  }
  if (w_.Wg) {
    const int64_t gw = kind_ == MixerKind::kda ? inner : H_;
    graw_.resize(rows * gw);
    linear_forward(x, rows, d_, w_.Wg->value.f32(), gw, graw_.data());
  }
  switch (kind_) {
    case MixerKind::softmax: {
      if (rope_) {
        positions_ = token_positions(B, T, cu_seqlens_);
        rotary(q_.data(), positions_, H_, dh_, 1);
        rotary(k_.data(), positions_, H_, dh_, 1);
      }
      lse_.resize(rows * H_);
      ops::attention_flash_forward(
          {{OB, OT, H_, H_, dh_, dh_, 0}, q_.data(), k_.data(), v_.data(), cu}, o_.data(),
          lse_.data());
      break;
    }
    case MixerKind::linear: {
      ops::linear_attn_chunk_forward(
          {{OB, OT, H_, dh_, dh_, 0, true}, q_.data(), k_.data(), v_.data(), nullptr, nullptr, cu},
          {o_.data()});
      break;
    }
    case MixerKind::delta:
    case MixerKind::gated_delta: {
      qn_.resize(rows * inner);
      kn_.resize(rows * inner);
      beta_.resize(rows * H_);
      act::l2norm_rows(q_.data(), rows * H_, dh_, qn_.data());
      act::l2norm_rows(k_.data(), rows * H_, dh_, kn_.data());
      for (int64_t i = 0; i < rows * H_; ++i) beta_[i] = act::sigmoid(braw_[i]);
      const bool gated = kind_ == MixerKind::gated_delta;
      if (gated) {
        g_.resize(rows * H_);
        for (int64_t i = 0; i < rows * H_; ++i) {
          const int64_t h = i % H_;
          g_[i] = -std::exp(w_.A_log->value.f32()[h]) *
                  act::softplus(graw_[i] + w_.dt_bias->value.f32()[h]);
        }
      }
      ops::delta_rule_chunk_forward(delta_inputs(), o_.data(), nullptr);
      break;
    }
    case MixerKind::kda: {
      ops::kda_chunk_forward(kda_inputs(), o_.data(), nullptr);
      break;
    }
    case MixerKind::mla:
      throw Error("MixerLayer: MLA layers run through KimiMlaTrainLayer");
  }
  linear_forward(o_.data(), rows, inner, w_.Wo->value.f32(), d_, y);
}

void MixerLayer::backward(const float* dy, float* dx) {
  const int64_t B = B_, T = T_, rows = B * T, inner = H_ * dh_;
  const bool packed = !cu_seqlens_.empty();
  const int64_t OB = packed ? 1 : B, OT = packed ? rows : T;
  const std::span<const int64_t> cu(cu_seqlens_);
  std::vector<float> d_o(rows * inner), dq(rows * inner), dk(rows * inner), dv(rows * inner);
  linear_backward(o_.data(), dy, rows, inner, w_.Wo->value.f32(), d_, d_o.data(),
                  w_.Wo->grad.f32());
  std::vector<float> dbraw, dgraw;
  switch (kind_) {
    case MixerKind::softmax: {
      ops::attention_flash_backward(
          {{OB, OT, H_, H_, dh_, dh_, 0}, q_.data(), k_.data(), v_.data(), cu}, o_.data(),
          lse_.data(), d_o.data(), {dq.data(), dk.data(), dv.data()});
      if (rope_) {  // q_, k_ hold the rotated values; the gradient rotates back
        rotary(dq.data(), positions_, H_, dh_, -1);
        rotary(dk.data(), positions_, H_, dh_, -1);
      }
      break;
    }
    case MixerKind::linear: {
      ops::linear_attn_chunk_backward(
          {{OB, OT, H_, dh_, dh_, 0, true}, q_.data(), k_.data(), v_.data(), nullptr, nullptr, cu},
          d_o.data(), nullptr, nullptr, {dq.data(), dk.data(), dv.data()});
      break;
    }
    case MixerKind::delta:
    case MixerKind::gated_delta: {
      const bool gated = kind_ == MixerKind::gated_delta;
      std::vector<float> dqn(rows * inner), dkn(rows * inner), dbeta(rows * H_), dg;
      if (gated) dg.resize(rows * H_);
      ops::delta_rule_chunk_backward(
          delta_inputs(), d_o.data(), nullptr,
          {dqn.data(), dkn.data(), dv.data(), gated ? dg.data() : nullptr, dbeta.data(), nullptr});
      act::l2norm_rows_backward(q_.data(), dqn.data(), rows * H_, dh_, dq.data());
      act::l2norm_rows_backward(k_.data(), dkn.data(), rows * H_, dh_, dk.data());
      dbraw.resize(rows * H_);
      for (int64_t i = 0; i < rows * H_; ++i) dbraw[i] = dbeta[i] * beta_[i] * (1.0f - beta_[i]);
      if (gated) {
        dgraw.resize(rows * H_);
        float* dA = w_.A_log->grad.f32();
        float* ddt = w_.dt_bias->grad.f32();
        for (int64_t i = 0; i < rows * H_; ++i) {
          const int64_t h = i % H_;
          const float a = std::exp(w_.A_log->value.f32()[h]);
          const float xg = graw_[i] + w_.dt_bias->value.f32()[h];
          // g = -a softplus(xg): dg/dxg = -a sigmoid(xg), dg/dA_log = g
          dgraw[i] = -a * act::sigmoid(xg) * dg[i];
          dA[h] += g_[i] * dg[i];
          ddt[h] += dgraw[i];
        }
      }
      break;
    }
    case MixerKind::kda: {
      dbraw.resize(rows * H_);
      dgraw.resize(rows * inner);
      std::vector<float> dA(H_), ddt(inner);
      ops::kda_chunk_backward(kda_inputs(), d_o.data(), nullptr,
                              {dq.data(), dk.data(), dv.data(), dgraw.data(), dbraw.data(),
                               dA.data(), ddt.data(), nullptr});
      for (int64_t h = 0; h < H_; ++h) w_.A_log->grad.f32()[h] += dA[h];
      for (int64_t i = 0; i < inner; ++i) w_.dt_bias->grad.f32()[i] += ddt[i];
      break;
    }
    case MixerKind::mla:
      throw Error("MixerLayer: MLA layers run through KimiMlaTrainLayer");
  }
  if (w_.q_conv) {  // back through the short convolutions: dq, dk, dv become pre-conv
    float* d[3] = {dq.data(), dk.data(), dv.data()};
    Param* conv[3] = {w_.q_conv, w_.k_conv, w_.v_conv};
    std::vector<float> d_pre(rows * inner);
    for (int part = 0; part < 3; ++part) {
      for (size_t s = 0; s + 1 < segments_.size(); ++s) {
        const int64_t t0 = segments_[s], len = segments_[s + 1] - t0;
        ops::short_conv_silu_backward(pre_conv_[part].data() + t0 * inner, len, inner, inner,
                                      conv[part]->value.f32(), kShortConvWidth,
                                      d[part] + t0 * inner, d_pre.data() + t0 * inner, inner,
                                      conv[part]->grad.f32());
      }
      std::copy(d_pre.begin(), d_pre.end(), d[part]);
    }
  }
  const float* x = x_.data();
  linear_backward(x, dq.data(), rows, d_, w_.Wq->value.f32(), inner, dx, w_.Wq->grad.f32());
  linear_backward(x, dk.data(), rows, d_, w_.Wk->value.f32(), inner, dx, w_.Wk->grad.f32(), true);
  linear_backward(x, dv.data(), rows, d_, w_.Wv->value.f32(), inner, dx, w_.Wv->grad.f32(), true);
  if (w_.Wb) {
    linear_backward(x, dbraw.data(), rows, d_, w_.Wb->value.f32(), H_, dx, w_.Wb->grad.f32(), true);
  }
  if (w_.Wg) {
    const int64_t gw = kind_ == MixerKind::kda ? inner : H_;
    linear_backward(x, dgraw.data(), rows, d_, w_.Wg->value.f32(), gw, dx, w_.Wg->grad.f32(), true);
  }
}

}  // namespace kda::train
