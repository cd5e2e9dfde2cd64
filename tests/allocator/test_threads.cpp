// Thread safety: concurrent allocate/free/mark in several tags while another thread sleeps
// and wakes one tag. Run under TSan in CI (see README).
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "support/backends.hpp"
#include "torpor/error.hpp"

namespace torpor::test {
namespace {

TEST(PoolThreads, ConcurrentAllocationWhileAnotherTagSleeps) {
  HostDriver driver(HostBackend::options());
  PoolOptions o;
  o.va_bytes = std::size_t{512} << 20;
  Pool pool(driver, o);
  void* flags = pool.allocate(4096, {"sleeper", MemoryClass::state, ""});
  std::vector<std::uint8_t> pattern(4096, 0xA5);
  write(pool, flags, pattern);
  std::atomic<bool> stop{false};
  std::atomic<int> errors{0};
  std::vector<std::thread> workers;
  for (int t = 0; t < 4; ++t) {
    workers.emplace_back([&, t] {
      std::mt19937_64 rng(static_cast<std::uint64_t>(t));
      std::string tag = "worker" + std::to_string(t);
      std::vector<void*> live;
      for (int i = 0; i < 400; ++i) {
        if (live.size() < 8 || rng() % 2 == 0) {
          std::size_t n = 1 + rng() % 200000;
          void* p = pool.allocate(n, {tag, static_cast<MemoryClass>(rng() % 3), ""});
          std::vector<std::uint8_t> v(16, static_cast<std::uint8_t>(i));
          pool.copy(p, v.data(), 16);
          if (pool.find(p)->tag != tag) ++errors;
          live.push_back(p);
        } else {
          std::size_t k = rng() % live.size();
          pool.deallocate(live[k]);
          live.erase(live.begin() + static_cast<long>(k));
        }
      }
      for (void* p : live) pool.deallocate(p);
    });
  }
  std::thread sleeper([&] {
    std::vector<std::string> tag{"sleeper"};
    while (!stop) {
      pool.sleep(1, tag);
      (void)pool.stats();
      pool.wake_up(tag);
    }
  });
  for (auto& w : workers) w.join();
  stop = true;
  sleeper.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(read(pool, flags, 4096), pattern);
  pool.deallocate(flags);
  EXPECT_EQ(pool.stats().allocations, 0u);
}

}  // namespace
}  // namespace torpor::test
