#include "runtime/next_token_loss.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/error.h"

namespace kda::runtime {

double mean_next_token_loss(const Tensor& logits, std::span<const int32_t> ids) {
  require(logits.rank() == 2 && logits.dtype() == DType::f32,
          "mean_next_token_loss: logits must be [T, V] f32");
  const int64_t T = logits.dim(0), V = logits.dim(1);
  require(T >= 2 && size_t(T) == ids.size(),
          "mean_next_token_loss: needs T >= 2 logit rows, one per id (" + std::to_string(T) +
              " rows, " + std::to_string(ids.size()) + " ids)");
  double total = 0;
  for (int64_t t = 0; t + 1 < T; ++t) {
    const int32_t next = ids[size_t(t) + 1];
    require(next >= 0 && next < V, "mean_next_token_loss: token id " + std::to_string(next) +
                                       " outside the vocabulary of " + std::to_string(V));
    const float* row = logits.f32() + t * V;
    double top = row[0];
    for (int64_t v = 1; v < V; ++v) top = std::max(top, double(row[v]));
    double sum = 0;
    for (int64_t v = 0; v < V; ++v) sum += std::exp(double(row[v]) - top);
    total += top + std::log(sum) - double(row[next]);
  }
  return total / double(T - 1);
}

}  // namespace kda::runtime
