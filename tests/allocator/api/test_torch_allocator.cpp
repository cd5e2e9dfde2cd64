// The PyTorch pluggable-allocator entry points, called as PyTorch calls them, on the host
// backend: segments land in the thread's current tag and class, survive sleep by class, and
// every failure returns NULL (or logs) with a message naming the cause.
#include <gtest/gtest.h>

#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "torpor/torch_allocator.h"

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

// Every test configures the same options, so they also pass when run in one process.
torpor_pool_t host_pool() {
  torpor_pool_options o;
  torpor_pool_options_init(&o);
  o.backend = TORPOR_BACKEND_HOST;
  o.fill_on_wake = TORPOR_FILL_POISON;
  o.va_bytes = std::size_t{1} << 30;
  EXPECT_EQ(torpor_torch_configure(&o), TORPOR_OK) << torpor_last_error();
  torpor_pool_t pool = nullptr;
  EXPECT_EQ(torpor_torch_pool(0, &pool), TORPOR_OK) << torpor_last_error();
  return pool;
}

nlohmann::json stats(torpor_pool_t pool) {
  size_t needed = 0;
  EXPECT_EQ(torpor_stats_json(pool, nullptr, 0, &needed), TORPOR_OK);
  std::string s(needed, '\0');
  EXPECT_EQ(torpor_stats_json(pool, s.data(), s.size(), &needed), TORPOR_OK);
  s.resize(needed - 1);
  return nlohmann::json::parse(s);
}

std::vector<unsigned char> read(torpor_pool_t pool, void* p, std::size_t n) {
  std::vector<unsigned char> v(n);
  EXPECT_EQ(torpor_copy(pool, v.data(), p, n), TORPOR_OK) << torpor_last_error();
  return v;
}

struct Restore {
  ~Restore() {
    torpor_set_current_tag(nullptr);
    torpor_set_current_class(TORPOR_CLASS_STATE);
  }
};

TEST(TorchAllocator, SegmentsFollowTheCurrentTagAndClass) {
  Restore restore;
  torpor_pool_t pool = host_pool();
  EXPECT_STREQ(torpor_current_tag(), "default");
  EXPECT_EQ(torpor_current_class(), TORPOR_CLASS_STATE);
  unsigned long long failures = torpor_torch_failures(nullptr);

  ASSERT_EQ(torpor_set_current_tag("weights"), TORPOR_OK);
  void* w = torpor_torch_malloc(4 * MiB, 0, nullptr);
  ASSERT_NE(w, nullptr) << torpor_last_error();
  ASSERT_EQ(torpor_set_current_tag("kv_cache"), TORPOR_OK);
  ASSERT_EQ(torpor_set_current_class(TORPOR_CLASS_CACHE), TORPOR_OK);
  void* kv = torpor_torch_malloc(2 * MiB, 0, nullptr);
  ASSERT_NE(kv, nullptr) << torpor_last_error();

  auto st = stats(pool);
  EXPECT_EQ(st["tags"]["weights"]["classes"]["state"]["allocated_bytes"], 4 * MiB);
  EXPECT_EQ(st["tags"]["kv_cache"]["classes"]["cache"]["allocated_bytes"], 2 * MiB);

  std::vector<unsigned char> pattern(4 * MiB);
  for (std::size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<unsigned char>(i * 13 + 5);
  ASSERT_EQ(torpor_copy(pool, w, pattern.data(), pattern.size()), TORPOR_OK);
  ASSERT_EQ(torpor_copy(pool, kv, pattern.data(), 2 * MiB), TORPOR_OK);
  const char* both[] = {"weights", "kv_cache"};
  ASSERT_EQ(torpor_sleep(pool, 2, both, 2), TORPOR_OK) << torpor_last_error();
  EXPECT_EQ(stats(pool)["tags"]["weights"]["mapped_bytes"], 0u);
  ASSERT_EQ(torpor_wake_up(pool, both, 2), TORPOR_OK) << torpor_last_error();
  EXPECT_EQ(read(pool, w, pattern.size()), pattern) << "state survives level 2";
  EXPECT_EQ(read(pool, kv, 2 * MiB), std::vector<unsigned char>(2 * MiB, 0xFF)) << "cache is discarded (poison)";

  torpor_torch_free(w, 4 * MiB, 0, nullptr);
  torpor_torch_free(kv, 2 * MiB, 0, nullptr);
  EXPECT_EQ(torpor_torch_failures(nullptr), failures) << torpor_last_error();
  EXPECT_EQ(stats(pool)["tags"]["weights"]["allocations"], 0u);
}

TEST(TorchAllocator, PoolsArePerDeviceAndCreatedOnce) {
  Restore restore;
  torpor_pool_t p0 = host_pool();
  torpor_pool_t again = nullptr, p1 = nullptr;
  ASSERT_EQ(torpor_torch_pool(0, &again), TORPOR_OK);
  EXPECT_EQ(again, p0);
  ASSERT_EQ(torpor_torch_pool(1, &p1), TORPOR_OK) << torpor_last_error();
  EXPECT_NE(p1, p0);
  void* a = torpor_torch_malloc(2 * MiB, 1, nullptr);
  ASSERT_NE(a, nullptr) << torpor_last_error();
  EXPECT_EQ(stats(p1)["device"], 1);
  EXPECT_EQ(stats(p1)["allocations"], 1u);
  EXPECT_EQ(torpor_find(p0, a, nullptr, nullptr), TORPOR_ERROR_INVALID_ARGUMENT) << "device 1's segment";
  torpor_torch_free(a, 2 * MiB, 1, nullptr);
  EXPECT_EQ(stats(p1)["allocations"], 0u);
}

// Issue 33 N15: destroying the pool behind PyTorch's allocator was accepted while a segment
// lived in it, and the next write to that segment crashed.
TEST(TorchAllocator, ThePoolBehindPyTorchCannotBeDestroyedAndItsSegmentsStayUsable) {
  Restore restore;
  torpor_pool_t pool = host_pool();
  void* a = torpor_torch_malloc(2 * MiB, 0, nullptr);
  ASSERT_NE(a, nullptr) << torpor_last_error();
  EXPECT_EQ(torpor_pool_destroy(pool), TORPOR_ERROR_INVALID_STATE);
  const std::string why = torpor_last_error();
  EXPECT_NE(why.find("behind PyTorch's allocator on device 0"), std::string::npos) << why;
  EXPECT_NE(why.find("lives until the process exits"), std::string::npos) << why;
  std::vector<unsigned char> bytes(4096);
  for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<unsigned char>(i * 7 + 1);
  ASSERT_EQ(torpor_copy(pool, a, bytes.data(), bytes.size()), TORPOR_OK) << torpor_last_error();
  EXPECT_EQ(read(pool, a, bytes.size()), bytes);
  torpor_torch_free(a, 2 * MiB, 0, nullptr);
  torpor_pool_t again = nullptr;
  ASSERT_EQ(torpor_torch_pool(0, &again), TORPOR_OK);
  EXPECT_EQ(again, pool) << "the same pool serves later segments";
  // A pool of one's own is destroyed as before.
  torpor_pool_options o;
  torpor_pool_options_init(&o);
  o.backend = TORPOR_BACKEND_HOST;
  torpor_pool_t own = nullptr;
  ASSERT_EQ(torpor_pool_create(&o, &own), TORPOR_OK) << torpor_last_error();
  EXPECT_EQ(torpor_pool_destroy(own), TORPOR_OK) << torpor_last_error();
}

TEST(TorchAllocator, FailuresReturnNullAndKeepTheMessage) {
  Restore restore;
  torpor_pool_t pool = host_pool();
  unsigned long long failures = torpor_torch_failures(nullptr);

  ASSERT_EQ(torpor_set_current_tag("sleeper"), TORPOR_OK);
  void* s = torpor_torch_malloc(2 * MiB, 0, nullptr);
  ASSERT_NE(s, nullptr) << torpor_last_error();
  const char* sleeper[] = {"sleeper"};
  ASSERT_EQ(torpor_sleep(pool, 1, sleeper, 1), TORPOR_OK) << torpor_last_error();
  EXPECT_EQ(torpor_torch_malloc(2 * MiB, 0, nullptr), nullptr);
  std::string msg = torpor_last_error();
  EXPECT_NE(msg.find("torpor_torch_malloc"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'sleeper' is asleep"), std::string::npos) << msg;
  torpor_status last = TORPOR_OK;
  EXPECT_EQ(torpor_torch_failures(&last), failures + 1);
  EXPECT_EQ(last, TORPOR_ERROR_INVALID_STATE);

  EXPECT_EQ(torpor_torch_malloc(2 * MiB, 99, nullptr), nullptr);
  msg = torpor_last_error();
  EXPECT_NE(msg.find("device 99"), std::string::npos) << msg;
  EXPECT_EQ(torpor_torch_failures(&last), failures + 2);
  EXPECT_EQ(last, TORPOR_ERROR_INVALID_ARGUMENT);

  int local = 0;
  torpor_torch_free(&local, 4, 0, nullptr);
  msg = torpor_last_error();
  EXPECT_NE(msg.find("not allocated by this pool"), std::string::npos) << msg;
  torpor_torch_free(&local, 4, 7, nullptr);
  msg = torpor_last_error();
  EXPECT_NE(msg.find("no pool for device 7"), std::string::npos) << msg;
  EXPECT_EQ(torpor_torch_failures(nullptr), failures + 4);
  torpor_torch_free(nullptr, 0, 0, nullptr);
  EXPECT_EQ(torpor_torch_failures(nullptr), failures + 4) << "free(NULL) is a no-op";

  EXPECT_EQ(torpor_set_current_class(7), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(torpor_last_error()).find("unknown memory class 7"), std::string::npos);
  EXPECT_EQ(torpor_set_current_tag(""), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(torpor_current_tag(), "sleeper") << "a rejected tag changes nothing";

  // The sleeping segment can still be freed (PyTorch may release it while the tag sleeps).
  torpor_torch_free(s, 2 * MiB, 0, nullptr);
  EXPECT_EQ(torpor_torch_failures(nullptr), failures + 4) << torpor_last_error();
  ASSERT_EQ(torpor_wake_up(pool, sleeper, 1), TORPOR_OK);
}

TEST(TorchAllocator, ConfigureIsRefusedOnceOtherOptionsAreInUse) {
  torpor_pool_t pool = host_pool();
  ASSERT_NE(pool, nullptr);
  torpor_pool_options o;
  torpor_pool_options_init(&o);
  o.backend = TORPOR_BACKEND_HOST;
  o.fill_on_wake = TORPOR_FILL_ZERO;
  o.va_bytes = std::size_t{1} << 30;
  EXPECT_EQ(torpor_torch_configure(&o), TORPOR_ERROR_INVALID_STATE);
  EXPECT_NE(std::string(torpor_last_error()).find("device(s) 0"), std::string::npos) << torpor_last_error();
  o.fill_on_wake = 9;
  EXPECT_EQ(torpor_torch_configure(&o), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(torpor_torch_pool(0, nullptr), TORPOR_ERROR_INVALID_ARGUMENT);
}

// Once the pools exist, the same options are accepted again and a change of any one field of
// torpor_pool_options (the device aside: configure applies to every device) is refused; an
// empty spill_dir is the same as none.
TEST(TorchAllocator, ConfigureComparesEveryField) {
  ASSERT_NE(host_pool(), nullptr);
  auto same = [] {
    torpor_pool_options o;
    torpor_pool_options_init(&o);
    o.backend = TORPOR_BACKEND_HOST;
    o.fill_on_wake = TORPOR_FILL_POISON;
    o.va_bytes = std::size_t{1} << 30;
    return o;
  };
  torpor_pool_options o = same();
  EXPECT_EQ(torpor_torch_configure(&o), TORPOR_OK) << torpor_last_error();
  o.device = 3;
  EXPECT_EQ(torpor_torch_configure(&o), TORPOR_OK) << "the device is not an option of the pools";
  const std::vector<std::pair<const char*, void (*)(torpor_pool_options&)>> changes = {
      {"backend", [](torpor_pool_options& c) { c.backend = TORPOR_BACKEND_AUTO; }},
      {"va_bytes", [](torpor_pool_options& c) { c.va_bytes *= 2; }},
      {"fill_on_wake", [](torpor_pool_options& c) { c.fill_on_wake = TORPOR_FILL_ZERO; }},
      {"exportable", [](torpor_pool_options& c) { c.exportable = 1; }},
      {"skip_unchanged", [](torpor_pool_options& c) { c.skip_unchanged = 0; }},
      {"host_store_limit", [](torpor_pool_options& c) { c.host_store_limit = 64 * MiB; }},
      {"host_store_prepare", [](torpor_pool_options& c) { c.host_store_prepare = 2 * MiB; }},
      {"spill_dir", [](torpor_pool_options& c) { c.spill_dir = "/tmp/torpor-configure-test"; }},
      {"spill_limit", [](torpor_pool_options& c) { c.spill_limit = 64 * MiB; }},
      {"spill_file_per_allocation", [](torpor_pool_options& c) { c.spill_file_per_allocation = 1; }},
  };
  for (const auto& [field, change] : changes) {
    o = same();
    change(o);
    EXPECT_EQ(torpor_torch_configure(&o), TORPOR_ERROR_INVALID_STATE) << field << " changed: " << torpor_last_error();
  }
  o = same();
  o.spill_dir = "";
  EXPECT_EQ(torpor_torch_configure(&o), TORPOR_OK) << "an empty spill_dir is none: " << torpor_last_error();
  o = same();
  o.skip_unchanged = 2;
  EXPECT_EQ(torpor_torch_configure(&o), TORPOR_ERROR_INVALID_ARGUMENT) << "checked as torpor_pool_create checks it";
  EXPECT_NE(std::string(torpor_last_error()).find("torpor_torch_configure: skip_unchanged 2 is not 0 or 1"),
            std::string::npos)
      << torpor_last_error();
  o = same();
  o.backend = 7;
  EXPECT_EQ(torpor_torch_configure(&o), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_STREQ(torpor_last_error(), "torpor_torch_configure: unknown backend 7 (0 auto, 1 host, 2 cuda)");
  o = same();
  EXPECT_EQ(torpor_torch_configure(&o), TORPOR_OK) << "a refused configure changed nothing: " << torpor_last_error();
}

TEST(TorchAllocatorThreads, TagsAndClassesAreThreadLocal) {
  torpor_pool_t pool = host_pool();
  constexpr int threads = 4, per_thread = 6;
  std::vector<std::vector<void*>> got(threads);
  std::vector<std::string> errors(threads);
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      std::string tag = "thread" + std::to_string(t);
      torpor_set_current_tag(tag.c_str());
      torpor_set_current_class(t % 2 == 0 ? TORPOR_CLASS_STATE : TORPOR_CLASS_CACHE);
      for (int i = 0; i < per_thread; ++i) {
        void* p = torpor_torch_malloc(2 * MiB, 0, nullptr);
        if (p == nullptr) errors[t] = torpor_last_error();
        got[t].push_back(p);
        if (torpor_current_tag() != tag) errors[t] = "tag changed under the thread";
      }
    });
  }
  for (auto& w : workers) w.join();
  EXPECT_STREQ(torpor_current_tag(), "default") << "the main thread's tag is its own";
  auto st = stats(pool);
  for (int t = 0; t < threads; ++t) {
    EXPECT_EQ(errors[t], "") << "thread " << t;
    auto& tag = st["tags"]["thread" + std::to_string(t)];
    EXPECT_EQ(tag["allocations"], static_cast<unsigned>(per_thread));
    EXPECT_EQ(tag["classes"][t % 2 == 0 ? "state" : "cache"]["allocated_bytes"], per_thread * 2 * MiB);
  }
  for (int t = 0; t < threads; ++t)
    for (void* p : got[t]) torpor_torch_free(p, 2 * MiB, 0, nullptr);
  EXPECT_EQ(stats(pool)["allocations"], 0u);
}

}  // namespace
