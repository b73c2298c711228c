// Sigmoid routing with a selection-only correction bias, optional expert groups, top-k.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "ops/moe/moe.h"

namespace kda::ops {

void MoeRouting::validate() const {
  require(num_experts >= 1, "moe routing: num_experts must be positive");
  require(top_k >= 1 && top_k <= num_experts, "moe routing: top_k " + std::to_string(top_k) +
                                                  " must lie in [1, num_experts " +
                                                  std::to_string(num_experts) + "]");
  require(num_groups >= 1 && num_experts % num_groups == 0,
          "moe routing: num_groups " + std::to_string(num_groups) + " must divide num_experts " +
              std::to_string(num_experts));
  require(topk_groups >= 1 && topk_groups <= num_groups,
          "moe routing: topk_groups must lie in [1, num_groups]");
  require(top_k <= topk_groups * (num_experts / num_groups),
          "moe routing: top_k is larger than the experts in the kept groups");
  require(num_groups == 1 || num_experts / num_groups >= 2,
          "moe routing: expert groups need at least two experts each");
  require(std::isfinite(scaling), "moe routing: scaling must be finite");
}

void moe_route_sigmoid(const MoeRouting& r, const float* logits, int64_t T, const float* bias,
                       int32_t* ids, float* weights) {
  r.validate();
  const int64_t E = r.num_experts, per_group = E / r.num_groups;
  constexpr float kExcluded = -std::numeric_limits<float>::infinity();
  // Per-thread buffers: a decode step routes one token and should not allocate.
  thread_local std::vector<float> score, choice, group_score;
  thread_local std::vector<int32_t> order;
  thread_local std::vector<char> kept;
  score.resize(E);
  choice.resize(E);
  group_score.resize(r.num_groups);
  order.resize(std::max(E, r.num_groups));
  kept.resize(r.num_groups);
  for (int64_t t = 0; t < T; ++t) {
    const float* lt = logits + t * E;
    for (int64_t e = 0; e < E; ++e) {
      require(std::isfinite(lt[e]), "moe routing: router logit is not finite");
      score[e] = 1.0f / (1.0f + std::exp(-lt[e]));
      choice[e] = score[e] + (bias ? bias[e] : 0.0f);
    }
    if (r.num_groups > 1) {
      for (int64_t g = 0; g < r.num_groups; ++g) {
        const float* c = choice.data() + g * per_group;
        float best = kExcluded, second = kExcluded;
        for (int64_t i = 0; i < per_group; ++i) {
          if (c[i] > best) {
            second = best;
            best = c[i];
          } else if (c[i] > second) {
            second = c[i];
          }
        }
        group_score[g] = best + second;
      }
      for (int64_t g = 0; g < r.num_groups; ++g) order[g] = int32_t(g);
      std::partial_sort(order.begin(), order.begin() + r.topk_groups, order.begin() + r.num_groups,
                        [&](int32_t a, int32_t b) {
                          return group_score[a] > group_score[b] ||
                                 (group_score[a] == group_score[b] && a < b);
                        });
      std::fill(kept.begin(), kept.end(), 0);
      for (int64_t g = 0; g < r.topk_groups; ++g) kept[order[g]] = 1;
      for (int64_t e = 0; e < E; ++e)
        if (!kept[e / per_group]) choice[e] = kExcluded;
    }
    for (int64_t e = 0; e < E; ++e) order[e] = int32_t(e);
    // Best first; ties go to the lower expert index.
    std::partial_sort(order.begin(), order.begin() + r.top_k, order.begin() + E,
                      [&](int32_t a, int32_t b) {
                        return choice[a] > choice[b] || (choice[a] == choice[b] && a < b);
                      });
    double sum = 0;
    for (int64_t j = 0; j < r.top_k; ++j) sum += score[order[j]];
    const double norm = r.renormalize ? r.scaling / (sum + 1e-20) : r.scaling;
    for (int64_t j = 0; j < r.top_k; ++j) {
      ids[t * r.top_k + j] = order[j];
      weights[t * r.top_k + j] = float(double(score[order[j]]) * norm);
    }
  }
}

}  // namespace kda::ops
