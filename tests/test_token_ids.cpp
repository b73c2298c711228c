#include "core/token_ids.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.h"
#include "error_of.h"

namespace kda {
namespace {

using kda::testing::error_of;

TEST(TokenIds, AcceptTheWholeRangeAndNameTheFirstOutsider) {
  const std::vector<int32_t> ok{0, 1, 6, 7};
  EXPECT_NO_THROW(require_token_ids(ok, 8, "m"));
  EXPECT_EQ(error_of([] {
              require_token_ids(std::vector<int32_t>{3, 8, 9}, 8, "m");
            }),
            "m: token id 8 is outside the vocabulary [0, 8)");
  EXPECT_EQ(error_of([] { require_token_ids(std::vector<int32_t>{-1}, 8, "m"); }),
            "m: token id -1 is outside the vocabulary [0, 8)");
}

TEST(TokenIds, TargetsAllowMinusOneOnly) {
  EXPECT_NO_THROW(require_targets(std::vector<int32_t>{-1, 0, 7}, 8, "m"));
  EXPECT_EQ(error_of([] {
              require_targets(std::vector<int32_t>{-1, -2}, 8, "m");
            }),
            "m: target -2 is outside the vocabulary [0, 8) (or -1)");
  EXPECT_EQ(error_of([] { require_targets(std::vector<int32_t>{8}, 8, "m"); }),
            "m: target 8 is outside the vocabulary [0, 8) (or -1)");
}

}  // namespace
}  // namespace kda
