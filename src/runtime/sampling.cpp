#include "runtime/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "core/error.h"

namespace kda::runtime {

void SamplingParams::validate() const {
  require(std::isfinite(temperature) && temperature >= 0,
          "sampling: temperature must be >= 0, got " + std::to_string(temperature));
  require(top_k >= 0, "sampling: top-k must be >= 0 (0: off), got " + std::to_string(top_k));
  require(std::isfinite(top_p) && top_p > 0 && top_p <= 1,
          "sampling: top-p must be in (0, 1], got " + std::to_string(top_p));
}

int32_t argmax(std::span<const float> logits) {
  require(!logits.empty(), "argmax: no logits");
  int64_t best = -1;
  for (size_t i = 0; i < logits.size(); ++i) {
    if (std::isnan(logits[i])) continue;
    if (best < 0 || logits[i] > logits[size_t(best)]) best = int64_t(i);
  }
  require(best >= 0, "argmax: every logit is NaN");
  return int32_t(best);
}

std::vector<std::pair<int32_t, float>> candidates(std::span<const float> logits,
                                                  const SamplingParams& params) {
  params.validate();
  if (params.greedy()) return {{argmax(logits), 1.0f}};
  const int64_t n = int64_t(logits.size());
  for (const float x : logits) require(!std::isnan(x), "sampling: the logits contain NaN");
  const float top = logits[size_t(argmax(logits))];
  require(std::isfinite(top), "sampling: the largest logit is not finite");

  // Softmax at the temperature, relative to the largest logit (which gets weight 1).
  std::vector<double> weight(static_cast<size_t>(n));
  const double inv_temperature = 1.0 / double(params.temperature);
  for (int64_t i = 0; i < n; ++i)
    weight[size_t(i)] = std::exp((double(logits[size_t(i)]) - top) * inv_temperature);

  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  const auto more_likely = [&](int32_t a, int32_t b) {
    return weight[size_t(a)] != weight[size_t(b)] ? weight[size_t(a)] > weight[size_t(b)] : a < b;
  };
  int64_t kept = n;
  if (params.top_k > 0 && params.top_k < n) {
    kept = params.top_k;
    std::partial_sort(order.begin(), order.begin() + kept, order.end(), more_likely);
  } else {
    std::sort(order.begin(), order.end(), more_likely);
  }
  double total = 0;
  for (int64_t i = 0; i < kept; ++i) total += weight[size_t(order[size_t(i)])];
  if (params.top_p < 1) {
    const double target = double(params.top_p) * total;
    double sum = 0;
    int64_t reach = 0;
    while (reach < kept) {
      sum += weight[size_t(order[size_t(reach++)])];
      if (sum >= target) break;
    }
    kept = reach;
    total = sum;
  }
  std::vector<std::pair<int32_t, float>> out;
  out.reserve(size_t(kept));
  for (int64_t i = 0; i < kept; ++i) {
    const int32_t id = order[size_t(i)];
    if (weight[size_t(id)] == 0) break;  // underflowed: cannot be drawn
    out.emplace_back(id, float(weight[size_t(id)] / total));
  }
  return out;
}

Sampler::Sampler(const SamplingParams& params) : params_(params), random_(params.seed) {
  params_.validate();
}

double Sampler::uniform() {
  return double(random_.engine()() >> 11) * 0x1.0p-53;
}

int32_t Sampler::sample(std::span<const float> logits) {
  if (params_.greedy()) return argmax(logits);
  const std::vector<std::pair<int32_t, float>> pool = candidates(logits, params_);
  double u = uniform(), sum = 0;
  for (const auto& [id, p] : pool) {
    sum += p;
    if (u < sum) return id;
  }
  return pool.back().first;  // u within rounding of 1
}

}  // namespace kda::runtime
