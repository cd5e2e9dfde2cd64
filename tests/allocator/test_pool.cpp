// Pool allocation, classes, tags, stats: typed over backends.
#include <fmt/core.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include "support/backends.hpp"
#include "torpor/error.hpp"
#include "torpor/testing/fault_injecting_driver.hpp"

namespace torpor::test {
namespace {

template <typename B>
class PoolTest : public BackendTest<B> {};
TYPED_TEST_SUITE(PoolTest, Backends, BackendNames);

TYPED_TEST(PoolTest, AllocationsAreInsideTheReservationAndHoldBytes) {
  Pool pool(this->driver(), this->small_pool());
  std::mt19937_64 rng(1);
  void* a = pool.allocate(1000, {"weights", MemoryClass::parameter, "w0"});
  void* b = pool.allocate(3 * this->granularity() + 5, {"kv_cache", MemoryClass::cache, ""});
  for (void* p : {a, b}) {
    auto v = reinterpret_cast<device_ptr>(p);
    EXPECT_GE(v, pool.va_base());
    EXPECT_LT(v, pool.va_base() + pool.va_bytes());
  }
  EXPECT_EQ(reinterpret_cast<device_ptr>(a) % 256, 0u);
  auto bytes = random_bytes(rng, 1000);
  write(pool, a, bytes);
  EXPECT_EQ(read(pool, a, 1000), bytes);
  pool.deallocate(a);
  pool.deallocate(b);
  EXPECT_EQ(pool.stats().allocations, 0u);
}

TYPED_TEST(PoolTest, SmallAllocationsShareSlabsOnlyWithinOneTagAndClass) {
  Pool pool(this->driver(), this->small_pool());
  void* a = pool.allocate(512, {"weights", MemoryClass::state, ""});
  void* b = pool.allocate(512, {"weights", MemoryClass::state, ""});
  void* c = pool.allocate(512, {"weights", MemoryClass::parameter, ""});
  void* d = pool.allocate(512, {"kv_cache", MemoryClass::state, ""});
  PoolStats s = pool.stats();
  EXPECT_EQ(s.chunks, 3u) << "one slab each for (weights,state), (weights,parameter), (kv_cache,state)";
  EXPECT_EQ(reinterpret_cast<device_ptr>(b) - reinterpret_cast<device_ptr>(a), 512u);
  for (void* p : {a, b, c, d}) pool.deallocate(p);
}

TYPED_TEST(PoolTest, FastPathMakesNoDriverCall) {
  FaultInjectingDriver counting(this->driver());
  Pool pool(counting, this->small_pool());
  void* first = pool.allocate(1024, {"weights", MemoryClass::state, ""});
  std::size_t before = 0;
  for (int k = 0; k < static_cast<int>(DriverCall::count_); ++k) before += counting.calls(static_cast<DriverCall>(k));
  std::vector<void*> more;
  for (int i = 0; i < 20; ++i) more.push_back(pool.allocate(1024, {"weights", MemoryClass::state, ""}));
  for (void* p : more) pool.deallocate(p);
  void* again = pool.allocate(2048, {"weights", MemoryClass::state, ""});
  std::size_t after = 0;
  for (int k = 0; k < static_cast<int>(DriverCall::count_); ++k) after += counting.calls(static_cast<DriverCall>(k));
  EXPECT_EQ(after, before) << "sub-allocation from a mapped slab must not call the driver";
  pool.deallocate(first);
  pool.deallocate(again);
}

// Issue 33 N14: each tag's first medium allocation took a minimum-size slab whatever the
// reservation, so a few dozen tags with one small tensor each used up a small VA reservation.
TYPED_TEST(PoolTest, ManyTagsOfMediumAllocationsLeaveTheReservationForWhatIsAllocated) {
  const std::size_t gran = this->granularity();
  const std::size_t MiB = std::size_t{1} << 20;
  PoolOptions o;  // the default slab policy: a 32 MiB minimum medium slab
  o.va_bytes = 1024 * MiB;
  Pool pool(this->driver(), o);
  const std::size_t medium = 2 * MiB;  // above small_limit, below medium_limit
  std::vector<void*> held;
  for (int t = 0; t < 32; ++t)
    held.push_back(pool.allocate(medium, {fmt::format("tag{}", t), MemoryClass::parameter, ""}));
  const std::size_t allocated = 32 * medium;
  // The slack the policy may add across the pool: a sixteenth of the reservation or of the
  // device's memory (the smaller), plus a granule of rounding per slab.
  const std::size_t room = std::min(o.va_bytes, this->driver().device_properties(0).total_bytes);
  const std::size_t slack = room / 16 + 32 * gran;
  EXPECT_LE(pool.stats().mapped_bytes, allocated + slack);
  // What is left takes an allocation of nearly all of it.
  void* b = nullptr;
  EXPECT_NO_THROW(b = pool.allocate(room - allocated - slack, {"big", MemoryClass::cache, ""}));
  if (b) pool.deallocate(b);
  for (void* p : held) pool.deallocate(p);
}

TYPED_TEST(PoolTest, EmptySlabIsCachedOnceAndTrimReleasesIt) {
  Pool pool(this->driver(), this->small_pool());
  void* a = pool.allocate(4096, {"t", MemoryClass::state, ""});
  pool.deallocate(a);
  PoolStats s = pool.stats();
  EXPECT_EQ(s.cached_bytes, this->granularity());
  EXPECT_EQ(pool.trim(), this->granularity());
  EXPECT_EQ(pool.stats().mapped_bytes, 0u);
}

// The slab policy keeps one empty small slab per (tag, class) for the fast path; a second slab
// of the same pair that empties meanwhile is released at once (placement.hpp).
TYPED_TEST(PoolTest, OnlyOneEmptySmallSlabIsKeptPerTagAndClass) {
  Pool pool(this->driver(), this->small_pool());
  const std::size_t half = pool.options().small_limit;
  ASSERT_EQ(half * 2, pool.options().slab_bytes) << "two allocations of small_limit fill one slab";
  const AllocationOptions o{"t", MemoryClass::state, ""};
  void* a = pool.allocate(half, o);
  void* b = pool.allocate(half, o);
  void* c = pool.allocate(half, o);  // the first slab is full: a second one
  ASSERT_EQ(pool.stats().mapped_bytes, 2 * pool.options().slab_bytes);
  pool.deallocate(c);  // the second slab empties: kept, it is the only empty one
  EXPECT_EQ(pool.stats().cached_bytes, pool.options().slab_bytes);
  pool.deallocate(a);
  pool.deallocate(b);  // the first empties too: released, one empty slab is already kept
  EXPECT_EQ(pool.stats().cached_bytes, pool.options().slab_bytes);
  EXPECT_EQ(pool.stats().mapped_bytes, pool.options().slab_bytes);
}

TYPED_TEST(PoolTest, FindReportsBaseTagClassAndNameForInteriorPointers) {
  Pool pool(this->driver(), this->small_pool());
  void* a = pool.allocate(4096, {"weights", MemoryClass::state, "buffers"});
  pool.mark(at(a, 1024), 512, MemoryClass::parameter, "layer.w");
  auto info = pool.find(at(a, 1100));
  ASSERT_TRUE(info);
  EXPECT_EQ(info->base, reinterpret_cast<device_ptr>(a));
  EXPECT_EQ(info->bytes, 4096u);
  EXPECT_EQ(info->offset, 1100u);
  EXPECT_EQ(info->tag, "weights");
  EXPECT_EQ(info->memory_class, MemoryClass::parameter);
  EXPECT_EQ(info->name, "layer.w");
  auto outside = pool.find(at(a, 2000));
  ASSERT_TRUE(outside);
  EXPECT_EQ(outside->memory_class, MemoryClass::state);
  EXPECT_EQ(outside->name, "buffers");
  EXPECT_FALSE(pool.find(at(a, 4096 + 8192)));
  pool.deallocate(a);
}

TYPED_TEST(PoolTest, MarkSplitsAndMergesClassRanges) {
  Pool pool(this->driver(), this->small_pool());
  void* a = pool.allocate(10000, {"weights", MemoryClass::state, ""});
  pool.mark(at(a, 0), 4000, MemoryClass::parameter, "p");
  pool.mark(at(a, 4000), 2000, MemoryClass::parameter, "p");
  PoolStats s = pool.stats();
  ASSERT_EQ(s.tags.size(), 1u);
  EXPECT_EQ(s.tags[0].classes[0].allocated_bytes, 6000u);
  EXPECT_EQ(s.tags[0].classes[1].allocated_bytes, 4000u);
  pool.mark(at(a, 0), 10000, MemoryClass::cache, "");
  s = pool.stats();
  EXPECT_EQ(s.tags[0].classes[2].allocated_bytes, 10000u);
  EXPECT_EQ(s.tags[0].classes[0].allocated_bytes, 0u);
  pool.deallocate(a);
}

TYPED_TEST(PoolTest, StatsPerTagAndClass) {
  Pool pool(this->driver(), this->small_pool());
  std::size_t g = this->granularity();
  void* w = pool.allocate(2 * g, {"weights", MemoryClass::parameter, "w"});
  void* s1 = pool.allocate(300, {"weights", MemoryClass::state, "s"});
  void* kv = pool.allocate(3 * g, {"kv_cache", MemoryClass::cache, ""});
  PoolStats st = pool.stats();
  ASSERT_EQ(st.tags.size(), 2u);
  const TagStats& kvs = st.tags[0];
  const TagStats& ws = st.tags[1];
  EXPECT_EQ(kvs.tag, "kv_cache");
  EXPECT_EQ(ws.tag, "weights");
  EXPECT_EQ(ws.allocations, 2u);
  EXPECT_EQ(ws.chunks, 2u);
  EXPECT_EQ(ws.mapped_bytes, 3 * g);
  EXPECT_EQ(ws.classes[static_cast<int>(MemoryClass::parameter)].allocated_bytes, 2 * g);
  EXPECT_EQ(ws.classes[static_cast<int>(MemoryClass::state)].allocated_bytes, 300u);
  EXPECT_EQ(kvs.classes[static_cast<int>(MemoryClass::cache)].allocated_bytes, 3 * g);
  EXPECT_EQ(st.mapped_bytes, 6 * g);
  std::string json = to_json(st);
  EXPECT_NE(json.find("\"kv_cache\""), std::string::npos);
  for (void* p : {w, s1, kv}) pool.deallocate(p);
}

TYPED_TEST(PoolTest, ExhaustedDeviceMemoryIsOutOfMemoryNamingTheTag) {
  PoolOptions o = this->small_pool();
  o.va_bytes = this->driver().device_properties(0).total_bytes * 2;
  Pool pool(this->driver(), o);
  std::size_t total = this->driver().device_properties(0).total_bytes;
  try {
    pool.allocate(total + this->granularity(), {"huge", MemoryClass::cache, ""});
    FAIL() << "expected out_of_memory";
  } catch (const out_of_memory& e) {
    EXPECT_NE(std::string(e.what()).find("'huge'"), std::string::npos) << e.what();
  }
  EXPECT_EQ(pool.stats().chunks, 0u);
  EXPECT_EQ(pool.stats().va_used_bytes, 0u) << "the failed allocation gave its VA back";
}

}  // namespace
}  // namespace torpor::test

namespace torpor::test {
namespace {

TYPED_TEST(PoolTest, ChunkInfoFollowsSleepAndWake) {
  PoolOptions o = this->small_pool();
  o.exportable = true;
  Pool pool(this->driver(), o);
  std::size_t g = this->granularity();
  void* big = pool.allocate(2 * g, {"weights", MemoryClass::state, "slots"});
  void* small = pool.allocate(100, {"weights", MemoryClass::state, ""});
  auto c = pool.chunk_info(at(big, 10));
  ASSERT_TRUE(c);
  EXPECT_EQ(c->va, reinterpret_cast<device_ptr>(big));
  EXPECT_EQ(c->bytes, 2 * g);
  EXPECT_TRUE(c->dedicated);
  EXPECT_TRUE(c->awake);
  EXPECT_TRUE(static_cast<bool>(c->handle));
  int fd = this->driver().export_fd(c->handle);  // exportable pools can share their chunks
  EXPECT_GE(fd, 0);
  ::close(fd);
  EXPECT_FALSE(pool.chunk_info(small)->dedicated);
  pool.sleep(1);
  c = pool.chunk_info(big);
  EXPECT_FALSE(c->awake);
  EXPECT_FALSE(static_cast<bool>(c->handle));
  pool.wake_up();
  auto woken = pool.chunk_info(big);
  EXPECT_TRUE(woken->awake);
  EXPECT_EQ(woken->va, reinterpret_cast<device_ptr>(big));
  EXPECT_FALSE(pool.chunk_info(at(big, 2 * g + 4 * g)));
  pool.deallocate(big);
  pool.deallocate(small);
}

}  // namespace
}  // namespace torpor::test

namespace torpor::test {
namespace {

struct RecordingObserver : SleepObserver {
  std::vector<std::string> events;
  bool refuse_sleep = false;
  void before_sleep(Pool&, int level, const std::vector<std::string>& tags) override {
    events.push_back("before_sleep " + std::to_string(level) + " " + std::to_string(tags.size()));
    if (refuse_sleep) throw timeout_error("peer rank 1 did not arrive");
  }
  void after_sleep(Pool&, int, const std::vector<std::string>&, bool ok) override {
    events.push_back(std::string("after_sleep ") + (ok ? "ok" : "failed"));
  }
  void before_wake(Pool&, const std::vector<std::string>&) override { events.push_back("before_wake"); }
  void after_wake(Pool&, const std::vector<std::string>&, bool ok) override {
    events.push_back(std::string("after_wake ") + (ok ? "ok" : "failed"));
  }
};

TYPED_TEST(PoolTest, ObserversSeeSleepAndWakeAndCanRefuse) {
  Pool pool(this->driver(), this->small_pool());
  RecordingObserver obs;
  pool.add_observer(&obs);
  void* p = pool.allocate(1000, {"weights", MemoryClass::state, ""});
  pool.sleep(0);
  pool.sleep(2);
  pool.wake_up();
  EXPECT_EQ(obs.events,
            (std::vector<std::string>{"before_sleep 2 1", "after_sleep ok", "before_wake", "after_wake ok"}));
  obs.events.clear();
  obs.refuse_sleep = true;
  EXPECT_THROW(pool.sleep(1), timeout_error);
  EXPECT_FALSE(pool.asleep("weights")) << "a refused sleep changes nothing";
  EXPECT_EQ(obs.events, (std::vector<std::string>{"before_sleep 1 1"}))
      << "the observer that refused is not called back";
  pool.remove_observer(&obs);
  pool.sleep(1);
  pool.wake_up();
  pool.deallocate(p);
}

TYPED_TEST(PoolTest, AddressRangesComeFromTheReservationAndGoBack) {
  Pool pool(this->driver(), this->small_pool());
  device_ptr va = pool.reserve_address_range(3 * this->granularity() - 5);
  EXPECT_GE(va, pool.va_base());
  EXPECT_EQ(pool.stats().address_ranges_bytes, 3 * this->granularity());
  void* p = pool.allocate(this->granularity() * 2, {"t", MemoryClass::state, ""});
  EXPECT_TRUE(reinterpret_cast<device_ptr>(p) >= va + 3 * this->granularity() ||
              reinterpret_cast<device_ptr>(p) + 2 * this->granularity() <= va);
  EXPECT_THROW(pool.release_address_range(va + 1), invalid_argument);
  pool.release_address_range(va);
  EXPECT_EQ(pool.stats().address_ranges_bytes, 0u);
  pool.deallocate(p);
}

}  // namespace
}  // namespace torpor::test
