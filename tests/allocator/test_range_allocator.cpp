#include <gtest/gtest.h>

#include "common/range_allocator.hpp"
#include "torpor/error.hpp"

namespace torpor {
namespace {

TEST(RangeAllocator, FirstFitAlignmentAndCoalescing) {
  RangeAllocator r(4096);
  auto a = r.allocate(100, 256);
  auto b = r.allocate(100, 256);
  ASSERT_TRUE(a && b);
  EXPECT_EQ(*a, 0u);
  EXPECT_EQ(*b, 256u);
  EXPECT_EQ(r.used_bytes(), 200u);
  r.free(*a, 100);
  r.free(*b, 100);
  EXPECT_TRUE(r.unused());
  EXPECT_EQ(r.largest_free(), 4096u);
  EXPECT_FALSE(r.allocate(4097, 1));
}

TEST(RangeAllocator, FreeingASubRangeSplitsAndDoubleFreeIsCaught) {
  RangeAllocator r(1024);
  auto a = r.allocate(1024, 1);
  ASSERT_TRUE(a);
  r.free(100, 200);
  EXPECT_EQ(r.free_bytes(), 200u);
  EXPECT_THROW(r.free(150, 10), error);
  auto again = r.allocate(200, 1);
  ASSERT_TRUE(again);
  EXPECT_EQ(*again, 100u);
}

}  // namespace
}  // namespace torpor
