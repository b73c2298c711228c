// Seeded random fills for tests, benchmarks and synthetic data.
#pragma once
#include <cstdint>
#include <random>
#include <span>

namespace kda {

class Random {
 public:
  explicit Random(uint64_t seed) : engine_(seed) {}
  float normal() { return normal_(engine_); }
  float uniform(float lo, float hi) { return lo + (hi - lo) * uniform_(engine_); }
  int64_t integer(int64_t lo, int64_t hi_inclusive) {
    return std::uniform_int_distribution<int64_t>(lo, hi_inclusive)(engine_);
  }
  void fill_normal(std::span<float> out, float stddev = 1.0f) {
    for (float& x : out) x = stddev * normal();
  }
  void fill_uniform(std::span<float> out, float lo, float hi) {
    for (float& x : out) x = uniform(lo, hi);
  }
  std::mt19937_64& engine() { return engine_; }

 private:
  std::mt19937_64 engine_;
  std::normal_distribution<float> normal_{0.0f, 1.0f};
  std::uniform_real_distribution<float> uniform_{0.0f, 1.0f};
};

}  // namespace kda
