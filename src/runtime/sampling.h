// Picking the next token from logits: greedy (argmax), or sampling at a temperature from the
// top-k and/or nucleus (top-p) candidates. No repetition penalty or other history: the choice
// depends only on the logits, the settings and the seeded generator, so a seed reproduces a run
// exactly (the generator's stream is defined by mt19937_64 alone, on every platform).
#pragma once
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "core/random.h"

namespace kda::runtime {

struct SamplingParams {
  float temperature = 0;  // 0: greedy
  int64_t top_k = 0;      // keep the k most likely tokens; 0: all
  float top_p = 1;        // keep the smallest most-likely set whose probability reaches p
  uint64_t seed = 0;

  bool greedy() const { return temperature == 0 || top_k == 1; }
  // Throws kda::Error for a negative or non-finite temperature, top_k < 0, top_p outside (0, 1].
  void validate() const;
};

// Index of the largest logit (the first on ties, as torch.argmax); NaN logits are skipped.
int32_t argmax(std::span<const float> logits);

// The tokens sampling may pick and their probabilities (summing to 1), most likely first (ties:
// lower id first): softmax(logits / temperature), cut to top_k, then to the smallest prefix
// whose probability reaches top_p, renormalised. Greedy settings give the argmax alone.
std::vector<std::pair<int32_t, float>> candidates(std::span<const float> logits,
                                                  const SamplingParams& params);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  int32_t sample(std::span<const float> logits);
  const SamplingParams& params() const { return params_; }

 private:
  double uniform();  // [0, 1) from 53 bits of the generator
  SamplingParams params_;
  Random random_;
};

}  // namespace kda::runtime
