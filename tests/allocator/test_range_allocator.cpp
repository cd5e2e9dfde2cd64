#include <gtest/gtest.h>

#include "torpor/error.hpp"
#include "torpor/host_driver.hpp"
#include "torpor/host_store.hpp"
#include "torpor/range_allocator.hpp"

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

TEST(HostStore, ReserveMakesOneBlockAndReuseDoesNotGrow) {
  HostDriver d;
  HostStore s(d);
  s.reserve(3 * HostStore::reserved_size(1000));
  EXPECT_EQ(s.growths(), 1u);
  std::byte* a = s.allocate(1000);
  std::byte* b = s.allocate(1000);
  std::byte* c = s.allocate(1000);
  EXPECT_EQ(s.growths(), 1u);
  s.free(a, HostStore::reserved_size(1000));
  s.free(b, HostStore::reserved_size(1000));
  s.free(c, HostStore::reserved_size(1000));
  s.reserve(3 * HostStore::reserved_size(1000));
  EXPECT_EQ(s.growths(), 1u) << "the second identical cycle reuses the block";
  EXPECT_GT(s.release_unused(), 0u);
  EXPECT_EQ(s.blocks(), 0u);
  EXPECT_EQ(d.counters().host_bytes, 0u);
}

}  // namespace
}  // namespace torpor
