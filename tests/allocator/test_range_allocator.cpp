#include <gtest/gtest.h>

#include <cstring>

#include "pool/host_store.hpp"
#include "pool/range_allocator.hpp"
#include "torpor/error.hpp"
#include "torpor/host_driver.hpp"

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
  HostSpan a = s.allocate(1000);
  HostSpan b = s.allocate(1000);
  HostSpan c = s.allocate(1000);
  EXPECT_EQ(s.growths(), 1u);
  EXPECT_TRUE(a.pinned);
  EXPECT_EQ(a.bytes, HostStore::reserved_size(1000));
  s.free(a.ptr, a.bytes);
  s.free(b.ptr, b.bytes);
  s.free(c.ptr, c.bytes);
  s.reserve(3 * HostStore::reserved_size(1000));
  EXPECT_EQ(s.growths(), 1u) << "the second identical cycle reuses the block";
  EXPECT_GT(s.release_unused(), 0u);
  EXPECT_EQ(s.blocks(), 0u);
  EXPECT_EQ(d.counters().host_bytes, 0u);
}

TEST(HostStore, BeyondThePinnedLimitSpansArePageable) {
  HostDriver d;
  constexpr std::size_t MiB = std::size_t{1} << 20;
  HostStore s(d, 4 * MiB);
  s.reserve(10 * MiB);
  EXPECT_EQ(s.pinned_capacity(), 4 * MiB);
  EXPECT_GE(s.capacity(), 10 * MiB);
  EXPECT_EQ(d.counters().host_bytes, 4 * MiB) << "only the pinned tier comes from the driver";
  HostSpan a = s.allocate(3 * MiB);
  HostSpan b = s.allocate(3 * MiB);
  EXPECT_TRUE(a.pinned);
  EXPECT_FALSE(b.pinned);
  std::memset(b.ptr, 7, 3 * MiB);
  s.free(a.ptr, a.bytes);
  s.free(b.ptr, b.bytes);
  std::size_t held = s.capacity();
  EXPECT_EQ(s.release_unused(), held);
  EXPECT_EQ(s.blocks(), 0u);
  EXPECT_EQ(d.counters().host_bytes, 0u);
}

}  // namespace
}  // namespace torpor
