// Hostile input at the allocator's edges (issue 19): sizes that wrap, tags JSON cannot carry,
// a copy racing another pool's sleep, an allocation that fits but not in a slab, and fds that are
// not what their exporter announced. Each must be refused with a typed error, never crash, and
// leave the pool usable.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "torpor/error.hpp"
#include "torpor/host_driver.hpp"
#include "torpor/pool.hpp"
#include "torpor/torpor.h"

namespace torpor {
namespace {

constexpr std::size_t KiB = 1024, MiB = 1024 * KiB;

HostDriverOptions host(std::size_t device_bytes) {
  HostDriverOptions o;
  o.devices = 1;
  o.device_bytes = device_bytes;
  o.granularity = 64 * KiB;
  return o;
}

PoolOptions small_va() {
  PoolOptions o;
  o.va_bytes = 256 * MiB;
  return o;
}

// Item 3: a size that wraps the address space is refused, not a SIGSEGV.
TEST(HostileInput, ACopyOfAHugeSizeIsRefusedNotACrash) {
  torpor_pool_options o;
  torpor_pool_options_init(&o);
  o.backend = TORPOR_BACKEND_HOST;
  o.va_bytes = 64 * MiB;
  torpor_pool_t pool = nullptr;
  ASSERT_EQ(torpor_pool_create(&o, &pool), TORPOR_OK) << torpor_last_error();
  void *a = nullptr, *b = nullptr;
  ASSERT_EQ(torpor_alloc(pool, 4096, "default", TORPOR_CLASS_STATE, "a", &a), TORPOR_OK);
  ASSERT_EQ(torpor_alloc(pool, 4096, "default", TORPOR_CLASS_STATE, "b", &b), TORPOR_OK);
  for (std::size_t n : {std::numeric_limits<std::size_t>::max(), std::numeric_limits<std::size_t>::max() - 4095}) {
    EXPECT_EQ(torpor_copy(pool, a, b, n), TORPOR_ERROR_INVALID_ARGUMENT) << n;
    EXPECT_NE(std::string(torpor_last_error()).find("wraps"), std::string::npos) << torpor_last_error();
  }
  // Not wrapping but far past the allocation: the unmapped part is found before any byte moves.
  EXPECT_NE(torpor_copy(pool, a, b, std::size_t{1} << 40), TORPOR_OK);
  std::memset(b, 7, 4096);
  EXPECT_EQ(torpor_copy(pool, a, b, 4096), TORPOR_OK) << "the pool stays usable";
  EXPECT_EQ(static_cast<unsigned char*>(a)[4095], 7);
  EXPECT_EQ(torpor_pool_destroy(pool), TORPOR_OK);
}

TEST(HostileInput, TheHostDriversRangeCheckDoesNotWrap) {
  HostDriver d(host(16 * MiB));
  Stream s = d.stream_create(0);
  device_ptr va = d.reserve(64 * KiB, 64 * KiB);
  PhysicalHandle h = d.create(0, 64 * KiB, false);
  d.map(va, 64 * KiB, h, 0);
  int devs[] = {0};
  d.set_access(va, 64 * KiB, devs);
  std::vector<char> buf(64);
  EXPECT_THROW(d.copy_async(buf.data(), reinterpret_cast<void*>(va), std::numeric_limits<std::size_t>::max(), s),
               driver_error);
  EXPECT_THROW(d.fill_async(va, 1, std::numeric_limits<std::size_t>::max() - 10, s), driver_error);
  d.unmap(va, 64 * KiB);
  d.release(h);
  d.free_reservation(va, 64 * KiB);
  d.stream_destroy(s);
}

// Item 4: a tag JSON cannot carry is refused at allocation; stats keep working.
TEST(HostileInput, ATagThatIsNotValidUtf8IsRefusedAtAllocation) {
  auto d = std::make_shared<HostDriver>(host(64 * MiB));
  Pool pool(*d, small_va());
  const std::string bad[] = {"w\xff", std::string("w\0x", 3), "\xed\xa0\x80", "\xc0\x80", "", std::string(1025, 'a')};
  for (const auto& tag : bad) {
    AllocationOptions o;
    o.tag = tag;
    EXPECT_THROW(pool.allocate(4096, o), invalid_argument) << "tag of " << tag.size() << " bytes";
  }
  AllocationOptions ok;
  ok.tag = "w\xc3\xa9";  // "wé": valid UTF-8 is fine
  void* p = pool.allocate(4096, ok);
  EXPECT_NO_THROW(pool.sleep(SleepLevel::discard_parameters));
  EXPECT_NO_THROW(pool.wake_up());
  EXPECT_NO_THROW((void)to_json(pool.stats()));
  EXPECT_NE(to_json(pool.stats()).find("w\xc3\xa9"), std::string::npos);
  pool.deallocate(p);
  EXPECT_THROW(pool.set_preserve({std::string("a\0b", 3)}), invalid_argument);
}

TEST(HostileInput, TheCApiRefusesBadTagsAndCountsNamingTheRange) {
  torpor_pool_options o;
  torpor_pool_options_init(&o);
  o.backend = TORPOR_BACKEND_HOST;
  o.va_bytes = 64 * MiB;
  torpor_pool_t pool = nullptr;
  ASSERT_EQ(torpor_pool_create(&o, &pool), TORPOR_OK) << torpor_last_error();
  void* p = nullptr;
  EXPECT_EQ(torpor_alloc(pool, 4096, "w\xff", TORPOR_CLASS_STATE, "x", &p), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(torpor_last_error()).find("UTF-8"), std::string::npos) << torpor_last_error();
  ASSERT_EQ(torpor_alloc(pool, 4096, "weights", TORPOR_CLASS_STATE, "x", &p), TORPOR_OK);
  const char* tags[] = {"weights"};
  EXPECT_EQ(torpor_sleep(pool, 1, tags, static_cast<size_t>(-1)), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(torpor_last_error()).find("[0, 65536]"), std::string::npos) << torpor_last_error();
  EXPECT_EQ(torpor_sleep(pool, 3, tags, 1), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(torpor_sleep(pool, 1, tags, 1), TORPOR_OK) << "sleep and wake of a valid tag report no error";
  EXPECT_EQ(torpor_wake_up(pool, tags, 1), TORPOR_OK) << torpor_last_error();
  size_t needed = 0;
  EXPECT_EQ(torpor_stats_json(pool, nullptr, 0, &needed), TORPOR_OK);
  EXPECT_EQ(torpor_pool_destroy(pool), TORPOR_OK);

  o.va_bytes = std::numeric_limits<std::size_t>::max();
  EXPECT_EQ(torpor_pool_create(&o, &pool), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(torpor_last_error()).find("is outside [0, "), std::string::npos)
      << "not 'size 0' after a wrap: " << torpor_last_error();
}

// Item 12: a copy through pool A into memory of pool B, while B goes to sleep, either finishes
// before the unmap or is refused: it never touches an unmapped page.
TEST(HostileInput, ACopyRacingAnotherPoolsSleepNeverFaults) {
  auto d = std::make_shared<HostDriver>(host(256 * MiB));
  Pool a(*d, small_va()), b(*d, small_va());
  const std::size_t n = 8 * MiB;
  AllocationOptions big;
  big.dedicated = true;
  void* src = a.allocate(n, big);
  big.memory_class = MemoryClass::cache;  // discarded at sleep: the race, not copies, is timed
  void* dst = b.allocate(n, big);
  std::atomic<bool> stop{false};
  std::atomic<int> copies{0}, refused{0};
  std::thread copier([&] {
    while (!stop.load()) {
      try {
        a.copy(dst, src, n);
        ++copies;
      } catch (const error&) {
        ++refused;
      }
    }
  });
  for (int i = 0; i < 200; ++i) {
    b.sleep(SleepLevel::offload);
    b.wake_up();
  }
  stop = true;
  copier.join();
  EXPECT_GT(copies.load() + refused.load(), 0);
  a.deallocate(src);
  b.deallocate(dst);
}

// Item 13: a medium allocation that fits in free memory does not fail because the slab policy
// wanted more than is free.
TEST(HostileInput, AMediumAllocationFitsWhenTheDeviceCannotHoldAFullSlab) {
  auto d = std::make_shared<HostDriver>(host(30 * MiB));
  Pool pool(*d, small_va());
  void* p = nullptr;
  ASSERT_NO_THROW(p = pool.allocate(3 * MiB)) << "30 MiB free, the default medium_slab_min is 32 MiB";
  void* q = nullptr;
  ASSERT_NO_THROW(q = pool.allocate(20 * MiB)) << "still fits beside the first";
  EXPECT_LE(pool.stats().mapped_bytes, 30 * MiB);
  pool.deallocate(p);
  pool.deallocate(q);
}

// Issue 14 item 4: the slack bound of PoolOptions (pool.hpp): after every new slab, a (tag,
// class)'s mapped-but-unallocated medium bytes stay within clamp(allocated / 8, min, max) plus a
// granule of rounding.
TEST(HostileInput, MediumSlabSlackStaysWithinTheStatedBound) {
  auto d = std::make_shared<HostDriver>(host(2048 * MiB));
  PoolOptions o;
  o.va_bytes = 4096 * MiB;
  o.medium_slab_min = 4 * MiB;
  o.medium_slab_max = 64 * MiB;
  o.medium_limit = 16 * MiB;
  Pool pool(*d, o);
  const std::size_t gran = pool.stats().granularity;
  std::vector<void*> ptrs;
  std::size_t allocated = 0;
  std::uint64_t seed = 12345;
  for (int i = 0; i < 300; ++i) {
    seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
    const std::size_t bytes = (seed >> 33) % (3 * MiB) + 64 * KiB + 1;  // medium: above small_limit
    ptrs.push_back(pool.allocate(bytes));
    allocated += (bytes + 255) / 256 * 256;
    const std::size_t mapped = pool.stats().mapped_bytes;
    const std::size_t bound = std::clamp(allocated / 8, o.medium_slab_min, o.medium_slab_max) + gran;
    ASSERT_LE(mapped - allocated, bound) << "after " << i + 1 << " allocations of " << allocated << " bytes";
  }
  EXPECT_GT(pool.stats().chunks, 1u);
  EXPECT_LT(pool.stats().chunks, 150u) << "slabs still grow: few handles";
  for (void* p : ptrs) pool.deallocate(p);
}

// A model's run of same-size tensors (issue 3's sleep scenario: 2048 parameters of 16 MiB, a few
// with a buffer behind them, granularity 2 MiB; here scaled to 64 KiB granules) must make slabs
// that grow as the slack bound allows: the handle count is what each sleep and wake pays for. With
// growth by allocated / 8 from medium_slab_min to medium_slab_max, 1 GiB takes about
// ln(256) / ln(1.125) + 768 / 32 = 71 slabs; slabs that shrink because earlier slabs' tails (too
// short for one more tensor) count as slack make about ten times as many.
TEST(SlabPolicy, ARunOfSameSizeAllocationsMakesFewGrowingSlabs) {
  auto d = std::make_shared<HostDriver>(host(2048 * MiB));
  PoolOptions o;
  o.va_bytes = 4096 * MiB;
  const std::size_t g = 64 * KiB;
  o.medium_slab_min = 16 * g;
  o.medium_slab_max = 512 * g;
  o.medium_limit = 128 * g;
  Pool pool(*d, o);
  ASSERT_EQ(pool.stats().granularity, g);
  std::vector<void*> ptrs;
  std::size_t allocated = 0;
  for (int i = 0; i < 2048; ++i) {
    const std::size_t bytes = i % 32 == 31 ? 8 * g + 20 * KiB : 8 * g;  // some segments carry a buffer
    ptrs.push_back(pool.allocate(bytes));
    allocated += (bytes + 255) / 256 * 256;
    const std::size_t bound = std::clamp(allocated / 8, o.medium_slab_min, o.medium_slab_max) + g;
    ASSERT_LE(pool.stats().mapped_bytes - allocated, bound) << "after " << i + 1 << " allocations";
  }
  EXPECT_LE(pool.stats().chunks, 100u) << "slabs must grow with the allocations, not shrink";
  for (void* p : ptrs) pool.deallocate(p);
  EXPECT_EQ(pool.stats().mapped_bytes, 0u);
}

// Item 14: the host backend imports only torpor's size-sealed memfds, of the announced size.
TEST(HostileInput, ImportTakesOnlyTorporsMemoryOfTheAnnouncedSize) {
  HostDriver d(host(16 * MiB));
  PhysicalHandle h = d.create(0, 128 * KiB, true);
  int fd = d.export_fd(h);
  EXPECT_THROW(d.import_fd_of_size(fd, 64 * KiB), driver_error) << "smaller than announced";
  EXPECT_THROW(d.import_fd_of_size(fd, 256 * KiB), driver_error) << "larger than announced";
  PhysicalHandle ok = d.import_fd_of_size(fd, 128 * KiB);
  d.release(ok);
  EXPECT_EQ(::ftruncate(fd, 64 * KiB), -1) << "the exporter's size is sealed";
  ::close(fd);
  d.release(h);

  int foreign = ::memfd_create("torpor-physical", MFD_CLOEXEC);  // right name, no seals
  ASSERT_GE(foreign, 0);
  ASSERT_EQ(::ftruncate(foreign, 64 * KiB), 0);
  EXPECT_THROW(d.import_fd(foreign), driver_error);
  ::close(foreign);
  int other = ::memfd_create("something-else", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_EQ(::ftruncate(other, 64 * KiB), 0);
  ASSERT_EQ(::fcntl(other, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), 0);
  EXPECT_THROW(d.import_fd(other), driver_error);
  ::close(other);
  int p[2];
  ASSERT_EQ(::pipe(p), 0);
  EXPECT_THROW(d.import_fd(p[0]), driver_error);
  ::close(p[0]);
  ::close(p[1]);
}

}  // namespace
}  // namespace torpor
