#include "train/trainable_model.h"

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

}  // namespace kda::train
