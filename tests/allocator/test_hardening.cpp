// Defects of the sleep engine that no earlier test caught (issue 17), each with the test that
// failed before its fix, on every backend (host, host_async, cuda):
//   - sleep waits for device work on streams other than the pool's;
//   - observers are told the outcome of a sleep or wake exactly once;
//   - mark() refuses to make bytes that a sleep discarded into state;
//   - a wake whose rollback cannot unmap a chunk never leaves it asleep while the pool forgets the
//     mapping (it is woken instead, or kept stranded and counted as mapped);
//   - a retained host copy that changed while kept is detected, never restored (host backends:
//     the test damages the copy in the host store).
#include <fmt/core.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "support/backends.hpp"
#include "torpor/error.hpp"
#include "torpor/testing/fault_injecting_driver.hpp"

namespace torpor::test {
namespace {

using namespace std::chrono_literals;

template <typename B>
class HardeningTest : public BackendTest<B> {};
TYPED_TEST_SUITE(HardeningTest, Backends, BackendNames);

bool all_equal(const std::vector<std::uint8_t>& v, std::uint8_t b) {
  return std::all_of(v.begin(), v.end(), [b](std::uint8_t x) { return x == b; });
}

TYPED_TEST(HardeningTest, SleepWaitsForDeviceWorkOnOtherStreams) {
  Pool pool(this->driver(), this->small_pool());
  const std::size_t n = 4 * this->granularity();
  void* p = pool.allocate(n, {"weights", MemoryClass::state, "flags"});
  write(pool, p, std::vector<std::uint8_t>(n, 0x11));
  // The engine's own kernel writes the bytes on a stream of its own, late (host_async: 20 ms).
  Stream user = this->driver().stream_create(0);
  if (HostDriver* h = this->host()) h->delay_stream(user, 20ms);
  this->driver().fill_async(reinterpret_cast<device_ptr>(p), 0xAB, n, user);
  pool.sleep(1);
  pool.wake_up();
  EXPECT_TRUE(all_equal(read(pool, p, n), 0xAB)) << "sleep must copy the bytes after the device work on them";
  this->driver().stream_destroy(user);
}

// Records every call; throws from the calls it is told to.
struct Recorder : SleepObserver {
  std::vector<std::string> calls;
  bool throw_after_sleep = false, throw_after_wake = false, throw_before_sleep = false;
  void before_sleep(Pool&, int, const std::vector<std::string>&) override {
    calls.push_back("before_sleep");
    if (throw_before_sleep) throw invalid_state("observer refuses");
  }
  void after_sleep(Pool&, int, const std::vector<std::string>&, bool ok) override {
    calls.push_back(ok ? "after_sleep(true)" : "after_sleep(false)");
    if (throw_after_sleep && ok) throw invalid_state("observer fails after the sleep");
  }
  void before_wake(Pool&, const std::vector<std::string>&) override { calls.push_back("before_wake"); }
  void after_wake(Pool&, const std::vector<std::string>&, bool ok) override {
    calls.push_back(ok ? "after_wake(true)" : "after_wake(false)");
    if (throw_after_wake && ok) throw invalid_state("observer fails after the wake");
  }
};

TYPED_TEST(HardeningTest, ObserversAreToldTheOutcomeExactlyOnce) {
  Pool pool(this->driver(), this->small_pool());
  void* p = pool.allocate(1000, {"weights", MemoryClass::state, ""});
  Recorder first, second;
  pool.add_observer(&first);
  pool.add_observer(&second);
  first.throw_after_sleep = first.throw_after_wake = true;
  EXPECT_THROW(pool.sleep(1), invalid_state) << "the observer's error reaches the caller";
  EXPECT_TRUE(pool.asleep("weights")) << "the pool's own sleep succeeded";
  EXPECT_THROW(pool.wake_up(), invalid_state);
  EXPECT_FALSE(pool.asleep("weights"));
  const std::vector<std::string> told = {"before_sleep", "after_sleep(true)", "before_wake", "after_wake(true)"};
  EXPECT_EQ(first.calls, told) << "never after(true) then after(false)";
  EXPECT_EQ(second.calls, told) << "every observer is told, even after one threw";

  // A refusal by the second: the first, already told before_sleep, hears the failure once.
  first = Recorder{};
  second = Recorder{};
  second.throw_before_sleep = true;
  EXPECT_THROW(pool.sleep(2), invalid_state);
  EXPECT_FALSE(pool.asleep("weights"));
  EXPECT_EQ(first.calls, (std::vector<std::string>{"before_sleep", "after_sleep(false)"}));
  EXPECT_EQ(second.calls, (std::vector<std::string>{"before_sleep"}));
  pool.remove_observer(&first);
  pool.remove_observer(&second);
  pool.deallocate(p);
}

TYPED_TEST(HardeningTest, MarkingBytesASleepDiscardedAsStateIsRefused) {
  Pool pool(this->driver(), this->small_pool(FillOnWake::poison));
  const std::size_t n = 8192;
  void* w = pool.allocate(n, {"weights", MemoryClass::parameter, "layers.0.w"});
  std::mt19937_64 rng(9);
  auto bytes = random_bytes(rng, n);
  write(pool, w, bytes);

  pool.sleep(1);  // parameters are offloaded at level 1: their bytes exist
  pool.mark(w, 4096, MemoryClass::state, "buffer");
  EXPECT_EQ(pool.find(w)->memory_class, MemoryClass::state) << "backed bytes may become state";
  pool.wake_up();
  EXPECT_EQ(read(pool, w, n), bytes);
  pool.mark(w, 4096, MemoryClass::parameter, "layers.0.w");

  pool.sleep(2);  // now they are discarded
  try {
    pool.mark(at(w, 100), 200, MemoryClass::state, "flags");
    FAIL() << "discarded bytes were made state";
  } catch (const invalid_state& e) {
    std::string what = e.what();
    EXPECT_NE(what.find(fmt::format("allocation {:#x} 'layers.0.w'", reinterpret_cast<device_ptr>(w))),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("tag 'weights'"), std::string::npos) << what;
    EXPECT_NE(what.find("200 of those bytes were discarded"), std::string::npos) << what;
  }
  EXPECT_EQ(pool.find(at(w, 100))->memory_class, MemoryClass::parameter) << "a refused mark changes nothing";
  pool.mark(w, 4096, MemoryClass::cache, "");  // no promise about the bytes: applies from the next sleep
  EXPECT_EQ(pool.find(w)->memory_class, MemoryClass::cache);
  pool.wake_up();
  EXPECT_TRUE(all_equal(read(pool, w, n), poison_byte));
  pool.mark(w, n, MemoryClass::state, "reloaded");  // awake: any class
  EXPECT_EQ(pool.find(w)->memory_class, MemoryClass::state);
}

// The pool's accounting against the driver's: every chunk the pool calls mapped is mapped, and
// nothing else is.
void expect_mappings_accounted(Pool& pool, HostDriver* host, const char* when) {
  if (host == nullptr) return;
  PoolStats st = pool.stats();
  EXPECT_EQ(host->counters().mapped_bytes, st.mapped_bytes) << when;
  if (st.pending_releases == 0) {
    EXPECT_EQ(host->live_physical_bytes(0), st.mapped_bytes) << when;
  }
}

struct Held {
  void* p;
  std::vector<std::uint8_t> bytes;
};

std::vector<Held> fill_pool(Pool& pool, std::size_t g) {
  std::mt19937_64 rng(21);
  std::vector<Held> out;
  for (std::size_t n : {3 * g, 2 * g + 100, g / 4, 5 * g}) {
    Held h{pool.allocate(n, {"weights", MemoryClass::state, "s"}), random_bytes(rng, n)};
    write(pool, h.p, h.bytes);
    out.push_back(std::move(h));
  }
  return out;
}

// Every allocation either sleeps or holds its bytes.
void expect_awake_ones_hold_their_bytes(Pool& pool, const std::vector<Held>& held, const char* when) {
  for (std::size_t i = 0; i < held.size(); ++i) {
    if (pool.find(held[i].p)->asleep) continue;
    EXPECT_EQ(read(pool, held[i].p, held[i].bytes.size()), held[i].bytes) << when << ": allocation " << i;
  }
}

TYPED_TEST(HardeningTest, AWakeWhoseRollbackCannotUnmapNeverForgetsAMapping) {
  const std::size_t g = this->granularity();
  struct Case {
    DriverCall first;
    bool first_repeats;  // the first fault stays: finishing the wake fails too (stranded chunks)
  };
  for (Case c : {Case{DriverCall::set_access, false}, Case{DriverCall::copy, false},
                 Case{DriverCall::stream_synchronize, false}, Case{DriverCall::copy, true}}) {
    SCOPED_TRACE(::testing::Message() << to_string(c.first) << (c.first_repeats ? " (repeating)" : ""));
    FaultInjectingDriver faulty(this->driver());
    {
      PoolOptions o = this->small_pool();
      o.map_group_bytes = 4 * g;  // several groups
      Pool pool(faulty, o);
      auto held = fill_pool(pool, g);
      pool.sleep(1);
      if (c.first_repeats)
        faulty.fail_from(c.first, 1);
      else
        faulty.fail_nth(c.first, 1);
      faulty.fail_from(DriverCall::unmap, 1);  // and every unmap of the rollback fails
      EXPECT_THROW(pool.wake_up(), error);
      expect_mappings_accounted(pool, this->host(), "after the failed wake");
      expect_awake_ones_hold_their_bytes(pool, held, "after the failed wake");
      faulty.clear();
      pool.wake_up();
      expect_awake_ones_hold_their_bytes(pool, held, "after the retried wake");
      for (const Held& h : held) EXPECT_FALSE(pool.find(h.p)->asleep);
      expect_mappings_accounted(pool, this->host(), "after the retried wake");
      pool.sleep(2);
      EXPECT_EQ(pool.stats().mapped_bytes, 0u);
      if (HostDriver* h = this->host()) {
        EXPECT_EQ(h->live_physical_bytes(0), 0u) << "every byte goes back";
      }
      pool.wake_up();
      expect_awake_ones_hold_their_bytes(pool, held, "after a full cycle");
    }
    if (::testing::Test::HasFailure()) return;
  }
}

// Where the host store keeps a copy of `bytes` (host backends: the test reads the store's blocks).
std::byte* find_host_copy(HostDriver& host, const std::vector<std::uint8_t>& bytes) {
  for (auto [base, n] : host.host_blocks()) {
    auto* hit = std::search(base, base + n, reinterpret_cast<const std::byte*>(bytes.data()),
                            reinterpret_cast<const std::byte*>(bytes.data()) + 256);
    if (hit != base + n) return hit;
  }
  return nullptr;
}

TYPED_TEST(HardeningTest, ARetainedCopyOverwrittenWhileKeptIsCopiedAgain) {
  HostDriver* host = this->host();
  if (host == nullptr) GTEST_SKIP() << "damages a host copy inside HostDriver's host store";
  Pool pool(this->driver(), this->small_pool());
  const std::size_t n = 3 * this->granularity();
  void* p = pool.allocate(n, {"weights", MemoryClass::state, "tail.flags"});
  std::mt19937_64 rng(31);
  auto bytes = random_bytes(rng, n);
  write(pool, p, bytes);
  pool.sleep(1);
  pool.wake_up();  // the host copy is retained
  std::byte* copy = find_host_copy(*host, bytes);
  ASSERT_NE(copy, nullptr);
  std::memset(copy, 0, n);  // a stray bulk write into the host store
  TransitionReport s = pool.sleep(1);
  EXPECT_EQ(s.bytes_offloaded, n) << "the damaged copy is not trusted: the device's bytes are copied again";
  pool.wake_up();
  EXPECT_EQ(read(pool, p, n), bytes);
}

TYPED_TEST(HardeningTest, ARetainedCopyWithOneChangedByteIsDetectedAndNotRestored) {
  HostDriver* host = this->host();
  if (host == nullptr) GTEST_SKIP() << "damages a host copy inside HostDriver's host store";
  Pool pool(this->driver(), this->small_pool());
  const std::size_t n = 3 * this->granularity();
  void* p = pool.allocate(n, {"weights", MemoryClass::state, "tail.flags"});
  void* other = pool.allocate(n, {"weights", MemoryClass::state, "other"});
  std::mt19937_64 rng(32);
  auto bytes = random_bytes(rng, n), other_bytes = random_bytes(rng, n);
  write(pool, p, bytes);
  write(pool, other, other_bytes);
  pool.sleep(1);
  pool.wake_up();
  std::byte* copy = find_host_copy(*host, bytes);
  ASSERT_NE(copy, nullptr);
  copy[5000] ^= std::byte{0x01};  // one bit, where no cheap sample looks
  TransitionReport s = pool.sleep(1);
  EXPECT_EQ(s.bytes_offloaded, 0u) << "the sample still matches: the copy is trusted at sleep";
  try {
    pool.wake_up();
    FAIL() << "a changed host copy was restored silently";
  } catch (const error& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("changed while kept"), std::string::npos) << what;
    EXPECT_NE(what.find(fmt::format("{:#x} 'tail.flags'", reinterpret_cast<device_ptr>(p))), std::string::npos) << what;
    EXPECT_NE(what.find("tag 'weights'"), std::string::npos) << what;
  }
  EXPECT_FALSE(pool.find(p)->asleep);
  auto now = read(pool, p, n);
  EXPECT_TRUE(all_equal(now, poison_byte)) << "the changed copy is not handed back";
  EXPECT_EQ(read(pool, other, n), other_bytes) << "an intact copy is restored";
  // The bad copy is gone; the next cycle copies what the device holds now.
  write(pool, p, bytes);
  EXPECT_EQ(pool.sleep(1).bytes_offloaded, n);
  pool.wake_up();
  EXPECT_EQ(read(pool, p, n), bytes);
}

}  // namespace
}  // namespace torpor::test
