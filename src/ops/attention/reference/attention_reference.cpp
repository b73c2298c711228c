// Ground truth for causal softmax attention: float64, one query row at a time, scores
// materialised. Also the shape checks and the FLOP count shared by every attention path.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "ops/attention/attention.h"
#include "ops/common/sequences.h"

namespace kda::ops {

double AttentionShape::effective_scale() const {
  return scale != 0 ? scale : 1.0 / std::sqrt(double(D));
}

void AttentionShape::validate() const {
  require(B >= 1 && T >= 1 && H >= 1 && HKV >= 1 && D >= 1 && DV >= 1,
          "attention: sizes must be positive (B=" + std::to_string(B) + " T=" + std::to_string(T) +
              " H=" + std::to_string(H) + " HKV=" + std::to_string(HKV) +
              " D=" + std::to_string(D) + " DV=" + std::to_string(DV) + ")");
  require(H % HKV == 0, "attention: query heads H = " + std::to_string(H) +
                            " must be a multiple of key/value heads HKV = " + std::to_string(HKV));
  require(std::isfinite(scale), "attention: scale is not finite");
}

double attention_forward_flops(const AttentionShape& shape, std::span<const int64_t> cu_seqlens) {
  shape.validate();
  const SequenceLayout layout(shape.B, shape.T, cu_seqlens);
  double pairs = 0;  // (query, visible key) pairs summed over sequences
  for (int64_t n = 0; n < layout.num_sequences(); ++n) {
    const double L = double(layout.length(n));
    pairs += L * (L + 1) / 2;
  }
  return 2.0 * pairs * double(shape.H) * double(shape.D + shape.DV);
}

void attention_reference(const AttentionInputs<double>& in, double* o, double* lse) {
  const AttentionShape& s = in.shape;
  s.validate();
  const SequenceLayout layout(s.B, s.T, in.cu_seqlens);
  require(in.q && in.k && in.v && o, "attention_reference: q, k, v and o must not be null");
  const int64_t tokens = layout.total_tokens();
  require_finite(in.q, tokens * s.H * s.D, "attention_reference: q");
  require_finite(in.k, tokens * s.HKV * s.D, "attention_reference: k");
  require_finite(in.v, tokens * s.HKV * s.DV, "attention_reference: v");

  const double scale = s.effective_scale();
  const int64_t group = s.group_size();
  auto one_head = [&](int64_t item) {
    const int64_t n = item / s.H, h = item % s.H, hk = h / group;
    const int64_t start = layout.start(n), length = layout.length(n);
    std::vector<double> scores(size_t(length), 0.0), out(size_t(s.DV));
    for (int64_t i = 0; i < length; ++i) {
      const double* qi = in.q + ((start + i) * s.H + h) * s.D;
      double max_score = -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j <= i; ++j) {
        const double* kj = in.k + ((start + j) * s.HKV + hk) * s.D;
        double dot = 0;
        for (int64_t d = 0; d < s.D; ++d) dot += qi[d] * kj[d];
        scores[j] = scale * dot;
        max_score = std::max(max_score, scores[j]);
      }
      double sum = 0;
      std::fill(out.begin(), out.end(), 0.0);
      for (int64_t j = 0; j <= i; ++j) {
        const double p = std::exp(scores[j] - max_score);
        sum += p;
        const double* vj = in.v + ((start + j) * s.HKV + hk) * s.DV;
        for (int64_t e = 0; e < s.DV; ++e) out[e] += p * vj[e];
      }
      double* oi = o + ((start + i) * s.H + h) * s.DV;
      for (int64_t e = 0; e < s.DV; ++e) oi[e] = out[e] / sum;
      if (lse) lse[(start + i) * s.H + h] = max_score + std::log(sum);
    }
  };
  attention_detail::for_each_item(layout.num_sequences() * s.H,
                                  attention_forward_flops(s, in.cu_seqlens), one_head);
}

}  // namespace kda::ops
