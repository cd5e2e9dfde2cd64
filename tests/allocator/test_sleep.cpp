// Sleep and wake semantics: DESIGN.md's table, exactly. Typed over backends.
#include <gtest/gtest.h>

#include <cstdio>

#include "pool/store/host_store.hpp"
#include "support/backends.hpp"
#include "torpor/error.hpp"

namespace torpor::test {
namespace {

template <typename B>
class SleepTest : public BackendTest<B> {
 protected:
  // One allocation of each class in "weights" plus a cache in "kv_cache", filled with random
  // bytes (never zeros, never the poison pattern).
  struct Layout {
    void* param;
    void* preserved;
    void* state;
    void* cache;
    std::vector<std::uint8_t> param_bytes, preserved_bytes, state_bytes, cache_bytes;
    std::size_t n;
  };
  Layout fill(Pool& pool, std::size_t n) {
    std::mt19937_64 rng(n);
    Layout l{};
    l.n = n;
    l.param = pool.allocate(n, {"weights", MemoryClass::parameter, "layers.0.w"});
    l.preserved = pool.allocate(n, {"weights", MemoryClass::parameter, "embed.w"});
    l.state = pool.allocate(n, {"weights", MemoryClass::state, "flags"});
    l.cache = pool.allocate(n, {"kv_cache", MemoryClass::cache, ""});
    l.param_bytes = random_bytes(rng, n);
    l.preserved_bytes = random_bytes(rng, n);
    l.state_bytes = random_bytes(rng, n);
    l.cache_bytes = random_bytes(rng, n);
    write(pool, l.param, l.param_bytes);
    write(pool, l.preserved, l.preserved_bytes);
    write(pool, l.state, l.state_bytes);
    write(pool, l.cache, l.cache_bytes);
    return l;
  }
  static bool all_poison(const std::vector<std::uint8_t>& v) {
    return std::all_of(v.begin(), v.end(), [](std::uint8_t b) { return b == poison_byte; });
  }
};
TYPED_TEST_SUITE(SleepTest, Backends, BackendNames);

TYPED_TEST(SleepTest, Level1KeepsParametersAndStateDiscardsCache) {
  Pool pool(this->driver(), this->small_pool(FillOnWake::poison));
  for (std::size_t n : {std::size_t{777}, 3 * this->granularity() + 100}) {
    auto l = this->fill(pool, n);
    TransitionReport r = pool.sleep(1);
    EXPECT_EQ(r.bytes_offloaded, 3 * n);
    EXPECT_EQ(r.bytes_discarded, n);
    auto w = pool.wake_up();
    EXPECT_EQ(w.bytes_restored, 3 * n);
    EXPECT_EQ(read(pool, l.param, n), l.param_bytes);
    EXPECT_EQ(read(pool, l.preserved, n), l.preserved_bytes);
    EXPECT_EQ(read(pool, l.state, n), l.state_bytes);
    EXPECT_TRUE(this->all_poison(read(pool, l.cache, n)));
    for (void* p : {l.param, l.preserved, l.state, l.cache}) pool.deallocate(p);
  }
}

TYPED_TEST(SleepTest, Level2DiscardsParametersUnlessPreservedAndKeepsState) {
  Pool pool(this->driver(), this->small_pool(FillOnWake::poison));
  pool.set_preserve({"embed.*"});
  for (std::size_t n : {std::size_t{777}, 3 * this->granularity() + 100}) {
    auto l = this->fill(pool, n);
    TransitionReport r = pool.sleep(2);
    EXPECT_EQ(r.bytes_offloaded, 2 * n) << "preserved parameter + state";
    EXPECT_EQ(r.bytes_discarded, 2 * n);
    pool.wake_up();
    EXPECT_TRUE(this->all_poison(read(pool, l.param, n)));
    EXPECT_EQ(read(pool, l.preserved, n), l.preserved_bytes);
    EXPECT_EQ(read(pool, l.state, n), l.state_bytes);
    EXPECT_TRUE(this->all_poison(read(pool, l.cache, n)));
    for (void* p : {l.param, l.preserved, l.state, l.cache}) pool.deallocate(p);
  }
}

TYPED_TEST(SleepTest, NamedLevelsDoWhatTheirNumbersDo) {
  Pool pool(this->driver(), this->small_pool(FillOnWake::poison));
  pool.set_preserve({"embed.*"});
  std::size_t n = 3 * this->granularity() + 100;
  auto l = this->fill(pool, n);
  TransitionReport none = pool.sleep(SleepLevel::none);
  EXPECT_EQ(none.level, 0);
  EXPECT_EQ(none.chunks, 0u);
  TransitionReport one = pool.sleep(SleepLevel::offload);
  EXPECT_EQ(one.level, 1);
  EXPECT_EQ(one.bytes_offloaded, 3 * n) << "parameters, preserved parameter and state";
  EXPECT_EQ(one.bytes_discarded, n) << "the cache";
  TransitionReport two = pool.sleep(SleepLevel::discard_parameters, {"weights"});
  EXPECT_EQ(two.level, 2);
  EXPECT_EQ(two.bytes_discarded, n) << "the parameter that is not preserved";
  EXPECT_EQ(pool.stats().tags[1].level, 2);  // "weights", after "kv_cache"
  pool.wake_up();
  EXPECT_TRUE(this->all_poison(read(pool, l.param, n)));
  EXPECT_EQ(read(pool, l.preserved, n), l.preserved_bytes);
  EXPECT_EQ(read(pool, l.state, n), l.state_bytes);
  EXPECT_TRUE(this->all_poison(read(pool, l.cache, n)));
}

TEST(SleepLevelNames, NamesAndNumbersParseToTheLevel) {
  const std::pair<SleepLevel, std::string> table[] = {{SleepLevel::none, "none"},
                                                      {SleepLevel::offload, "offload"},
                                                      {SleepLevel::discard_parameters, "discard_parameters"}};
  for (int i = 0; i < 3; ++i) {
    auto [level, name] = table[i];
    EXPECT_EQ(static_cast<int>(level), i) << "the values are the levels' numbers (the C API passes them)";
    EXPECT_EQ(to_string(level), name);
    EXPECT_EQ(parse_sleep_level(name), level);
    EXPECT_EQ(parse_sleep_level(std::to_string(i)), level);
  }
  try {
    parse_sleep_level("deep");
    ADD_FAILURE() << "expected invalid_argument";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("none, offload or discard_parameters"), std::string::npos) << e.what();
  }
}

TYPED_TEST(SleepTest, ZeroFillOption) {
  Pool pool(this->driver(), this->small_pool(FillOnWake::zero));
  auto l = this->fill(pool, 5000);
  pool.sleep(2);
  pool.wake_up();
  auto cache = read(pool, l.cache, 5000);
  EXPECT_TRUE(std::all_of(cache.begin(), cache.end(), [](std::uint8_t b) { return b == 0; }));
  EXPECT_EQ(read(pool, l.state, 5000), l.state_bytes);
}

TYPED_TEST(SleepTest, OnlyStateRangesOfAMixedChunkTravelAndFreeSpaceNever) {
  Pool pool(this->driver(), this->small_pool(FillOnWake::poison));
  std::size_t g = this->granularity();
  // A PyTorch-style segment: one allocation, parameters marked inside, the rest state.
  void* seg = pool.allocate(4 * g, {"weights", MemoryClass::state, ""});
  std::mt19937_64 rng(7);
  auto bytes = random_bytes(rng, 4 * g);
  write(pool, seg, bytes);
  pool.mark(seg, g, MemoryClass::parameter, "w0");
  pool.mark(at(seg, 2 * g), g + 4096, MemoryClass::parameter, "w1");
  // state = [g, 2g) and [3g + 4096, 4g)
  std::size_t state_bytes = g + (g - 4096);
  TransitionReport r = pool.sleep(2);
  EXPECT_EQ(r.bytes_offloaded, state_bytes);
  EXPECT_EQ(r.bytes_released, 4 * g);
  PoolStats st = pool.stats();
  EXPECT_EQ(st.tags[0].offloaded_bytes, state_bytes);
  EXPECT_EQ(st.host_store_used_bytes, HostStore::reserved_size(g) + HostStore::reserved_size(g - 4096));
  pool.wake_up();
  auto after = read(pool, seg, 4 * g);
  for (std::size_t i = 0; i < 4 * g; ++i) {
    bool state = (i >= g && i < 2 * g) || i >= 3 * g + 4096;
    ASSERT_EQ(after[i], state ? bytes[i] : poison_byte) << "byte " << i;
  }
  // A slab with one small allocation: only its bytes travel, not the slab.
  void* small = pool.allocate(1000, {"small", MemoryClass::state, ""});
  r = pool.sleep(1, std::vector<std::string>{"small"});
  EXPECT_EQ(r.bytes_offloaded, 1000u);
  EXPECT_EQ(r.bytes_released, g);
  pool.wake_up(std::vector<std::string>{"small"});
  pool.deallocate(small);
  pool.deallocate(seg);
}

TYPED_TEST(SleepTest, AddressesAreUnchangedAndTagsWakeSeparately) {
  Pool pool(this->driver(), this->small_pool(FillOnWake::poison));
  auto l = this->fill(pool, 3 * this->granularity());
  pool.sleep(2);
  EXPECT_TRUE(pool.asleep("weights"));
  EXPECT_TRUE(pool.asleep("kv_cache"));
  pool.wake_up(std::vector<std::string>{"weights"});  // the RL pattern: weights first
  EXPECT_FALSE(pool.asleep("weights"));
  EXPECT_TRUE(pool.asleep("kv_cache"));
  EXPECT_EQ(read(pool, l.state, l.n), l.state_bytes);
  auto info = pool.find(l.cache);
  ASSERT_TRUE(info);
  EXPECT_TRUE(info->asleep);
  EXPECT_EQ(info->base, reinterpret_cast<device_ptr>(l.cache));
  pool.wake_up(std::vector<std::string>{"kv_cache"});
  EXPECT_FALSE(pool.find(l.cache)->asleep);
  // The same addresses hold memory again: a write and read at the old pointer work.
  std::vector<std::uint8_t> v(l.n, 0x42);
  write(pool, l.cache, v);
  EXPECT_EQ(read(pool, l.cache, l.n), v);
}

TYPED_TEST(SleepTest, IdempotentAndLevelZeroDoesNothing) {
  Pool pool(this->driver(), this->small_pool(FillOnWake::poison));
  auto l = this->fill(pool, 4096);
  TransitionReport zero = pool.sleep(0);
  EXPECT_EQ(zero.chunks, 0u);
  EXPECT_FALSE(pool.asleep("weights"));
  EXPECT_EQ(read(pool, l.cache, 4096), l.cache_bytes);
  pool.sleep(1);
  TransitionReport again = pool.sleep(1);
  EXPECT_EQ(again.chunks, 0u);
  EXPECT_EQ(again.bytes_offloaded, 0u);
  TransitionReport lighter = pool.sleep(1);
  EXPECT_EQ(lighter.chunks, 0u);
  pool.wake_up();
  TransitionReport wake_again = pool.wake_up();
  EXPECT_EQ(wake_again.chunks, 0u);
  EXPECT_EQ(read(pool, l.param, 4096), l.param_bytes);
}

TYPED_TEST(SleepTest, DeepeningFromLevel1To2DropsParameterCopies) {
  Pool pool(this->driver(), this->small_pool(FillOnWake::poison));
  pool.set_preserve({"embed.*"});
  auto l = this->fill(pool, 3 * this->granularity());
  pool.sleep(1);
  std::size_t held_l1 = pool.stats().host_store_used_bytes;
  TransitionReport deeper = pool.sleep(2);
  EXPECT_EQ(deeper.bytes_discarded, l.n);
  EXPECT_LT(pool.stats().host_store_used_bytes, held_l1);
  pool.sleep(1);  // lighter than the current level: nothing comes back
  pool.wake_up();
  EXPECT_TRUE(this->all_poison(read(pool, l.param, l.n)));
  EXPECT_EQ(read(pool, l.preserved, l.n), l.preserved_bytes);
  EXPECT_EQ(read(pool, l.state, l.n), l.state_bytes);
}

TYPED_TEST(SleepTest, SleepReturnsTheMappedMemoryToTheDevice) {
  Pool pool(this->driver(), this->small_pool());
  std::size_t g = this->granularity();
  std::vector<void*> ptrs;
  for (int i = 0; i < 16; ++i) ptrs.push_back(pool.allocate(4 * g, {"weights", MemoryClass::parameter, ""}));
  for (int i = 0; i < 8; ++i) ptrs.push_back(pool.allocate(4 * g, {"kv_cache", MemoryClass::cache, ""}));
  std::size_t mapped = pool.stats().mapped_bytes;
  ASSERT_EQ(mapped, 96 * g);
  std::size_t free_before = this->driver().memory_info(0).free_bytes;
  pool.sleep(2);
  std::size_t free_asleep = this->driver().memory_info(0).free_bytes;
  double returned = (static_cast<double>(free_asleep) - static_cast<double>(free_before)) / static_cast<double>(mapped);
  std::printf("memory returned by sleep(2): %.6f of %zu mapped bytes (cuMemGetInfo)\n", returned, mapped);
  this->RecordProperty("returned_fraction", std::to_string(returned));
  EXPECT_GE(static_cast<double>(free_asleep) - static_cast<double>(free_before), 0.999 * static_cast<double>(mapped))
      << "cuMemGetInfo must show the memory returned";
  EXPECT_EQ(pool.stats().mapped_bytes, 0u);
  if (auto* h = this->host()) EXPECT_EQ(h->live_physical_bytes(0), 0u);
  pool.wake_up();
  EXPECT_EQ(pool.stats().mapped_bytes, mapped);
  for (void* p : ptrs) pool.deallocate(p);
}

TYPED_TEST(SleepTest, HostStoreIsReusedAcrossIdenticalCycles) {
  Pool pool(this->driver(), this->small_pool());
  auto l = this->fill(pool, 2 * this->granularity() + 17);
  pool.sleep(1);
  pool.wake_up();
  std::size_t held = pool.stats().host_store_bytes;
  EXPECT_GT(held, 0u);
  for (int cycle = 0; cycle < 3; ++cycle) {
    std::vector<std::uint8_t> v(16, static_cast<std::uint8_t>(cycle + 1));
    write(pool, l.param, v);  // changed bytes: the copy must happen again
    TransitionReport r = pool.sleep(1);
    EXPECT_GT(r.bytes_offloaded, 0u);
    pool.wake_up();
    EXPECT_EQ(pool.stats().host_store_bytes, held) << "no per-cycle host allocation";
  }
  // After wake the host copies are retained (skip_unchanged); release_host_store drops them
  // and gives every block back.
  EXPECT_EQ(pool.stats().host_store_used_bytes > 0, pool.stats().retained_bytes > 0);
  EXPECT_EQ(pool.release_host_store(), held);
  EXPECT_EQ(pool.stats().retained_bytes, 0u);
  EXPECT_EQ(pool.stats().host_store_used_bytes, 0u);
  EXPECT_EQ(read(pool, l.state, l.n), l.state_bytes);
}

TYPED_TEST(SleepTest, DeallocateWhileAsleepFreesTheHostCopy) {
  Pool pool(this->driver(), this->small_pool());
  void* a = pool.allocate(1000, {"weights", MemoryClass::state, ""});
  void* b = pool.allocate(1000, {"weights", MemoryClass::state, ""});  // same slab, one backup run
  std::mt19937_64 rng(3);
  auto bb = random_bytes(rng, 1000);
  write(pool, b, bb);
  pool.sleep(1);
  std::size_t used = pool.stats().host_store_used_bytes;
  EXPECT_GT(used, 0u);
  pool.deallocate(a);
  EXPECT_LT(pool.stats().host_store_used_bytes, used);
  pool.wake_up();
  EXPECT_EQ(read(pool, b, 1000), bb);
  pool.deallocate(b);
  void* big = pool.allocate(3 * this->granularity(), {"x", MemoryClass::state, ""});
  pool.sleep(1);
  pool.deallocate(big);
  EXPECT_EQ(pool.stats().host_store_used_bytes, 0u);
  EXPECT_EQ(pool.stats().chunks, 0u) << "the asleep chunk is gone with its last allocation";
}

TYPED_TEST(SleepTest, AllocateIntoASleepingTagIsAnErrorNamingIt) {
  Pool pool(this->driver(), this->small_pool());
  void* a = pool.allocate(1000, {"kv_cache", MemoryClass::cache, ""});
  pool.sleep(1, std::vector<std::string>{"kv_cache"});
  try {
    pool.allocate(1000, {"kv_cache", MemoryClass::cache, ""});
    FAIL() << "expected invalid_state";
  } catch (const invalid_state& e) {
    EXPECT_NE(std::string(e.what()).find("'kv_cache' is asleep"), std::string::npos) << e.what();
  }
  void* other = pool.allocate(1000, {"weights", MemoryClass::state, ""});  // other tags are fine
  pool.wake_up(std::vector<std::string>{"kv_cache"});
  void* b = pool.allocate(1000, {"kv_cache", MemoryClass::cache, ""});
  for (void* p : {a, b, other}) pool.deallocate(p);
}

TYPED_TEST(SleepTest, MarkWhileAsleepAppliesToTheNextSleep) {
  Pool pool(this->driver(), this->small_pool(FillOnWake::poison));
  void* a = pool.allocate(8192, {"weights", MemoryClass::state, ""});
  std::mt19937_64 rng(5);
  auto bytes = random_bytes(rng, 8192);
  write(pool, a, bytes);
  pool.sleep(2);
  pool.mark(a, 4096, MemoryClass::parameter, "w");  // the backup taken at sleep time stands
  pool.wake_up();
  EXPECT_EQ(read(pool, a, 8192), bytes);
  pool.sleep(2);
  pool.wake_up();
  auto after = read(pool, a, 8192);
  EXPECT_TRUE(std::all_of(after.begin(), after.begin() + 4096, [](std::uint8_t b) { return b == poison_byte; }));
  EXPECT_TRUE(std::equal(after.begin() + 4096, after.end(), bytes.begin() + 4096));
}

TYPED_TEST(SleepTest, ReportsAreJson) {
  Pool pool(this->driver(), this->small_pool());
  this->fill(pool, 1000);
  std::string j = to_json(pool.sleep(1));
  EXPECT_NE(j.find("\"operation\":\"sleep\""), std::string::npos) << j;
  EXPECT_NE(j.find("\"offload_and_release\""), std::string::npos) << j;
  j = to_json(pool.wake_up());
  EXPECT_NE(j.find("\"bytes_restored\":3000"), std::string::npos) << j;
}

}  // namespace
}  // namespace torpor::test
