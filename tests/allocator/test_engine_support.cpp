// What the engine-compatible modes (vLLM's and torch_memory_saver's, python/torpor) need from the
// pool and the C API: the bytes mapped against the bytes allocated per tag, the host copies a sleep
// kept read back (torch_memory_saver's get_cpu_backup), and the memory margin of the PyTorch
// allocator. The oracle is what the test wrote and allocated.
#include <gtest/gtest.h>

#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "support/backends.hpp"
#include "torpor/error.hpp"
#include "torpor/pool.hpp"
#include "torpor/torch_allocator.h"
#include "torpor/torpor.h"

namespace torpor::test {
namespace {

template <typename B>
class EngineSupportTest : public BackendTest<B> {};
TYPED_TEST_SUITE(EngineSupportTest, Backends, BackendNames);

const TagStats& tag(const PoolStats& st, const std::string& name) {
  for (const auto& t : st.tags)
    if (t.tag == name) return t;
  throw std::runtime_error("no tag " + name);
}

TYPED_TEST(EngineSupportTest, StatsSeparateMappedFromAllocatedBytesPerTag) {
  Pool pool(this->driver(), this->tiered_pool());
  std::size_t g = this->granularity();
  void* small = pool.allocate(100, {"a", MemoryClass::state, ""});
  void* big = pool.allocate(20 * g + 5, {"a", MemoryClass::state, ""});
  pool.allocate(3 * g, {"b", MemoryClass::cache, ""});
  PoolStats st = pool.stats();
  EXPECT_EQ(tag(st, "a").allocated_bytes, 100 + 20 * g + 5) << "as requested, not rounded";
  EXPECT_EQ(tag(st, "a").mapped_bytes, g + 21 * g) << "a small slab, and a chunk rounded to the granularity";
  EXPECT_EQ(tag(st, "b").allocated_bytes, 3 * g);
  EXPECT_GE(tag(st, "b").mapped_bytes, 3 * g) << "a medium slab holds it";
  pool.deallocate(big);
  EXPECT_EQ(tag(pool.stats(), "a").allocated_bytes, 100u);
  pool.sleep(1, {"a"});
  st = pool.stats();
  EXPECT_EQ(tag(st, "a").allocated_bytes, 100u) << "asleep, still allocated";
  EXPECT_EQ(tag(st, "a").mapped_bytes, 0u) << "asleep, nothing mapped";
  pool.wake_up();
  pool.deallocate(small);
  EXPECT_EQ(tag(pool.stats(), "a").allocated_bytes, 0u);
  EXPECT_NE(to_json(pool.stats()).find("\"allocated_bytes\":" + std::to_string(3 * g)), std::string::npos)
      << "the JSON form carries it";
}

TYPED_TEST(EngineSupportTest, ReadHostCopyReturnsTheBackupWhileAsleepAndTheRetainedCopyAfterWake) {
  Pool pool(this->driver(), this->small_pool(FillOnWake::poison));
  std::mt19937_64 rng(14);
  constexpr std::size_t n = 96 << 10;
  void* s = pool.allocate(n, {"w", MemoryClass::state, "flags"});
  void* p = pool.allocate(n, {"w", MemoryClass::parameter, "w0"});
  auto state_bytes = random_bytes(rng, n);
  auto param_bytes = random_bytes(rng, n);
  write(pool, s, state_bytes);
  write(pool, p, param_bytes);
  std::vector<std::uint8_t> out(n, 0);

  HostCopyRead r = pool.read_host_copy(s, n, out.data());
  EXPECT_FALSE(r.copied) << "never slept: no host copy";
  EXPECT_FALSE(r.asleep);

  pool.sleep(2, {"w"});
  r = pool.read_host_copy(at(s, 100), 1000, out.data());
  EXPECT_TRUE(r.copied && r.asleep);
  EXPECT_EQ(0, std::memcmp(out.data(), state_bytes.data() + 100, 1000)) << "an interior range of the backup";
  std::fill(out.begin(), out.end(), 0);
  r = pool.read_host_copy(p, n, out.data());
  EXPECT_FALSE(r.copied) << "level 2 discarded the parameter";
  EXPECT_TRUE(r.asleep);
  EXPECT_EQ(out, std::vector<std::uint8_t>(n, 0)) << "nothing copied when not covered";

  pool.wake_up();
  r = pool.read_host_copy(s, n, out.data());
  EXPECT_TRUE(r.copied) << "skip_unchanged keeps the copy after wake";
  EXPECT_FALSE(r.asleep);
  EXPECT_EQ(out, state_bytes);
  write(pool, s, random_bytes(rng, n));
  pool.read_host_copy(s, n, out.data());
  EXPECT_EQ(out, state_bytes) << "the retained copy holds the last sleep's bytes";
  pool.release_host_store();
  EXPECT_FALSE(pool.read_host_copy(s, n, out.data()).copied) << "released: no copy any more";

  EXPECT_THROW(pool.read_host_copy(at(s, n - 10), 11, out.data()), invalid_argument) << "past the allocation";
  EXPECT_THROW(pool.read_host_copy(reinterpret_cast<void*>(8), 1, out.data()), invalid_argument);
  EXPECT_THROW(pool.read_host_copy(s, 0, out.data()), invalid_argument);
  EXPECT_THROW(pool.read_host_copy(s, 1, nullptr), invalid_argument);
}

TYPED_TEST(EngineSupportTest, ReadHostCopyNeedsEveryByteCoveredAcrossMixedClasses) {
  Pool pool(this->driver(), this->small_pool(FillOnWake::poison));
  std::mt19937_64 rng(15);
  constexpr std::size_t n = 64 << 10;
  void* a = pool.allocate(n, {"m", MemoryClass::state, "seg"});
  auto bytes = random_bytes(rng, n);
  write(pool, a, bytes);
  pool.mark(at(a, 4096), 4096, MemoryClass::cache);  // a hole that level 1 discards
  pool.sleep(1, {"m"});
  std::vector<std::uint8_t> out(n);
  EXPECT_TRUE(pool.read_host_copy(a, 4096, out.data()).copied);
  EXPECT_EQ(0, std::memcmp(out.data(), bytes.data(), 4096));
  EXPECT_TRUE(pool.read_host_copy(at(a, 8192), n - 8192, out.data()).copied);
  EXPECT_EQ(0, std::memcmp(out.data(), bytes.data() + 8192, n - 8192));
  EXPECT_FALSE(pool.read_host_copy(a, 8192, out.data()).copied) << "the range crosses the discarded hole";
  EXPECT_FALSE(pool.read_host_copy(at(a, 4096 + 10), 100, out.data()).copied);
  pool.wake_up();
}

// --- C API ------------------------------------------------------------------------------------

nlohmann::json json_stats(torpor_pool_t pool) {
  size_t needed = 0;
  EXPECT_EQ(torpor_stats_json(pool, nullptr, 0, &needed), TORPOR_OK);
  std::string s(needed, '\0');
  EXPECT_EQ(torpor_stats_json(pool, s.data(), s.size(), &needed), TORPOR_OK);
  s.resize(needed - 1);
  return nlohmann::json::parse(s);
}

TEST(EngineSupportCApi, ReadHostCopyStatusesAndAsleepFlag) {
  torpor_pool_options o;
  torpor_pool_options_init(&o);
  o.backend = TORPOR_BACKEND_HOST;
  o.va_bytes = std::size_t{1} << 30;
  torpor_pool_t pool = nullptr;
  ASSERT_EQ(torpor_pool_create(&o, &pool), TORPOR_OK) << torpor_last_error();
  void* s = nullptr;
  ASSERT_EQ(torpor_alloc(pool, 4096, "t", TORPOR_CLASS_STATE, nullptr, &s), TORPOR_OK);
  std::vector<unsigned char> src(4096, 0x5A), out(4096, 0);
  ASSERT_EQ(torpor_copy(pool, s, src.data(), src.size()), TORPOR_OK);
  int asleep = 7;
  EXPECT_EQ(torpor_read_host_copy(pool, s, 4096, out.data(), &asleep), TORPOR_ERROR_INVALID_STATE);
  EXPECT_EQ(asleep, 0);
  EXPECT_NE(std::string(torpor_last_error()).find("no copy of its last sleep was retained"), std::string::npos)
      << torpor_last_error();
  ASSERT_EQ(torpor_sleep(pool, 1, nullptr, 0), TORPOR_OK);
  EXPECT_EQ(torpor_read_host_copy(pool, s, 4096, out.data(), &asleep), TORPOR_OK) << torpor_last_error();
  EXPECT_EQ(asleep, 1);
  EXPECT_EQ(out, src);
  EXPECT_EQ(torpor_read_host_copy(pool, s, 4096, out.data(), nullptr), TORPOR_OK);
  EXPECT_EQ(torpor_read_host_copy(pool, nullptr, 1, out.data(), &asleep), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(torpor_last_error()).find("is not inside an allocation"), std::string::npos);
  EXPECT_EQ(json_stats(pool)["tags"]["t"]["allocated_bytes"], 4096);
  ASSERT_EQ(torpor_wake_up(pool, nullptr, 0), TORPOR_OK);
  EXPECT_EQ(torpor_pool_destroy(pool), TORPOR_OK);
}

TEST(EngineSupportCApi, MemoryMarginRefusesSegmentsThatWouldEatIt) {
  torpor_pool_options o;
  torpor_pool_options_init(&o);
  o.backend = TORPOR_BACKEND_HOST;
  o.fill_on_wake = TORPOR_FILL_POISON;
  o.va_bytes = std::size_t{1} << 30;
  ASSERT_EQ(torpor_torch_configure(&o), TORPOR_OK) << torpor_last_error();  // the options test_torch_allocator uses
  torpor_pool_t pool = nullptr;
  ASSERT_EQ(torpor_torch_pool(0, &pool), TORPOR_OK);
  ASSERT_EQ(torpor_torch_set_memory_margin(std::size_t{64} << 40), TORPOR_OK);  // more than any device here
  EXPECT_EQ(torpor_torch_memory_margin(), std::size_t{64} << 40);
  unsigned long long failures = torpor_torch_failures(nullptr);
  EXPECT_EQ(torpor_torch_malloc(2 << 20, 0, nullptr), nullptr);
  torpor_status status = TORPOR_OK;
  EXPECT_EQ(torpor_torch_failures(&status), failures + 1);
  EXPECT_EQ(status, TORPOR_ERROR_OUT_OF_MEMORY);
  EXPECT_NE(std::string(torpor_last_error()).find("refused by the memory margin"), std::string::npos)
      << torpor_last_error();
  ASSERT_EQ(torpor_torch_set_memory_margin(1 << 20), TORPOR_OK);  // a small margin leaves room
  void* p = torpor_torch_malloc(2 << 20, 0, nullptr);
  EXPECT_NE(p, nullptr) << torpor_last_error();
  torpor_torch_free(p, 2 << 20, 0, nullptr);
  EXPECT_EQ(torpor_torch_set_memory_margin(TORPOR_TORCH_MEMORY_MARGIN_MAX + 1), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(torpor_last_error()).find("TORPOR_TORCH_MEMORY_MARGIN_MAX"), std::string::npos);
  EXPECT_EQ(torpor_torch_memory_margin(), std::size_t{1} << 20) << "a refused value changes nothing";
  ASSERT_EQ(torpor_torch_set_memory_margin(0), TORPOR_OK);
}

// vLLM reads VLLM_POISON_DISCARDED_PAGES at each wake: the fill can change on a live pool, and
// applies to the wakes after the change.
TYPED_TEST(EngineSupportTest, TheFillOnWakeSetAtRunTimeAppliesToTheNextWake) {
  std::size_t g = this->granularity();
  Pool pool(this->driver(), this->small_pool(FillOnWake::zero));
  void* kv = pool.allocate(g, {"kv_cache", MemoryClass::cache, "kv"});
  write(pool, kv, std::vector<std::uint8_t>(g, 0x11));
  pool.sleep(1);
  EXPECT_EQ(pool.set_fill_on_wake(FillOnWake::poison), FillOnWake::zero);
  pool.wake_up();
  EXPECT_EQ(read(pool, kv, g), std::vector<std::uint8_t>(g, 0xFF)) << "discarded bytes poisoned";
  EXPECT_EQ(pool.set_fill_on_wake(FillOnWake::zero), FillOnWake::poison);
  pool.sleep(1);
  pool.wake_up();
  EXPECT_EQ(read(pool, kv, g), std::vector<std::uint8_t>(g, 0x00)) << "and back to zero";
  EXPECT_THROW(pool.set_fill_on_wake(static_cast<FillOnWake>(7)), invalid_argument);
  pool.deallocate(kv);
}

TEST(CFillOnWake, SetThroughTheCApiReturnsThePreviousAndRefusesUnknownFills) {
  torpor_pool_options o;
  torpor_pool_options_init(&o);
  o.backend = TORPOR_BACKEND_HOST;
  o.va_bytes = std::size_t{1} << 30;
  torpor_pool_t pool = nullptr;
  ASSERT_EQ(torpor_pool_create(&o, &pool), TORPOR_OK) << torpor_last_error();
  int previous = -1;
  EXPECT_EQ(torpor_set_fill_on_wake(pool, TORPOR_FILL_POISON, &previous), TORPOR_OK);
  EXPECT_EQ(previous, TORPOR_FILL_NONE);
  EXPECT_EQ(torpor_set_fill_on_wake(pool, 3, &previous), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(torpor_last_error()).find("unknown fill 3"), std::string::npos) << torpor_last_error();
  EXPECT_EQ(torpor_set_fill_on_wake(pool, TORPOR_FILL_NONE, nullptr), TORPOR_OK);
  EXPECT_EQ(torpor_set_fill_on_wake(pool, TORPOR_FILL_ZERO, &previous), TORPOR_OK);
  EXPECT_EQ(previous, TORPOR_FILL_NONE);
  EXPECT_EQ(torpor_pool_destroy(pool), TORPOR_OK);
}

}  // namespace
}  // namespace torpor::test
