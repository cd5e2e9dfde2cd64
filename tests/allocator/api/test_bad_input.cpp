// Bad input: each row of the table gets a clear error and changes nothing.
#include <gtest/gtest.h>

#include "support/backends.hpp"
#include "torpor/error.hpp"
#include "torpor/torpor.h"

namespace torpor::test {
namespace {

template <typename B>
class BadInputTest : public BackendTest<B> {
 protected:
  // The pool's observable state, to prove a rejected call changed nothing.
  static std::string snapshot(Pool& pool) { return to_json(pool.stats()); }

  template <typename E, typename F>
  void expect_rejected(Pool& pool, F&& f, const std::string& needle) {
    std::string before = snapshot(pool);
    try {
      f();
      ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
    } catch (const E& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(snapshot(pool), before) << "a rejected call must change nothing";
  }
};
TYPED_TEST_SUITE(BadInputTest, Backends, BackendNames);

TYPED_TEST(BadInputTest, ZeroBytes) {
  Pool pool(this->driver(), this->small_pool());
  this->template expect_rejected<invalid_argument>(
      pool, [&] { pool.allocate(0); }, "size 0");
}

TYPED_TEST(BadInputTest, MoreThanTheReservation) {
  Pool pool(this->driver(), this->small_pool());
  this->template expect_rejected<invalid_argument>(
      pool, [&] { pool.allocate(pool.va_bytes() + 1); }, "exceed the pool's whole VA reservation");
}

TYPED_TEST(BadInputTest, DoubleFree) {
  Pool pool(this->driver(), this->small_pool());
  void* keep = pool.allocate(100);
  void* p = pool.allocate(100);
  pool.deallocate(p);
  this->template expect_rejected<invalid_argument>(
      pool, [&] { pool.deallocate(p); }, "double free");
  pool.deallocate(keep);
}

TYPED_TEST(BadInputTest, FreeOfUnknownPointer) {
  Pool pool(this->driver(), this->small_pool());
  void* keep = pool.allocate(100);
  int on_stack = 0;
  this->template expect_rejected<invalid_argument>(
      pool, [&] { pool.deallocate(&on_stack); }, "was not allocated by this pool");
  this->template expect_rejected<invalid_argument>(
      pool, [&] { pool.deallocate(nullptr); }, "null pointer");
  pool.deallocate(keep);
}

TYPED_TEST(BadInputTest, FreeOfInteriorPointer) {
  Pool pool(this->driver(), this->small_pool());
  void* p = pool.allocate(1000);
  this->template expect_rejected<invalid_argument>(
      pool, [&] { pool.deallocate(at(p, 10)); }, "pass the allocation's base address");
  pool.deallocate(p);
}

TYPED_TEST(BadInputTest, MarkOutsideAnyAllocation) {
  Pool pool(this->driver(), this->small_pool());
  void* p = pool.allocate(1000);
  int on_stack = 0;
  this->template expect_rejected<invalid_argument>(
      pool, [&] { pool.mark(&on_stack, 4, MemoryClass::parameter); }, "not inside any allocation");
  this->template expect_rejected<invalid_argument>(
      pool, [&] { pool.mark(at(p, 900), 200, MemoryClass::parameter); }, "runs past the end");
  this->template expect_rejected<invalid_argument>(
      pool, [&] { pool.mark(p, 0, MemoryClass::parameter); }, "size 0");
  pool.deallocate(p);
}

TYPED_TEST(BadInputTest, UnknownClass) {
  Pool pool(this->driver(), this->small_pool());
  void* p = pool.allocate(1000);
  this->template expect_rejected<invalid_argument>(
      pool,
      [&] {
        pool.allocate(10, {"t", static_cast<MemoryClass>(7), ""});
      },
      "unknown memory class 7");
  this->template expect_rejected<invalid_argument>(
      pool, [&] { pool.mark(p, 10, static_cast<MemoryClass>(3)); }, "unknown memory class 3");
  EXPECT_THROW(parse_memory_class("weights"), invalid_argument);
  pool.deallocate(p);
}

TYPED_TEST(BadInputTest, SleepLevelOutOfRange) {
  Pool pool(this->driver(), this->small_pool());
  void* p = pool.allocate(1000);
  this->template expect_rejected<invalid_argument>(
      pool, [&] { pool.sleep(3); }, "level 3 is not 0, 1 or 2");
  this->template expect_rejected<invalid_argument>(
      pool, [&] { pool.sleep(-1); }, "level -1");
  this->template expect_rejected<invalid_argument>(
      pool, [&] { pool.sleep(static_cast<SleepLevel>(3)); }, "level 3 is not 0, 1 or 2");
  EXPECT_THROW(parse_sleep_level("deep"), invalid_argument);
  EXPECT_THROW(parse_sleep_level("3"), invalid_argument);
  pool.deallocate(p);
}

TYPED_TEST(BadInputTest, WakeOrSleepOfUnknownTag) {
  Pool pool(this->driver(), this->small_pool());
  void* p = pool.allocate(1000, {"weights", MemoryClass::state, ""});
  pool.sleep(1);
  std::vector<std::string> bad{"weights", "kv_cahce"};
  this->template expect_rejected<invalid_argument>(
      pool, [&] { pool.wake_up(bad); }, "unknown tag 'kv_cahce' (known tags: 'weights')");
  EXPECT_TRUE(pool.asleep("weights")) << "no tag of a rejected call woke";
  pool.wake_up();
  this->template expect_rejected<invalid_argument>(
      pool, [&] { pool.sleep(1, bad); }, "unknown tag 'kv_cahce'");
  EXPECT_FALSE(pool.asleep("weights"));
  pool.deallocate(p);
}

TYPED_TEST(BadInputTest, AllocateIntoASleepingTag) {
  Pool pool(this->driver(), this->small_pool());
  void* p = pool.allocate(1000, {"kv_cache", MemoryClass::cache, ""});
  pool.sleep(2);
  this->template expect_rejected<invalid_state>(
      pool,
      [&] {
        pool.allocate(10, {"kv_cache", MemoryClass::cache, ""});
      },
      "tag 'kv_cache' is asleep");
  pool.wake_up();
  pool.deallocate(p);
}

TEST(BadInputCApi, UseOfADestroyedPool) {
  torpor_pool_options o;
  torpor_pool_options_init(&o);
  o.backend = TORPOR_BACKEND_HOST;
  torpor_pool_t pool = nullptr;
  ASSERT_EQ(torpor_pool_create(&o, &pool), TORPOR_OK) << torpor_last_error();
  void* p = nullptr;
  ASSERT_EQ(torpor_alloc(pool, 100, "t", TORPOR_CLASS_STATE, nullptr, &p), TORPOR_OK);
  ASSERT_EQ(torpor_pool_destroy(pool), TORPOR_OK);
  EXPECT_EQ(torpor_alloc(pool, 100, "t", TORPOR_CLASS_STATE, nullptr, &p), TORPOR_ERROR_INVALID_HANDLE);
  EXPECT_NE(std::string(torpor_last_error()).find("not a live pool"), std::string::npos) << torpor_last_error();
  EXPECT_EQ(torpor_free(pool, p), TORPOR_ERROR_INVALID_HANDLE);
  EXPECT_EQ(torpor_sleep(pool, 1, nullptr, 0), TORPOR_ERROR_INVALID_HANDLE);
  EXPECT_EQ(torpor_pool_destroy(pool), TORPOR_ERROR_INVALID_HANDLE);
  EXPECT_NE(std::string(torpor_last_error()).find("torpor_pool_destroy: pool handle "), std::string::npos);
  EXPECT_NE(std::string(torpor_last_error()).find(" is not a live pool (destroyed twice?)"), std::string::npos)
      << torpor_last_error();
  EXPECT_EQ(torpor_pool_backend(pool), nullptr);
}

}  // namespace
}  // namespace torpor::test
