#include "train/adamw.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "core/error.h"

namespace kda::train {

AdamW::AdamW(std::vector<Param*> params, const AdamWConfig& config)
    : params_(std::move(params)), config_(config) {
  require(config.lr > 0 && config.total_steps >= 1, "adamw: lr and total_steps must be positive");
  for (Param* p : params_) {
    m_.emplace_back(p->value.numel(), 0.0f);
    v_.emplace_back(p->value.numel(), 0.0f);
  }
}

float scheduled_lr(const AdamWConfig& c, int64_t step) {
  if (step < c.warmup_steps) return c.lr * float(step + 1) / float(c.warmup_steps);
  const double span = std::max<int64_t>(1, c.total_steps - c.warmup_steps);
  const double progress = std::min(1.0, double(step - c.warmup_steps) / span);
  const double cosine = 0.5 * (1.0 + std::cos(M_PI * progress));
  return float(c.lr * (c.min_lr_ratio + (1.0 - c.min_lr_ratio) * cosine));
}

std::vector<std::pair<std::string, Tensor>> AdamW::state() const {
  std::vector<std::pair<std::string, Tensor>> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    for (const auto& [prefix, source] :
         {std::pair{std::string("m."), &m_[i]}, std::pair{std::string("v."), &v_[i]}}) {
      Tensor t(DType::f32, params_[i]->value.shape());
      std::copy(source->begin(), source->end(), t.f32());
      out.emplace_back(prefix + params_[i]->name, std::move(t));
    }
  }
  return out;
}

void AdamW::load_state(const std::vector<std::pair<std::string, Tensor>>& tensors, int64_t step) {
  std::map<std::string, const Tensor*> by_name;
  for (const auto& [name, t] : tensors) by_name[name] = &t;
  for (size_t i = 0; i < params_.size(); ++i) {
    for (const auto& [prefix, target] :
         {std::pair{std::string("m."), &m_[i]}, std::pair{std::string("v."), &v_[i]}}) {
      const auto it = by_name.find(prefix + params_[i]->name);
      require(it != by_name.end(), "optimizer state lacks '" + prefix + params_[i]->name + "'");
      require(it->second->shape() == params_[i]->value.shape(),
              "optimizer state '" + prefix + params_[i]->name + "' has the wrong shape");
      std::copy(it->second->f32(), it->second->f32() + it->second->numel(), target->begin());
    }
  }
  step_ = step;
}

double AdamW::step() {
  double norm2 = 0;
  for (Param* p : params_)
    for (float g : p->grad.span_f32()) norm2 += double(g) * g;
  const double norm = std::sqrt(norm2);
  require(std::isfinite(norm), "adamw: the gradient is not finite");
  const float clip =
      config_.clip_norm > 0 && norm > config_.clip_norm ? float(config_.clip_norm / norm) : 1.0f;
  const float lr = lr_at(step_);
  ++step_;
  const float b1 = config_.beta1, b2 = config_.beta2;
  const float c1 = 1.0f - std::pow(b1, float(step_)), c2 = 1.0f - std::pow(b2, float(step_));
  for (size_t i = 0; i < params_.size(); ++i) {
    Param* p = params_[i];
    float* w = p->value.f32();
    const float* g = p->grad.f32();
    float* m = m_[i].data();
    float* v = v_[i].data();
    const float decay = p->decay ? lr * config_.weight_decay : 0.0f;
    for (int64_t j = 0; j < p->value.numel(); ++j) {
      const float gj = g[j] * clip;
      m[j] = b1 * m[j] + (1.0f - b1) * gj;
      v[j] = b2 * v[j] + (1.0f - b2) * gj * gj;
      w[j] -= decay * w[j];
      w[j] -= lr * (m[j] / c1) / (std::sqrt(v[j] / c2) + config_.eps);
    }
  }
  return norm;
}

}  // namespace kda::train
