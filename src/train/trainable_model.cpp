#include "train/trainable_model.h"

#include <algorithm>

#include "core/error.h"
#include "train/adamw.h"

namespace kda::train {

int64_t TrainableModel::num_params() {
  int64_t n = 0;
  for (const Param* p : params()) n += p->value.numel();
  return n;
}

void TrainableModel::zero_grad() {
  for (Param* p : params())
    for (float& g : p->grad.span_f32()) g = 0.0f;
}

void TrainableModel::scale_grads(float s) {
  for (Param* p : params())
    for (float& g : p->grad.span_f32()) g *= s;
}

std::unique_ptr<Optimizer> TrainableModel::make_optimizer(const AdamWConfig& config) {
  return std::make_unique<AdamW>(params(), config);
}

std::vector<int64_t> document_segments(std::span<const int64_t> cu_seqlens, int64_t B, int64_t T,
                                       const std::string& who) {
  std::vector<int64_t> segments;
  if (cu_seqlens.empty()) {
    for (int64_t r = 0; r <= B; ++r) segments.push_back(r * T);
    return segments;
  }
  require(cu_seqlens.size() >= 2 && cu_seqlens.front() == 0 && cu_seqlens.back() == B * T,
          who + ": cu_seqlens must start at 0 and end at B * T");
  for (size_t i = 1; i < cu_seqlens.size(); ++i)
    require(cu_seqlens[i] > cu_seqlens[i - 1], who + ": cu_seqlens must increase strictly");
  for (int64_t r = 1; r < B; ++r)
    require(std::binary_search(cu_seqlens.begin(), cu_seqlens.end(), r * T),
            who + ": cu_seqlens must hold every row start r * T");
  segments.assign(cu_seqlens.begin(), cu_seqlens.end());
  return segments;
}

}  // namespace kda::train
