// The README's ten-line C++ example, compiled and run on the host backend, so the README
// cannot drift from the API (tests/python/test_readme_commands.py checks that every statement of
// the README's block is one of this test's).
#include <gtest/gtest.h>

#include "torpor/backend.hpp"
#include "torpor/pool.hpp"

TEST(Readme, TenLineExample) {
  auto sel = torpor::open_driver(torpor::Backend::host);
  torpor::Pool pool(*sel.driver, {.device = 0});
  void* w = pool.allocate(64 << 20, {"weights", torpor::MemoryClass::parameter, "layers.0.w"});
  void* f = pool.allocate(4096, {"weights", torpor::MemoryClass::state, "tail.flags"});
  void* kv = pool.allocate(1 << 30, {"kv_cache", torpor::MemoryClass::cache, ""});
  std::vector<unsigned char> flags(4096, 0x5A);
  pool.copy(f, flags.data(), flags.size());
  pool.sleep(2);
  pool.wake_up({"weights"});
  pool.wake_up({"kv_cache"});
  std::vector<unsigned char> back(4096);
  pool.copy(back.data(), f, back.size());
  EXPECT_EQ(back, flags);
  EXPECT_EQ(pool.find(w)->base, reinterpret_cast<torpor::device_ptr>(w));
  EXPECT_EQ(pool.find(kv)->tag, "kv_cache");
}
