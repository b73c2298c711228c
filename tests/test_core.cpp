#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

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
