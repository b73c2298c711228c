#include "train/moe_layer.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/blas.h"
#include "core/error.h"
#include "train/layers.h"

namespace kda::train {
namespace {

void require_param(const Param* p, const Shape& shape, const std::string& what) {
  require(p != nullptr, "MoeLayer: missing parameter " + what);
  require(p->value.dtype() == DType::f32 && p->value.shape() == shape,
          "MoeLayer: " + what + " (" + p->name + ") has shape " + shape_string(p->value.shape()) +
              ", expected " + shape_string(shape));
  require(p->grad.dtype() == DType::f32 && p->grad.shape() == shape,
          "MoeLayer: gradient of " + what + " (" + p->name + ") has shape " +
              shape_string(p->grad.shape()) + ", expected " + shape_string(shape));
}

// The same sigmoid as ops::moe_route_sigmoid, so kept scores equal the routed ones bit for bit.
float sigmoid(float x) {
  return 1.0f / (1.0f + std::exp(-x));
}

void gather_rows(const float* src, const int32_t* rows, int64_t n, int64_t width, float* dst) {
  for (int64_t r = 0; r < n; ++r)
    std::copy_n(src + int64_t(rows[r]) * width, width, dst + r * width);
}

}  // namespace

MoeLayer::MoeLayer(const ops::MoeRouting& routing, int64_t width, int64_t expert_hidden,
                   int64_t shared_hidden, MoeParams p)
    : routing_(routing),
      D_(width),
      I_(expert_hidden),
      Is_(shared_hidden),
      E_(routing.num_experts),
      K_(routing.top_k),
      p_(std::move(p)) {
  routing_.validate();
  require(D_ >= 1 && I_ >= 1 && Is_ >= 0,
          "MoeLayer: width and expert_hidden must be positive, shared_hidden non-negative");
  require_param(p_.router, {E_, D_}, "router weight");
  require_param(p_.bias, {E_}, "score correction bias");
  require(int64_t(p_.w1.size()) == E_ && int64_t(p_.w2.size()) == E_ && int64_t(p_.w3.size()) == E_,
          "MoeLayer: need w1, w2, w3 for each of the " + std::to_string(E_) + " experts");
  for (int64_t e = 0; e < E_; ++e) {
    const std::string n = "expert " + std::to_string(e);
    require_param(p_.w1[e], {I_, D_}, n + " w1");
    require_param(p_.w2[e], {D_, I_}, n + " w2");
    require_param(p_.w3[e], {I_, D_}, n + " w3");
  }
  if (Is_ > 0) {
    require_param(p_.shared_gate, {Is_, D_}, "shared gate_proj");
    require_param(p_.shared_up, {Is_, D_}, "shared up_proj");
    require_param(p_.shared_down, {D_, Is_}, "shared down_proj");
  } else {
    require(!p_.shared_gate && !p_.shared_up && !p_.shared_down,
            "MoeLayer: shared expert weights given with shared_hidden 0");
  }
  p_.bias->decay = false;
  load_.assign(size_t(E_), 0);
}

void MoeLayer::forward(const float* x, int64_t rows, float* y) {
  require(rows >= 0, "MoeLayer::forward: rows must be non-negative");
  require(rows == 0 || (x && y), "MoeLayer::forward: null input or output");
  rows_ = -1;  // until this pass has succeeded: a throw leaves nothing to differentiate
  if (rows == 0) {
    rows_ = 0;
    return;
  }
  const int64_t D = D_, I = I_, E = E_, K = K_, pairs = rows * K;
  x_.assign(x, x + rows * D);

  // Routing, exactly as inference does it.
  logits_.resize(size_t(rows * E));
  linear_forward(x, rows, D, p_.router->value.f32(), E, logits_.data());
  ids_.resize(size_t(pairs));
  weights_.resize(size_t(pairs));
  score_.resize(size_t(pairs));
  ops::moe_route_sigmoid(routing_, logits_.data(), rows, p_.bias->value.f32(), ids_.data(),
                         weights_.data());
  for (int64_t q = 0; q < pairs; ++q) score_[q] = sigmoid(logits_[(q / K) * E + ids_[q]]);

  // Shared expert first (it writes y), then the routed experts accumulate, as inference does.
  if (Is_ > 0) {
    shared_a_.resize(size_t(rows * Is_));
    shared_b_.resize(size_t(rows * Is_));
    hidden_.resize(size_t(rows * Is_));
    linear_forward(x, rows, D, p_.shared_gate->value.f32(), Is_, shared_a_.data());
    linear_forward(x, rows, D, p_.shared_up->value.f32(), Is_, shared_b_.data());
    swiglu_forward(shared_a_.data(), shared_b_.data(), rows * Is_, hidden_.data());
    linear_forward(hidden_.data(), rows, Is_, p_.shared_down->value.f32(), D, y);
  } else {
    std::fill_n(y, rows * D, 0.0f);
  }

  // Counting sort of the (token, slot) pairs by expert.
  offset_.assign(size_t(E + 1), 0);
  for (int64_t q = 0; q < pairs; ++q) ++offset_[ids_[q] + 1];
  for (int64_t e = 0; e < E; ++e) {
    load_[e] += offset_[e + 1];
    offset_[e + 1] += offset_[e];
  }
  token_.resize(size_t(pairs));
  slot_.resize(size_t(pairs));
  {
    std::vector<int32_t> fill(offset_.begin(), offset_.end() - 1);
    for (int64_t q = 0; q < pairs; ++q) {
      const int32_t at = fill[ids_[q]]++;
      token_[at] = int32_t(q / K);
      slot_[at] = int32_t(q);
    }
  }

  a_.resize(size_t(pairs * I));
  b_.resize(size_t(pairs * I));
  int64_t most = 0;
  for (int64_t e = 0; e < E; ++e) most = std::max<int64_t>(most, offset_[e + 1] - offset_[e]);
  gathered_.resize(size_t(most * D));
  rows_out_.resize(size_t(most * D));
  hidden_.resize(std::max(hidden_.size(), size_t(most * I)));
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = offset_[e + 1] - offset_[e];
    if (n == 0) continue;
    const int32_t* tok = token_.data() + offset_[e];
    float* a = a_.data() + offset_[e] * I;
    float* b = b_.data() + offset_[e] * I;
    gather_rows(x, tok, n, D, gathered_.data());
    linear_forward(gathered_.data(), n, D, p_.w1[e]->value.f32(), I, a);
    linear_forward(gathered_.data(), n, D, p_.w3[e]->value.f32(), I, b);
    swiglu_forward(a, b, n * I, hidden_.data());
    linear_forward(hidden_.data(), n, I, p_.w2[e]->value.f32(), D, rows_out_.data());
    for (int64_t r = 0; r < n; ++r) {
      const float w = weights_[slot_[offset_[e] + r]];
      float* yt = y + int64_t(tok[r]) * D;
      const float* o = rows_out_.data() + r * D;
      for (int64_t d = 0; d < D; ++d) yt[d] += w * o[d];
    }
  }
  rows_ = rows;
}

void MoeLayer::backward(const float* dy, float* dx) {
  require(rows_ >= 0, "MoeLayer::backward: no forward pass to differentiate");
  const int64_t rows = rows_;
  if (rows == 0) return;
  require(dy && dx, "MoeLayer::backward: null gradient buffer");
  const int64_t D = D_, I = I_, E = E_, K = K_, pairs = rows * K;
  const float* x = x_.data();

  // Shared expert: writes dx.
  if (Is_ > 0) {
    const int64_t n = rows * Is_;
    hidden_.resize(std::max(hidden_.size(), size_t(n)));
    grad_h_.resize(std::max(grad_h_.size(), size_t(n)));
    grad_a_.resize(std::max(grad_a_.size(), size_t(n)));
    grad_b_.resize(std::max(grad_b_.size(), size_t(n)));
    swiglu_forward(shared_a_.data(), shared_b_.data(), n, hidden_.data());
    linear_backward(hidden_.data(), dy, rows, Is_, p_.shared_down->value.f32(), D, grad_h_.data(),
                    p_.shared_down->grad.f32());
    swiglu_backward(shared_a_.data(), shared_b_.data(), grad_h_.data(), n, grad_a_.data(),
                    grad_b_.data());
    linear_backward(x, grad_a_.data(), rows, D, p_.shared_gate->value.f32(), Is_, dx,
                    p_.shared_gate->grad.f32());
    linear_backward(x, grad_b_.data(), rows, D, p_.shared_up->value.f32(), Is_, dx,
                    p_.shared_up->grad.f32(), /*accumulate_dx=*/true);
  } else {
    std::fill_n(dx, rows * D, 0.0f);
  }

  // Routed experts, one GEMM per expert over its tokens. With g = dy W2 (unweighted):
  // d weight = g . h, dh = weight * g, dW2 += (weight * dy)^T h.
  int64_t most = 0;
  for (int64_t e = 0; e < E; ++e) most = std::max<int64_t>(most, offset_[e + 1] - offset_[e]);
  gathered_.resize(size_t(most * D));
  rows_out_.resize(size_t(most * D));
  for (auto* v : {&hidden_, &grad_h_, &grad_a_, &grad_b_})
    v->resize(std::max(v->size(), size_t(most * I)));
  dweights_.resize(size_t(pairs));
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = offset_[e + 1] - offset_[e];
    if (n == 0) continue;
    const int32_t* tok = token_.data() + offset_[e];
    const int32_t* slot = slot_.data() + offset_[e];
    const float* a = a_.data() + offset_[e] * I;
    const float* b = b_.data() + offset_[e] * I;
    float* h = hidden_.data();
    float* g = grad_h_.data();
    float* dyg = rows_out_.data();
    swiglu_forward(a, b, n * I, h);
    gather_rows(dy, tok, n, D, dyg);
    gemm_nn(int(n), int(I), int(D), 1.0f, dyg, int(D), p_.w2[e]->value.f32(), int(I), 0.0f, g,
            int(I));
    for (int64_t r = 0; r < n; ++r) {
      const float w = weights_[slot[r]];
      double dot = 0;
      for (int64_t i = 0; i < I; ++i) dot += double(g[r * I + i]) * h[r * I + i];
      dweights_[slot[r]] = float(dot);
      for (int64_t d = 0; d < D; ++d) dyg[r * D + d] *= w;
      for (int64_t i = 0; i < I; ++i) g[r * I + i] *= w;
    }
    gemm_tn(int(D), int(I), int(n), 1.0f, dyg, int(D), h, int(I), 1.0f, p_.w2[e]->grad.f32(),
            int(I));
    swiglu_backward(a, b, g, n * I, grad_a_.data(), grad_b_.data());
    gather_rows(x, tok, n, D, gathered_.data());
    float* dxe = rows_out_.data();  // dyg is no longer needed
    linear_backward(gathered_.data(), grad_a_.data(), n, D, p_.w1[e]->value.f32(), I, dxe,
                    p_.w1[e]->grad.f32());
    linear_backward(gathered_.data(), grad_b_.data(), n, D, p_.w3[e]->value.f32(), I, dxe,
                    p_.w3[e]->grad.f32(), /*accumulate_dx=*/true);
    for (int64_t r = 0; r < n; ++r) {
      float* dxt = dx + int64_t(tok[r]) * D;
      const float* src = dxe + r * D;
      for (int64_t d = 0; d < D; ++d) dxt[d] += src[d];
    }
  }

  // Router: w_j = c s_j / (S + 1e-20) with S = sum_j s_j (or c s_j), s = sigmoid(logit).
  // Only the selected experts' logits get a gradient; the selection itself has none.
  logits_.assign(size_t(rows * E), 0.0f);  // now d logits
  const double c = routing_.scaling;
  for (int64_t t = 0; t < rows; ++t) {
    const float* s = score_.data() + t * K;
    const float* dw = dweights_.data() + t * K;
    double sum = 0, dot = 0;
    for (int64_t j = 0; j < K; ++j) {
      sum += s[j];
      dot += double(dw[j]) * s[j];
    }
    const double inv = 1.0 / (sum + 1e-20);
    for (int64_t j = 0; j < K; ++j) {
      const double ds =
          routing_.renormalize ? c * inv * (double(dw[j]) - dot * inv) : c * double(dw[j]);
      logits_[t * E + ids_[t * K + j]] = float(ds * s[j] * (1.0 - s[j]));
    }
  }
  linear_backward(x, logits_.data(), rows, D, p_.router->value.f32(), E, dx, p_.router->grad.f32(),
                  /*accumulate_dx=*/true);
}

void MoeLayer::update_bias(float rate) {
  require(std::isfinite(rate) && rate >= 0, "MoeLayer::update_bias: rate must be finite and >= 0");
  int64_t total = 0;
  for (int64_t l : load_) total += l;
  const double mean = double(total) / double(E_);
  float* bias = p_.bias->value.f32();
  for (int64_t e = 0; e < E_; ++e) {
    const double gap = mean - double(load_[e]);
    bias[e] += rate * float((gap > 0) - (gap < 0));
  }
  std::fill(load_.begin(), load_.end(), 0);
}

}  // namespace kda::train
