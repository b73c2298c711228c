#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/safetensors.h"
#include "core/tensor.h"
#include "scratch_dir.h"

namespace kda {
namespace {

TEST(Core, Bf16RoundTripAndRounding) {
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f)), 1.0f);
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(-2.5f)), -2.5f);
  // 1 + 2^-8 is halfway between two bf16 values: rounds to even (1.0)
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + std::ldexp(1.0f, -8))), 1.0f);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
}

TEST(Core, F16RoundTrip) {
  for (float x : {0.0f, 1.0f, -3.25f, 65504.0f, 6.1035156e-05f, 5.9604645e-08f}) {
    EXPECT_EQ(f16_to_f32(f32_to_f16(x)), x) << x;
  }
  EXPECT_TRUE(std::isinf(f16_to_f32(f32_to_f16(1e6f))));
}

uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// f32 -> bf16 by its definition, in double: the two bf16 values around x (x with its low 16
// bits cleared, and the next one away from zero), the nearer one, ties to the even mantissa,
// and infinity past the largest finite value's upper half-way point. Returns the bf16 bits.
uint16_t bf16_by_definition(float x) {
  const uint32_t u = bits_of(x);
  const uint32_t lo = u & 0xffff0000u;
  const int exponent = int((lo >> 23) & 0xff);
  // the spacing of bf16 values at lo's exponent (subnormals share the smallest one)
  const double ulp = std::ldexp(1.0, (exponent == 0 ? 1 : exponent) - 127 - 7);
  const double a = std::fabs(double(x)), below = std::fabs(double(float_of(lo))),
               above = below + ulp;
  const double to_below = a - below, to_above = above - a;
  bool up = to_above < to_below || (to_above == to_below && ((lo >> 16) & 1));
  return uint16_t((lo >> 16) + (up ? 1 : 0));  // the carry walks into the exponent (to inf)
}

TEST(Core, Bf16RoundingMatchesItsDefinition) {
  std::vector<float> xs = {0.0f,
                           -0.0f,
                           1.0f,
                           -2.5f,
                           1.0f + std::ldexp(1.0f, -8),
                           1.0f + 3 * std::ldexp(1.0f, -8),  // a tie that rounds up (odd)
                           std::numeric_limits<float>::max(),
                           -std::numeric_limits<float>::max(),
                           float_of(0x7f7f7fffu),
                           float_of(0x7f7f8000u),  // below / at max's tie
                           std::numeric_limits<float>::denorm_min(),
                           float_of(0x00018000u),
                           float_of(0x807f8000u),
                           std::numeric_limits<float>::min()};
  std::mt19937 rng(17);
  for (int i = 0; i < 2000000; ++i) xs.push_back(float_of(rng()));
  int64_t checked = 0;
  for (const float x : xs) {
    const uint16_t got = f32_to_bf16(x);
    if (std::isnan(x)) {
      // NaN stays NaN, whatever its payload (rounding a low-bit payload must not make inf)
      EXPECT_TRUE(std::isnan(bf16_to_f32(got))) << std::hex << bits_of(x);
      continue;
    }
    if (std::isinf(x)) {
      EXPECT_EQ(got, uint16_t(bits_of(x) >> 16)) << x;
      continue;
    }
    ASSERT_EQ(got, bf16_by_definition(x)) << std::hex << "f32 bits " << bits_of(x);
    EXPECT_EQ(bits_of(bf16_to_f32(got)), uint32_t(got) << 16);
    ++checked;
  }
  EXPECT_GT(checked, 1000000);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(float_of(0x7f800001u)))));  // low payload
  EXPECT_TRUE(std::isinf(bf16_to_f32(f32_to_bf16(float_of(0x7f7f8000u)))));  // max's tie: inf
}

#ifdef __FLT16_MAX__
// f16 both ways against the compiler's _Float16 (IEEE binary16, round to nearest even): every
// half value, and f32 values at random, at the edges (65504, 65519 / 65520, subnormals, ties).
TEST(Core, F16MatchesTheCompilersFloat16) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t bits = uint16_t(h);
    _Float16 ref;
    std::memcpy(&ref, &bits, 2);
    const float want = float(ref), got = f16_to_f32(bits);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << h;
    } else {
      ASSERT_EQ(bits_of(got), bits_of(want)) << "f16 bits " << h;
    }
  }
  std::vector<float> xs = {65504.0f,
                           65519.0f,
                           65520.0f,
                           -65520.0f,
                           1e6f,
                           5.9604645e-08f,
                           2.9802322e-08f,
                           2.9802323e-08f,
                           8.940697e-08f,
                           6.1035156e-05f,
                           6.1031431e-05f,
                           1.0f + std::ldexp(1.0f, -11),
                           1.0f + 3 * std::ldexp(1.0f, -11),
                           -0.0f,
                           0.0f,
                           INFINITY,
                           -INFINITY};
  std::mt19937 rng(19);
  for (int i = 0; i < 2000000; ++i) xs.push_back(float_of(rng()));
  std::uniform_real_distribution<float> in_range(-70000.0f, 70000.0f);
  for (int i = 0; i < 1000000; ++i) xs.push_back(in_range(rng));
  for (const float x : xs) {
    const uint16_t got = f32_to_f16(x);
    if (std::isnan(x)) {
      EXPECT_TRUE(std::isnan(f16_to_f32(got))) << std::hex << bits_of(x);
      continue;
    }
    const _Float16 ref = _Float16(x);
    uint16_t want;
    std::memcpy(&want, &ref, 2);
    ASSERT_EQ(got, want) << std::hex << "f32 bits " << bits_of(x) << " (" << x << ")";
  }
}
#endif

TEST(Safetensors, WriteThenReadRoundTrip) {
  const kda::testing::ScratchDir scratch;  // this test's own folder
  const std::filesystem::path path = scratch.file("kda_test_roundtrip.safetensors");
  Tensor a = Tensor::filled({2, 3}, 1.5f);
  a.f32()[4] = -7.0f;
  Tensor b = Tensor::filled({4}, 2.0f).to(DType::bf16);
  write_safetensors(path.string(), {{"a", &a}, {"b", &b}}, {{"op", "\"kda\""}});
  const SafetensorsFile file = SafetensorsFile::open(path.string());
  EXPECT_EQ(file.names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(file.metadata().at("op"), "\"kda\"");
  const Tensor a2 = file.load("a");
  ASSERT_EQ(a2.shape(), a.shape());
  EXPECT_EQ(a2.f32()[4], -7.0f);
  EXPECT_EQ(file.view("b").dtype, DType::bf16);
  EXPECT_EQ(file.load("b").f32()[3], 2.0f);
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace kda
