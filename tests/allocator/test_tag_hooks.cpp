// Tag hooks (Pool::add_tag_hooks, torpor_add_tag_hooks): before_unmap in every sleep that unmaps
// a tag, before anything moves; after_map once per wake for every fully mapped hooked tag; the
// rollback rules of a failed sleep. Oracles: the bytes the test wrote (read inside the hooks: the
// memory is still / again mapped), the pool's own asleep state, and the calls the hooks recorded.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "support/backends.hpp"
#include "torpor/error.hpp"
#include "torpor/testing/fault_injecting_driver.hpp"
#include "torpor/torpor.h"

namespace torpor::test {
namespace {

template <typename B>
class TagHookTest : public BackendTest<B> {};
TYPED_TEST_SUITE(TagHookTest, Backends, BackendNames);

using Log = std::vector<std::string>;

TagHooks recording(Log& log, const std::string& who) {
  return TagHooks{[&log, who](const std::string& t) { log.push_back(who + " unmap " + t); },
                  [&log, who](const std::string& t) { log.push_back(who + " map " + t); }};
}

struct Recorder final : SleepObserver {
  explicit Recorder(Log& l) : log(l) {}
  void before_sleep(Pool&, int level, const std::vector<std::string>&) override {
    log.push_back("observer sleep " + std::to_string(level));
  }
  void after_wake(Pool&, const std::vector<std::string>&, bool ok) override {
    log.push_back(std::string("observer wake ") + (ok ? "ok" : "failed"));
  }
  Log& log;
};

TYPED_TEST(TagHookTest, BeforeUnmapRunsFirstWithTheBytesMappedAndAfterMapOncePerWakeAfterObservers) {
  std::size_t g = this->granularity();
  Pool pool(this->driver(), this->small_pool(FillOnWake::poison));
  std::mt19937_64 rng(26);
  void* kv = pool.allocate(g, {"kv_cache", MemoryClass::state, "kv"});
  void* w = pool.allocate(g, {"weights", MemoryClass::state, "w"});
  auto kv_bytes = random_bytes(rng, g);
  write(pool, kv, kv_bytes);
  Log log;
  Recorder observer(log);
  pool.add_observer(&observer);
  bool kv_mapped_in_before = false, kv_restored_in_after = false;
  pool.add_tag_hooks("kv_cache", TagHooks{[&](const std::string& t) {
                                            log.push_back("A unmap " + t);
                                            kv_mapped_in_before = read(pool, kv, g) == kv_bytes;
                                          },
                                          [&](const std::string& t) {
                                            log.push_back("A map " + t);
                                            kv_restored_in_after = read(pool, kv, g) == kv_bytes;
                                          }});
  pool.add_tag_hooks("kv_cache", recording(log, "B"));
  pool.add_tag_hooks("weights", recording(log, "W"));

  pool.sleep(1, {"kv_cache"});
  EXPECT_EQ(log, (Log{"A unmap kv_cache", "B unmap kv_cache", "observer sleep 1"}));
  EXPECT_TRUE(kv_mapped_in_before) << "before_unmap runs while the tag's bytes are still mapped";
  log.clear();
  pool.sleep(1, {"kv_cache"});
  EXPECT_EQ(log, (Log{"observer sleep 1"})) << "a tag already asleep has nothing mapped: no before_unmap";
  log.clear();
  pool.wake_up({"kv_cache"});
  // Every fully mapped hooked tag, once, the observers first; weights never slept (vLLM's rule).
  EXPECT_EQ(log, (Log{"observer wake ok", "A map kv_cache", "B map kv_cache", "W map weights"}));
  EXPECT_TRUE(kv_restored_in_after) << "after_map runs once the bytes are back";
  log.clear();
  pool.sleep(0);
  EXPECT_TRUE(log.empty()) << "level 0 unmaps nothing";
  pool.remove_observer(&observer);
  pool.deallocate(w);
  pool.deallocate(kv);
}

TYPED_TEST(TagHookTest, APartialWakeMapsOnlyTheTagsItLeftFullyMapped) {
  std::size_t g = this->granularity();
  Pool pool(this->driver(), this->small_pool());
  void* kv = pool.allocate(g, {"kv_cache", MemoryClass::cache, "kv_cache"});
  void* w = pool.allocate(g, {"weights", MemoryClass::parameter, "weights"});
  Log log;
  pool.add_tag_hooks("kv_cache", recording(log, "K"));
  pool.add_tag_hooks("weights", recording(log, "W"));
  pool.add_tag_hooks("never_allocated", recording(log, "N"));
  pool.sleep(2);
  EXPECT_EQ(log, (Log{"K unmap kv_cache", "W unmap weights"})) << "a tag the pool does not know is not unmapped";
  log.clear();
  pool.wake_up({"weights"});  // the RL pattern: weights first, KV cache later
  EXPECT_EQ(log, (Log{"W map weights", "N map never_allocated"}));
  log.clear();
  pool.wake_up({"kv_cache"});
  EXPECT_EQ(log, (Log{"K map kv_cache", "W map weights", "N map never_allocated"}));
  pool.deallocate(kv);
  pool.deallocate(w);
}

TYPED_TEST(TagHookTest, ARefusingBeforeUnmapAbortsTheSleepAndMapsAgainWhatItToreDown) {
  std::size_t g = this->granularity();
  Pool pool(this->driver(), this->small_pool());
  std::mt19937_64 rng(7);
  void* kv = pool.allocate(g, {"kv_cache", MemoryClass::state, "kv_cache"});
  void* w = pool.allocate(g, {"weights", MemoryClass::state, "weights"});
  auto kv_bytes = random_bytes(rng, g), w_bytes = random_bytes(rng, g);
  write(pool, kv, kv_bytes);
  write(pool, w, w_bytes);
  Log log;
  pool.add_tag_hooks("kv_cache", recording(log, "K"));
  pool.add_tag_hooks("weights", TagHooks{[&](const std::string& t) {
                                           log.push_back("W unmap " + t);
                                           throw invalid_state("transport still busy (the test's hook)");
                                         },
                                         [&](const std::string& t) { log.push_back("W map " + t); }});
  std::size_t mapped = pool.stats().mapped_bytes;
  try {
    pool.sleep(1);
    FAIL() << "the refusing hook's error must leave the sleep";
  } catch (const invalid_state& e) {
    EXPECT_NE(std::string(e.what()).find("transport still busy"), std::string::npos) << e.what();
  }
  EXPECT_EQ(log, (Log{"K unmap kv_cache", "W unmap weights", "K map kv_cache", "W map weights"}));
  EXPECT_FALSE(pool.asleep("kv_cache"));
  EXPECT_FALSE(pool.asleep("weights"));
  EXPECT_EQ(pool.stats().mapped_bytes, mapped) << "nothing moved";
  EXPECT_EQ(read(pool, kv, g), kv_bytes);
  EXPECT_EQ(read(pool, w, g), w_bytes);
  pool.deallocate(kv);
  pool.deallocate(w);
}

TYPED_TEST(TagHookTest, AnEngineFailureMapsAgainOnlyTheTagsLeftMappedAndTheRepeatUnmapsTheRest) {
  std::size_t g = this->granularity();
  FaultInjectingDriver faulty(this->driver());
  Pool pool(faulty, this->small_pool());
  void* a = pool.allocate(g, {"a", MemoryClass::state, "a"});
  void* b = pool.allocate(g, {"b", MemoryClass::state, "b"});
  Log log;
  pool.add_tag_hooks("a", recording(log, "A"));
  pool.add_tag_hooks("b", recording(log, "B"));
  faulty.fail_nth(DriverCall::unmap, 2);  // one chunk falls asleep, the other stays mapped
  EXPECT_THROW(pool.sleep(1), error);
  faulty.clear();
  ASSERT_NE(pool.asleep("a"), pool.asleep("b")) << "the fault was meant to stop between the two chunks";
  const std::string mapped = pool.asleep("a") ? "b" : "a", asleep = pool.asleep("a") ? "a" : "b";
  const std::string M = mapped == "a" ? "A" : "B";
  EXPECT_EQ(log, (Log{"A unmap a", "B unmap b", M + " map " + mapped}))
      << "only the tag the failed sleep left mapped gets after_map";
  log.clear();
  pool.sleep(1);  // the repeat completes the sleep: only the mapped tag is unmapped now
  EXPECT_EQ(log, (Log{M + " unmap " + mapped}));
  log.clear();
  pool.wake_up();
  EXPECT_EQ(log, (Log{"A map a", "B map b"}));
  (void)asleep;
  pool.deallocate(a);
  pool.deallocate(b);
}

TYPED_TEST(TagHookTest, AFailedWakeMapsNothingThatStaysAsleepAndTheRetryDoes) {
  std::size_t g = this->granularity();
  FaultInjectingDriver faulty(this->driver());
  Pool pool(faulty, this->small_pool());
  void* a = pool.allocate(g, {"a", MemoryClass::state, "a"});
  Log log;
  pool.add_tag_hooks("a", recording(log, "A"));
  pool.add_tag_hooks("b", recording(log, "B"));  // unknown to the pool: fully mapped
  pool.sleep(1);
  log.clear();
  faulty.fail_nth(DriverCall::create, 1);
  EXPECT_THROW(pool.wake_up(), out_of_memory);
  faulty.clear();
  EXPECT_TRUE(pool.asleep("a"));
  EXPECT_EQ(log, (Log{"B map b"}));
  log.clear();
  pool.wake_up();
  EXPECT_EQ(log, (Log{"A map a", "B map b"}));
  pool.deallocate(a);
}

TYPED_TEST(TagHookTest, RemovedHooksAreNotCalledAndBadRegistrationsAreRefused) {
  std::size_t g = this->granularity();
  Pool pool(this->driver(), this->small_pool());
  void* a = pool.allocate(g, {"a", MemoryClass::state, "a"});
  Log log;
  std::uint64_t id = pool.add_tag_hooks("a", recording(log, "A"));
  pool.add_tag_hooks("a", TagHooks{{}, [&](const std::string& t) { log.push_back("only-map " + t); }});
  pool.remove_tag_hooks(id);
  pool.sleep(1);
  pool.wake_up();
  EXPECT_EQ(log, (Log{"only-map a"}));
  EXPECT_THROW(pool.remove_tag_hooks(id), invalid_argument);
  EXPECT_THROW(pool.add_tag_hooks("", recording(log, "E")), invalid_argument);
  EXPECT_THROW(pool.add_tag_hooks("a", TagHooks{}), invalid_argument);
  pool.deallocate(a);
}

// A caller whose wake maps nothing (vLLM's wake_up of tags already awake, the others deferred)
// still runs after_map for what is fully mapped, as vLLM's allocator does after every wake-up: a
// tag asleep is not, a hooked tag with no memory yet is (vacuously mapped).
TYPED_TEST(TagHookTest, RunAfterMapHooksCallsEveryFullyMappedHookedTagAndNoSleepingOne) {
  std::size_t g = this->granularity();
  Pool pool(this->driver(), this->small_pool());
  void* w = pool.allocate(g, {"weights", MemoryClass::state, "w"});
  void* kv = pool.allocate(g, {"kv_cache", MemoryClass::state, "kv"});
  Log log;
  pool.add_tag_hooks("weights", recording(log, "W"));
  pool.add_tag_hooks("kv_cache", recording(log, "KV"));
  pool.add_tag_hooks("later", recording(log, "L"));
  pool.sleep(1, {"kv_cache"});
  ASSERT_TRUE(pool.asleep("kv_cache"));
  log.clear();
  pool.run_after_map_hooks();
  EXPECT_EQ(log, (Log{"W map weights", "L map later"}));
  log.clear();
  pool.wake_up({"weights"});  // nothing of weights is asleep: the wake maps nothing, hooks still run
  EXPECT_EQ(log, (Log{"W map weights", "L map later"}));
  log.clear();
  pool.wake_up({"kv_cache"});
  EXPECT_EQ(log, (Log{"W map weights", "KV map kv_cache", "L map later"}));
  pool.deallocate(w);
  pool.deallocate(kv);
}

// The C entry points: a refusal's status and text reach torpor_sleep's caller.
struct CLog {
  std::vector<std::string> calls;
  torpor_status refuse = TORPOR_OK;
};

torpor_status c_before(void* user, torpor_pool_t, const char* tag, char* message, size_t capacity) {
  auto* log = static_cast<CLog*>(user);
  log->calls.push_back(std::string("unmap ") + tag);
  if (log->refuse == TORPOR_OK) return TORPOR_OK;
  std::snprintf(message, capacity, "%s", "NIXL deregistration failed (the test's hook)");
  return log->refuse;
}

void c_after(void* user, torpor_pool_t, const char* tag) {
  static_cast<CLog*>(user)->calls.push_back(std::string("map ") + tag);
}

TEST(CTagHooks, RegisterRefuseAndRemoveThroughTheCApi) {
  torpor_pool_options o;
  torpor_pool_options_init(&o);
  o.backend = TORPOR_BACKEND_HOST;
  o.va_bytes = std::size_t{1} << 30;
  torpor_pool_t pool = nullptr;
  ASSERT_EQ(torpor_pool_create(&o, &pool), TORPOR_OK) << torpor_last_error();
  void* kv = nullptr;
  ASSERT_EQ(torpor_alloc(pool, 4096, "kv_cache", TORPOR_CLASS_CACHE, "kv", &kv), TORPOR_OK);
  CLog log;
  unsigned long long id = 0;
  EXPECT_EQ(torpor_add_tag_hooks(pool, nullptr, c_before, c_after, &log, &id), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(torpor_add_tag_hooks(pool, "kv_cache", nullptr, nullptr, &log, &id), TORPOR_ERROR_INVALID_ARGUMENT);
  ASSERT_EQ(torpor_add_tag_hooks(pool, "kv_cache", c_before, c_after, &log, &id), TORPOR_OK) << torpor_last_error();
  log.refuse = TORPOR_ERROR_TIMEOUT;
  EXPECT_EQ(torpor_sleep(pool, 2, nullptr, 0), TORPOR_ERROR_TIMEOUT);
  EXPECT_NE(std::string(torpor_last_error()).find("NIXL deregistration failed"), std::string::npos)
      << torpor_last_error();
  EXPECT_EQ(log.calls, (std::vector<std::string>{"unmap kv_cache", "map kv_cache"}));
  log.calls.clear();
  log.refuse = TORPOR_OK;
  ASSERT_EQ(torpor_sleep(pool, 2, nullptr, 0), TORPOR_OK) << torpor_last_error();
  ASSERT_EQ(torpor_wake_up(pool, nullptr, 0), TORPOR_OK) << torpor_last_error();
  EXPECT_EQ(log.calls, (std::vector<std::string>{"unmap kv_cache", "map kv_cache"}));
  ASSERT_EQ(torpor_remove_tag_hooks(pool, id), TORPOR_OK) << torpor_last_error();
  EXPECT_EQ(torpor_remove_tag_hooks(pool, id), TORPOR_ERROR_INVALID_ARGUMENT);
  ASSERT_EQ(torpor_sleep(pool, 2, nullptr, 0), TORPOR_OK);
  ASSERT_EQ(torpor_wake_up(pool, nullptr, 0), TORPOR_OK);
  EXPECT_EQ(log.calls.size(), 2u) << "a removed hook is not called";
  EXPECT_EQ(torpor_free(pool, kv), TORPOR_OK);
  EXPECT_EQ(torpor_pool_destroy(pool), TORPOR_OK);
}

}  // namespace
}  // namespace torpor::test
