// The host store: page-locking in the background (prepare, copies that wait for their block, a
// refused registration), the pinned limit, release, what a level-2 sleep keeps in host memory,
// and the host-memory controls of the C API. HostDriver's accounting of registered and
// host_alloc'ed bytes is the oracle for what is page-locked.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "pool/store/host_store.hpp"
#include "support/backends.hpp"
#include "torpor/error.hpp"
#include "torpor/host_driver.hpp"
#include "torpor/testing/fault_injecting_driver.hpp"
#include "torpor/torpor.h"

namespace torpor::test {
namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

bool has_phase(const TransitionReport& r, const std::string& name) {
  for (const auto& p : r.phases)
    if (p.name == name) return true;
  return false;
}

// ---------------------------------------------------------------------------------------------
// HostStore alone, over HostDriver.

TEST(HostStore, ReserveMakesOneBlockAndReuseDoesNotGrow) {
  HostDriver d;
  {
    HostStore s(d);
    s.reserve(3 * HostStore::reserved_size(1000));
    EXPECT_EQ(s.growths(), 1u);
    HostSpan a = s.allocate(1000);
    HostSpan b = s.allocate(1000);
    HostSpan c = s.allocate(1000);
    EXPECT_EQ(s.growths(), 1u);
    EXPECT_EQ(a.tier, HostTier::pinned);
    EXPECT_EQ(a.bytes, HostStore::reserved_size(1000));
    s.free(a.ptr, a.bytes);
    s.free(b.ptr, b.bytes);
    s.free(c.ptr, c.bytes);
    s.reserve(3 * HostStore::reserved_size(1000));
    EXPECT_EQ(s.growths(), 1u) << "the second identical cycle reuses the block";
    EXPECT_GT(s.release_unused(), 0u);
    EXPECT_EQ(s.blocks(), 0u);
    EXPECT_EQ(d.counters().registered_bytes, 0u);
  }
  EXPECT_EQ(d.counters().registered_bytes, 0u);
  EXPECT_EQ(d.counters().host_bytes, 0u);
}

TEST(HostStore, BeyondThePinnedLimitSpansArePageable) {
  HostDriver d;
  HostStore s(d, {.pinned_limit = 4 * MiB});
  s.reserve(10 * MiB);
  s.wait_pinning();
  EXPECT_EQ(s.pinned_capacity(), 4 * MiB);
  EXPECT_GE(s.capacity(), 10 * MiB);
  EXPECT_EQ(d.counters().registered_bytes, 4 * MiB) << "only the pinned tier is page-locked";
  EXPECT_EQ(d.counters().host_bytes, 0u) << "page-locked by registration, not cuMemHostAlloc";
  HostSpan a = s.allocate(3 * MiB);
  HostSpan b = s.allocate(3 * MiB);
  EXPECT_EQ(a.tier, HostTier::pinned);
  EXPECT_EQ(b.tier, HostTier::pageable);
  std::memset(b.ptr, 7, 3 * MiB);
  s.free(a.ptr, a.bytes);
  s.free(b.ptr, b.bytes);
  std::size_t held = s.capacity();
  EXPECT_EQ(s.release_unused(), held);
  EXPECT_EQ(s.blocks(), 0u);
  EXPECT_EQ(d.counters().registered_bytes, 0u);
}

TEST(HostStore, PreparePinsInTheBackgroundAndTheAccountIsExact) {
  HostDriverOptions ho;
  ho.host_register_delay = std::chrono::milliseconds(300);  // slower than everything below
  HostDriver d(ho);
  HostStore s(d, {.pin_block_bytes = 2 * MiB, .pin_threads = 2});
  EXPECT_EQ(s.prepare(7 * MiB), 8 * MiB) << "whole 2 MiB blocks";
  HostStoreStats st = s.stats();
  EXPECT_EQ(st.pinned_bytes + st.pinning_bytes, 8 * MiB);
  EXPECT_GT(st.pinning_bytes, 0u) << "prepare returns before the pinning is done";
  s.wait_pinning();
  st = s.stats();
  EXPECT_EQ(st.pinned_bytes, 8 * MiB);
  EXPECT_EQ(st.pinning_bytes, 0u);
  EXPECT_EQ(d.counters().registered_bytes, 8 * MiB);
  EXPECT_EQ(d.counters().registrations, 4u);
  EXPECT_EQ(s.prepare(8 * MiB), 0u) << "already held";
  EXPECT_EQ(s.prepare(3 * MiB), 0u);
  EXPECT_EQ(s.release_unused(), 8 * MiB);
  EXPECT_EQ(d.counters().registered_bytes, 0u);
}

TEST(HostStore, ReleasingBlocksStillBeingPinnedCancelsThem) {
  HostDriverOptions ho;
  ho.host_register_delay = std::chrono::milliseconds(50);
  HostDriver d(ho);
  {
    HostStore s(d, {.pin_block_bytes = 2 * MiB, .pin_threads = 1});
    s.prepare(64 * MiB);
    EXPECT_EQ(s.release_unused(), 64 * MiB);
    EXPECT_EQ(s.blocks(), 0u);
    EXPECT_EQ(d.counters().registered_bytes, 0u) << "every registration that completed was undone";
    s.prepare(32 * MiB);
  }  // destroyed while pinning
  EXPECT_EQ(d.counters().registered_bytes, 0u);
}

TEST(HostStore, APrepareStaysWithinThePinnedLimit) {
  HostDriver d;
  HostStore s(d, {.pinned_limit = 6 * MiB, .pin_block_bytes = 4 * MiB});
  EXPECT_EQ(s.prepare(64 * MiB), 6 * MiB);
  s.wait_pinning();
  EXPECT_EQ(d.counters().registered_bytes, 6 * MiB);
}

TEST(HostStore, ARefusedRegistrationLeavesPageableBytesThenTheStoreGrowsWithHostAlloc) {
  HostDriverOptions ho;
  ho.host_register_limit = 4 * MiB;  // the driver refuses page-locking past 4 MiB
  HostDriver d(ho);
  {
    HostStore s(d, {.pin_block_bytes = 2 * MiB, .pin_threads = 1});
    s.reserve(8 * MiB);
    std::vector<HostSpan> spans;
    for (int i = 0; i < 4; ++i) spans.push_back(s.allocate(2 * MiB));
    int pinned = 0, pageable = 0;
    for (auto& sp : spans) {
      HostTier t = s.wait_ready(sp);
      (t == HostTier::pinned ? pinned : pageable) += 1;
      if (t == HostTier::pageable) std::memset(sp.ptr, 1, sp.bytes);  // ordinary memory, usable
    }
    EXPECT_EQ(pinned, 2);
    EXPECT_EQ(pageable, 2);
    EXPECT_TRUE(s.stats().registration_refused);
    EXPECT_EQ(s.stats().pageable_bytes, 4 * MiB);
    EXPECT_EQ(d.counters().registered_bytes, 4 * MiB);
    HostSpan more = s.allocate(MiB);  // every block is full: the store grows, the old way
    EXPECT_EQ(more.tier, HostTier::pinned);
    EXPECT_EQ(d.counters().host_bytes, 2 * MiB);
    s.free(more.ptr, more.bytes);
    for (auto& sp : spans) s.free(sp.ptr, sp.bytes);
  }
  EXPECT_EQ(d.counters().registered_bytes, 0u);
  EXPECT_EQ(d.counters().host_bytes, 0u);
}

// ---------------------------------------------------------------------------------------------
// Through a pool.

// Dedicated chunks of `bytes` each, filled with random bytes written straight into the emulated
// device memory (pool.copy would copy from pageable memory, which the strict driver refuses).
struct Direct {
  std::vector<void*> ptrs;
  std::vector<std::vector<std::uint8_t>> bytes;
};
Direct fill_direct(Pool& pool, int count, std::size_t bytes, MemoryClass cls, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  Direct d;
  for (int i = 0; i < count; ++i) {
    d.ptrs.push_back(pool.allocate(bytes, {"weights", cls, "w" + std::to_string(i)}));
    d.bytes.push_back(random_bytes(rng, bytes));
    std::memcpy(d.ptrs.back(), d.bytes.back().data(), bytes);
  }
  return d;
}

TEST(HostStorePool, NoCopyLandsInHostMemoryWhosePinningIsNotDone) {
  HostDriverOptions ho = HostBackend::options();
  ho.require_page_locked_copies = true;
  ho.host_register_delay = std::chrono::milliseconds(20);
  HostDriver d(ho);
  PoolOptions o;
  o.va_bytes = 256 * MiB;
  o.medium_limit = 0;
  o.copy_piece_bytes = 512 << 10;
  o.host_pin_block_bytes = 2 * MiB;
  o.host_pin_threads = 2;
  Pool pool(d, o);
  auto items = fill_direct(pool, 8, MiB, MemoryClass::state, 1);
  TransitionReport r = pool.sleep(1);  // a copy into memory not yet registered is a misuse (throws)
  EXPECT_EQ(r.bytes_offloaded, 8 * MiB);
  EXPECT_TRUE(has_phase(r, "host_pinning_wait")) << "the copies waited for the background pinning";
  EXPECT_EQ(pool.stats().host_store_pinned_bytes, d.counters().registered_bytes);
  pool.wake_up();
  for (std::size_t i = 0; i < items.ptrs.size(); ++i)
    EXPECT_EQ(std::memcmp(items.ptrs[i], items.bytes[i].data(), MiB), 0) << "allocation " << i;
}

// ---------------------------------------------------------------------------------------------
// The unprepared first sleep with the pinning overlapped (issue 30, item 2): the store grows by
// four blocks of 2 MiB, four 512 KiB pieces each, pinned one after the other by one thread; every
// registration takes 60 ms. The driver calls' begin and end times on the calling threads are the
// oracle for the order (FaultInjectingDriver::observe); require_page_locked_copies makes a copy
// into a block whose registration is not done a misuse; HostDriver's registration count and bytes
// are the oracle for "never pinned twice" and for the books.

struct CallTimeline {
  using clock = std::chrono::steady_clock;
  struct Entry {
    DriverCall kind;
    bool finished;
    clock::time_point at;
  };
  std::mutex mu;
  std::vector<Entry> entries;
  void note(DriverCall kind, bool finished) {
    std::lock_guard lock(mu);
    entries.push_back({kind, finished, clock::now()});
  }
  void clear() {
    std::lock_guard lock(mu);
    entries.clear();
  }
  // Times of the calls of `kind` that began (finished false) or ended (true), in order.
  std::vector<clock::time_point> times(DriverCall kind, bool finished) {
    std::lock_guard lock(mu);
    std::vector<clock::time_point> out;
    for (const Entry& e : entries)
      if (e.kind == kind && e.finished == finished) out.push_back(e.at);
    return out;
  }
};

struct OverlapRig {
  static constexpr int pieces = 16;  // 512 KiB each: four per 2 MiB block
  HostDriver host;
  FaultInjectingDriver driver{host};
  CallTimeline timeline;
  std::unique_ptr<Pool> pool;
  Direct items;
  std::size_t registrations_before = 0;

  static HostDriverOptions driver_options(std::size_t register_limit) {
    HostDriverOptions ho = HostAsyncBackend::options();
    ho.require_page_locked_copies = true;
    ho.host_register_delay = std::chrono::milliseconds(60);
    ho.host_register_limit = register_limit;
    return ho;
  }
  explicit OverlapRig(bool overlap, std::size_t register_limit = 0) : host(driver_options(register_limit)) {
    driver.observe([this](DriverCall kind, bool finished) { timeline.note(kind, finished); });
    PoolOptions o;
    o.va_bytes = 256 * MiB;
    o.medium_limit = 0;  // a dedicated chunk per allocation: one piece each
    o.copy_piece_bytes = 512 << 10;
    o.host_pin_block_bytes = 2 * MiB;
    o.host_pin_threads = 1;  // blocks are pinned strictly one after the other
    o.host_pin_overlap = overlap;
    pool = std::make_unique<Pool>(driver, o);
    items = fill_direct(*pool, pieces, 512 << 10, MemoryClass::state, 11);
    registrations_before = host.counters().registrations;
    timeline.clear();
  }
  void expect_bytes(const char* when) {
    for (std::size_t i = 0; i < items.ptrs.size(); ++i)
      EXPECT_EQ(std::memcmp(items.ptrs[i], items.bytes[i].data(), items.bytes[i].size()), 0)
          << when << ": allocation " << i;
  }
  // Copies that began before the i-th registration (0-based, in time order) ended.
  std::size_t copies_before_registration_end(std::size_t i) {
    auto regs = timeline.times(DriverCall::host_register, true);
    auto copies = timeline.times(DriverCall::copy, false);
    if (i >= regs.size()) return copies.size();
    std::size_t n = 0;
    for (auto t : copies) n += t < regs[i] ? 1 : 0;
    return n;
  }
};

TEST(HostStoreOverlap, TheFirstSleepCopiesIntoEachBlockWhileTheNextIsPinned) {
  OverlapRig rig(true);
  TransitionReport r = rig.pool->sleep(1);
  EXPECT_EQ(r.bytes_offloaded, 8 * MiB);
  EXPECT_EQ(r.bytes_staged, 0u) << "every copy went to page-locked memory";
  ASSERT_EQ(rig.timeline.times(DriverCall::host_register, true).size(), 4u) << "four blocks, each pinned once";
  EXPECT_EQ(rig.copies_before_registration_end(0), 0u) << "no copy into a block before it is page-locked";
  EXPECT_GE(rig.copies_before_registration_end(1), 4u)
      << "block 0's four copies were queued while block 1 was still being pinned: they waited for no later block";
  EXPECT_GE(rig.copies_before_registration_end(3), 12u) << "blocks 0-2 copied while block 3 was pinned";
  EXPECT_LE(rig.copies_before_registration_end(1), 4u) << "block 1's copies waited for block 1";
  // The books: what the store calls page-locked is what the driver holds registered.
  PoolStats st = rig.pool->stats();
  EXPECT_EQ(st.host_store_pinned_bytes, 8 * MiB);
  EXPECT_EQ(st.host_store_pinning_bytes, 0u);
  EXPECT_EQ(st.host_store_used_bytes, 8 * MiB);
  EXPECT_EQ(rig.host.counters().registered_bytes, 8 * MiB);
  rig.pool->wake_up();
  rig.expect_bytes("first wake");
  // A second cycle pins nothing: the blocks stay.
  for (std::size_t i = 0; i < rig.items.ptrs.size(); ++i) {
    rig.items.bytes[i][7] ^= 0x5a;
    std::memcpy(rig.items.ptrs[i], rig.items.bytes[i].data(), rig.items.bytes[i].size());
  }
  rig.pool->sleep(1);
  rig.pool->wake_up();
  rig.expect_bytes("second wake");
  EXPECT_EQ(rig.host.counters().registrations - rig.registrations_before, 4u) << "no block was pinned twice";
  EXPECT_EQ(rig.host.counters().registered_bytes, 8 * MiB);
}

// The other arrangement, kept for the bench (host_pin_overlap off): every block is page-locked
// before the first copy.
TEST(HostStoreOverlap, WithTheOverlapOffTheSleepPinsEverythingFirst) {
  OverlapRig rig(false);
  TransitionReport r = rig.pool->sleep(1);
  EXPECT_EQ(r.bytes_offloaded, 8 * MiB);
  ASSERT_EQ(rig.timeline.times(DriverCall::host_register, true).size(), 4u);
  EXPECT_EQ(rig.copies_before_registration_end(3), 0u) << "no copy before the last block was page-locked";
  rig.pool->wake_up();
  rig.expect_bytes("wake");
}

// The driver refuses page-locking past 4 MiB: blocks 2 and 3, whose pinning runs while blocks 0
// and 1 are copied into, stay pageable and their pieces go through the staging ring, as without
// the overlap. Nothing is lost and nothing is left half-pinned.
TEST(HostStoreOverlap, ARefusedPinMidwayFallsBackToStagingAndLosesNothing) {
  OverlapRig rig(true, 4 * MiB);
  TransitionReport r = rig.pool->sleep(1);
  EXPECT_EQ(r.bytes_offloaded, 8 * MiB);
  EXPECT_EQ(r.bytes_staged, 4 * MiB) << "the refused blocks' eight pieces went through the staging ring";
  EXPECT_EQ(rig.copies_before_registration_end(0), 0u);
  PoolStats st = rig.pool->stats();
  EXPECT_EQ(st.host_store_pinned_bytes, 4 * MiB);
  EXPECT_EQ(st.host_store_pinning_bytes, 0u) << "every block's pinning settled";
  EXPECT_EQ(st.host_store_pageable_bytes, 4 * MiB);
  EXPECT_EQ(rig.host.counters().registered_bytes, 4 * MiB) << "the refused blocks hold no registration";
  rig.pool->wake_up();
  rig.expect_bytes("wake after a refused pin");
  rig.pool->sleep(1);
  rig.pool->wake_up();
  rig.expect_bytes("second cycle");
  EXPECT_EQ(rig.host.counters().registered_bytes, 4 * MiB);
}

// A copy fails midway while later blocks are still being pinned: the sleep stops at a chunk
// boundary (the chunks before it asleep with exact backups, the rest awake with their bytes), the
// pinning in flight settles, and the repeat completes the sleep without pinning anything twice.
TEST(HostStoreOverlap, AFailureMidwayLeavesNothingHalfDoneAndTheRepeatPinsNothingTwice) {
  OverlapRig rig(true);
  rig.driver.fail_nth(DriverCall::copy, 6);  // block 1's second piece, while blocks 2 and 3 are pinned
  EXPECT_THROW(rig.pool->sleep(1), driver_error);
  rig.pool->wait_host_store();
  PoolStats st = rig.pool->stats();
  std::size_t asleep = 0;
  for (std::size_t i = 0; i < rig.items.ptrs.size(); ++i) {
    auto info = rig.pool->find(rig.items.ptrs[i]);
    ASSERT_TRUE(info.has_value());
    if (info->asleep) {
      EXPECT_EQ(asleep, i) << "asleep chunks are a prefix of the plan";
      ++asleep;
    } else {
      EXPECT_EQ(std::memcmp(rig.items.ptrs[i], rig.items.bytes[i].data(), rig.items.bytes[i].size()), 0)
          << "awake allocation " << i << " keeps its bytes";
    }
  }
  EXPECT_EQ(asleep, 5u) << "the five chunks whose copies were queued before the failure";
  EXPECT_EQ(st.host_store_used_bytes, asleep * (512 << 10)) << "only the asleep chunks' backups hold host memory";
  EXPECT_EQ(st.host_store_pinning_bytes, 0u) << "the pinning in flight settled";
  EXPECT_EQ(rig.host.counters().registrations - rig.registrations_before, 4u);
  rig.pool->sleep(1);  // the repeat completes the sleep
  rig.pool->wake_up();
  rig.expect_bytes("after the failed sleep and its repeat");
  EXPECT_EQ(rig.host.counters().registrations - rig.registrations_before, 4u) << "the repeat pinned nothing again";
  EXPECT_EQ(rig.host.counters().registered_bytes, 8 * MiB);
}

// An engine starts the preparation when its model is loaded and may sleep at once: the first
// sleep that races the preparation waits for it and never pins the same bytes twice. HostDriver
// refuses a registration that overlaps a registered range, and its count of registered bytes is
// the oracle: every page-locked byte is counted once, and no more than one level-1 sleep needs.
TEST(HostStorePool, AFirstSleepRacingThePreparationWaitsForItAndPinsNothingTwice) {
  for (int round = 0; round < 6; ++round) {
    HostDriverOptions ho = HostBackend::options();
    ho.require_page_locked_copies = true;
    ho.host_register_delay = std::chrono::milliseconds(round % 3 * 5);
    HostDriver d(ho);
    PoolOptions o;
    o.va_bytes = 256 * MiB;
    o.medium_limit = 0;
    o.copy_piece_bytes = 512 << 10;
    o.host_pin_block_bytes = 2 * MiB;
    o.host_pin_threads = 2;
    Pool pool(d, o);
    auto items = fill_direct(pool, 8, MiB, MemoryClass::state, 10 + round);
    const std::size_t need = pool.sleep_host_bytes(1);
    ASSERT_EQ(need, 8 * HostStore::reserved_size(MiB));
    std::atomic<std::size_t> added{0};
    std::atomic<bool> go{false};
    std::thread preparer([&] {
      while (!go) std::this_thread::yield();
      added = pool.prepare_host_store();
    });
    go = true;
    if (round % 2 == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    TransitionReport r = pool.sleep(1);
    preparer.join();
    pool.wait_host_store();
    EXPECT_EQ(r.bytes_offloaded, 8 * MiB) << "round " << round;
    PoolStats st = pool.stats();
    EXPECT_EQ(st.host_store_pinned_bytes, d.counters().registered_bytes) << "round " << round;
    EXPECT_EQ(d.counters().registered_bytes, align_up(need, HostStore::block_rounding))
        << "round " << round << ": whichever came first pinned it, the other added nothing (prepare added "
        << added.load() << ")";
    pool.wake_up();
    for (std::size_t i = 0; i < items.ptrs.size(); ++i)
      ASSERT_EQ(std::memcmp(items.ptrs[i], items.bytes[i].data(), MiB), 0) << "round " << round << " allocation " << i;
  }
}

// What a level-2-only workload prepares: its state bytes, not its parameters; per tag.
TEST(HostStorePool, SleepHostBytesCountsWhatEachLevelKeeps) {
  HostDriver d(HostBackend::options());
  PoolOptions o;
  o.va_bytes = 256 * MiB;
  o.medium_limit = 0;
  Pool pool(d, o);
  auto params = fill_direct(pool, 3, MiB, MemoryClass::parameter, 20);
  auto state = fill_direct(pool, 2, MiB, MemoryClass::state, 21);
  void* kv = pool.allocate(4 * MiB, {"kv_cache", MemoryClass::cache, ""});
  const std::size_t one = HostStore::reserved_size(MiB);
  EXPECT_EQ(pool.sleep_host_bytes(0), 0u);
  EXPECT_EQ(pool.sleep_host_bytes(1), 5 * one);
  EXPECT_EQ(pool.sleep_host_bytes(2), 2 * one) << "level 2 keeps only the state";
  EXPECT_EQ(pool.sleep_host_bytes(1, {"kv_cache"}), 0u) << "cache never travels";
  EXPECT_THROW(pool.sleep_host_bytes(1, {"nope"}), invalid_argument);
  EXPECT_THROW(pool.sleep_host_bytes(3), invalid_argument);
  EXPECT_EQ(pool.prepare_host_store(pool.sleep_host_bytes(2)), align_up(2 * one, HostStore::block_rounding));
  pool.wait_host_store();
  TransitionReport r = pool.sleep(2);
  EXPECT_FALSE(has_phase(r, "host_pinning_wait")) << "the level-2 sleep found its store prepared";
  EXPECT_EQ(pool.sleep_host_bytes(2), 2 * one) << "asleep: the backups it holds";
  pool.wake_up();
  for (std::size_t i = 0; i < state.ptrs.size(); ++i)
    EXPECT_EQ(std::memcmp(state.ptrs[i], state.bytes[i].data(), MiB), 0);
  (void)params;
  pool.deallocate(kv);
}

// The store maps the blocks it adds at once in one mapping (pinning then overlaps the copies):
// each block still goes back on its own, while its neighbours hold backups.
TEST(HostStorePool, BlocksMappedTogetherAreReleasedOneByOne) {
  HostDriver d(HostBackend::options());
  PoolOptions o;
  o.va_bytes = 256 * MiB;
  o.medium_limit = 0;
  o.host_pin_block_bytes = 2 * MiB;
  Pool pool(d, o);
  auto items = fill_direct(pool, 6, MiB, MemoryClass::state, 3);
  EXPECT_EQ(pool.prepare_host_store(8 * MiB), 8 * MiB);
  pool.wait_host_store();
  EXPECT_EQ(d.counters().registered_bytes, 8 * MiB);
  pool.sleep(1);
  EXPECT_EQ(pool.stats().host_store_used_bytes, 6 * MiB);
  EXPECT_EQ(pool.release_host_store(), 2 * MiB) << "the one block no backup uses";
  EXPECT_EQ(pool.stats().host_store_bytes, 6 * MiB);
  EXPECT_EQ(d.counters().registered_bytes, 6 * MiB) << "the released block was unregistered";
  pool.wake_up();
  for (std::size_t i = 0; i < items.ptrs.size(); ++i)
    EXPECT_EQ(std::memcmp(items.ptrs[i], items.bytes[i].data(), MiB), 0) << "allocation " << i;
  EXPECT_EQ(pool.release_host_store(), 6 * MiB) << "after wake, the retained copies and their blocks";
  EXPECT_EQ(d.counters().registered_bytes, 0u);
  pool.sleep(1);  // the store grows again
  pool.wake_up();
  for (std::size_t i = 0; i < items.ptrs.size(); ++i)
    EXPECT_EQ(std::memcmp(items.ptrs[i], items.bytes[i].data(), MiB), 0) << "allocation " << i;
}

TEST(HostStorePool, TheStoreOptionPinsWhileTheModelLoadsAndTheSleepUsesIt) {
  HostDriverOptions ho = HostBackend::options();
  ho.host_register_delay = std::chrono::milliseconds(30);
  HostDriver d(ho);
  PoolOptions o;
  o.va_bytes = 256 * MiB;
  o.medium_limit = 0;
  o.host_store_prepare = 8 * MiB;
  o.host_pin_block_bytes = 2 * MiB;
  Pool pool(d, o);
  PoolStats st = pool.stats();
  EXPECT_EQ(st.host_store_pinned_bytes + st.host_store_pinning_bytes, 8 * MiB);
  auto items = fill_direct(pool, 6, MiB, MemoryClass::parameter, 2);  // "loading the model"
  pool.wait_host_store();
  st = pool.stats();
  EXPECT_EQ(st.host_store_pinned_bytes, 8 * MiB);
  EXPECT_EQ(d.counters().registered_bytes, 8 * MiB);
  TransitionReport r = pool.sleep(1);
  EXPECT_FALSE(has_phase(r, "host_pinning_wait"));
  EXPECT_EQ(pool.stats().host_store_bytes, 8 * MiB) << "the sleep used the prepared blocks, nothing more";
  EXPECT_EQ(pool.stats().host_store_used_bytes, 6 * MiB);
  pool.wake_up();
  for (std::size_t i = 0; i < items.ptrs.size(); ++i)
    EXPECT_EQ(std::memcmp(items.ptrs[i], items.bytes[i].data(), MiB), 0);
}

TEST(HostStorePool, ARefusedRegistrationIsLoggedAndTheBytesStillSurvive) {
  HostDriverOptions ho = HostBackend::options();
  ho.host_register_limit = 2 * MiB;
  HostDriver d(ho);
  PoolOptions o;
  o.va_bytes = 256 * MiB;
  o.medium_limit = 0;
  o.host_pin_block_bytes = 2 * MiB;
  o.host_pin_threads = 1;
  o.copy_piece_bytes = MiB;
  Pool pool(d, o);
  auto items = fill_direct(pool, 6, MiB, MemoryClass::state, 3);
  for (int cycle = 0; cycle < 2; ++cycle) {
    TransitionReport r = pool.sleep(1);
    EXPECT_EQ(r.bytes_offloaded + r.bytes_skipped, 6 * MiB);
    if (cycle == 0) EXPECT_GT(r.bytes_staged, 0u) << "the refused blocks' bytes went through the staging ring";
    EXPECT_TRUE(pool.stats().host_registration_refused);
    pool.wake_up();
    for (std::size_t i = 0; i < items.ptrs.size(); ++i)
      ASSERT_EQ(std::memcmp(items.ptrs[i], items.bytes[i].data(), MiB), 0) << "cycle " << cycle;
  }
  EXPECT_LE(d.counters().registered_bytes, 2 * MiB);
}

template <typename B>
class HostStoreTest : public BackendTest<B> {
 protected:
  struct Item {
    void* p;
    std::vector<std::uint8_t> bytes;
  };
  Item make(Pool& pool, std::size_t n, MemoryClass cls, const char* name, std::mt19937_64& rng) {
    Item it{pool.allocate(n, {"weights", cls, name}), random_bytes(rng, n)};
    write(pool, it.p, it.bytes);
    return it;
  }
};
TYPED_TEST_SUITE(HostStoreTest, Backends, BackendNames);

TYPED_TEST(HostStoreTest, PrepareHostStorePinsWhatALevel1SleepNeedsAndTheSleepUsesIt) {
  Pool pool(this->driver(), this->small_pool());
  std::mt19937_64 rng(5);
  std::size_t n = 3 * this->granularity() + 100;
  std::vector<typename TestFixture::Item> items;
  for (int i = 0; i < 3; ++i) items.push_back(this->make(pool, n, MemoryClass::parameter, "p", rng));
  items.push_back(this->make(pool, n, MemoryClass::state, "s", rng));
  void* cache = pool.allocate(n, {"kv_cache", MemoryClass::cache, ""});
  std::size_t need = 4 * HostStore::reserved_size(n);  // one piece per allocation; cache never travels
  std::size_t added = pool.prepare_host_store();
  EXPECT_EQ(added, align_up(need, HostStore::block_rounding));
  pool.wait_host_store();
  PoolStats st = pool.stats();
  EXPECT_EQ(st.host_store_pinned_bytes, added);
  EXPECT_EQ(st.host_store_pinning_bytes, 0u);
  if (HostDriver* h = this->host()) EXPECT_EQ(h->counters().registered_bytes, added);
  EXPECT_EQ(pool.prepare_host_store(), 0u) << "already prepared";
  TransitionReport r = pool.sleep(1);
  EXPECT_FALSE(has_phase(r, "host_pinning_wait"));
  EXPECT_EQ(pool.stats().host_store_bytes, added) << "no growth: the sleep used the prepared store";
  EXPECT_EQ(pool.stats().host_store_used_bytes, need);
  pool.wake_up();
  for (auto& it : items) EXPECT_EQ(read(pool, it.p, n), it.bytes);
  pool.deallocate(cache);
}

TYPED_TEST(HostStoreTest, ReleaseHostStoreGivesEveryHostByteBackAndTheNextSleepPinsAgain) {
  Pool pool(this->driver(), this->small_pool());
  std::mt19937_64 rng(6);
  std::size_t n = 2 * this->granularity() + 300;
  auto a = this->make(pool, n, MemoryClass::parameter, "a", rng);
  auto b = this->make(pool, n, MemoryClass::state, "b", rng);
  pool.sleep(1);
  pool.wake_up();
  PoolStats st = pool.stats();
  EXPECT_EQ(st.retained_bytes, 2 * n) << "skip_unchanged keeps the copies after wake (the default)";
  EXPECT_GT(st.host_store_bytes, 0u);
  EXPECT_EQ(pool.release_host_store(), st.host_store_bytes);
  st = pool.stats();
  EXPECT_EQ(st.retained_bytes, 0u);
  EXPECT_EQ(st.host_store_bytes, 0u);
  EXPECT_EQ(st.host_store_used_bytes, 0u);
  if (HostDriver* h = this->host()) {
    EXPECT_EQ(h->counters().registered_bytes, 0u);
    EXPECT_EQ(h->counters().host_bytes, 0u);
  }
  TransitionReport r = pool.sleep(1);
  EXPECT_EQ(r.bytes_offloaded, 2 * n) << "no retained copy: everything is copied again";
  EXPECT_EQ(pool.release_host_store(), 0u) << "backups of a sleeping pool stay";
  pool.wake_up();
  EXPECT_EQ(read(pool, a.p, n), a.bytes);
  EXPECT_EQ(read(pool, b.p, n), b.bytes);
}

TYPED_TEST(HostStoreTest, ALevel2SleepDropsTheHostCopiesOfTheParametersItDiscards) {
  Pool pool(this->driver(), this->small_pool());
  std::mt19937_64 rng(7);
  std::size_t n = 3 * this->granularity() + 40;
  auto p = this->make(pool, n, MemoryClass::parameter, "layers.0.w", rng);
  auto s = this->make(pool, n, MemoryClass::state, "flags", rng);
  const std::size_t one = HostStore::reserved_size(n);
  // From retained copies: an awake pool whose parameters have a host copy from the last wake.
  pool.sleep(1);
  pool.wake_up();
  EXPECT_EQ(pool.stats().host_store_used_bytes, 2 * one);
  pool.sleep(2);
  EXPECT_EQ(pool.stats().host_store_used_bytes, one) << "only the state's copy stays in host memory";
  pool.wake_up();
  EXPECT_EQ(read(pool, s.p, n), s.bytes);
  EXPECT_EQ(pool.stats().retained_bytes, n);
  // Deepening: a level-1 sleeper asked for level 2 drops its parameter copies.
  p.bytes = random_bytes(rng, n);
  write(pool, p.p, p.bytes);
  pool.sleep(1);
  EXPECT_EQ(pool.stats().host_store_used_bytes, 2 * one);
  pool.sleep(2);
  EXPECT_EQ(pool.stats().host_store_used_bytes, one);
  pool.wake_up();
  EXPECT_EQ(read(pool, s.p, n), s.bytes);
}

TYPED_TEST(HostStoreTest, WithoutSkipUnchangedWakeGivesTheCopiesBackButKeepsTheBlocks) {
  PoolOptions o = this->small_pool();
  o.skip_unchanged = false;
  Pool pool(this->driver(), o);
  std::mt19937_64 rng(8);
  std::size_t n = this->granularity() + 5;
  auto s = this->make(pool, n, MemoryClass::state, "s", rng);
  pool.sleep(1);
  std::size_t held = pool.stats().host_store_bytes;
  pool.wake_up();
  PoolStats st = pool.stats();
  EXPECT_EQ(st.host_store_used_bytes, 0u);
  EXPECT_EQ(st.retained_bytes, 0u);
  EXPECT_EQ(st.host_store_bytes, held) << "the blocks stay for the next sleep";
  EXPECT_EQ(read(pool, s.p, n), s.bytes);
}

// ---------------------------------------------------------------------------------------------
// The C API's host-memory controls.

std::string stats_json(torpor_pool_t pool) {
  size_t needed = 0;
  EXPECT_EQ(torpor_stats_json(pool, nullptr, 0, &needed), TORPOR_OK);
  std::string s(needed, '\0');
  EXPECT_EQ(torpor_stats_json(pool, s.data(), s.size(), &needed), TORPOR_OK);
  s.resize(needed - 1);
  return s;
}

TEST(HostStoreCApi, OptionsPrepareReleaseAndStats) {
  torpor_pool_options o;
  torpor_pool_options_init(&o);
  EXPECT_EQ(o.skip_unchanged, 1);
  EXPECT_EQ(o.host_store_limit, 0u);
  EXPECT_EQ(o.spill_dir, nullptr);
  o.backend = TORPOR_BACKEND_HOST;
  o.va_bytes = std::size_t{1} << 30;
  o.skip_unchanged = 0;
  torpor_pool_t pool = nullptr;
  ASSERT_EQ(torpor_pool_create(&o, &pool), TORPOR_OK) << torpor_last_error();
  void* s = nullptr;
  ASSERT_EQ(torpor_alloc(pool, 3 * MiB, "weights", TORPOR_CLASS_STATE, "s", &s), TORPOR_OK);
  size_t added = 0;
  ASSERT_EQ(torpor_prepare_host_store(pool, 0, 1, &added), TORPOR_OK) << torpor_last_error();
  EXPECT_EQ(added, 4 * MiB) << "3 MiB of state, in whole 2 MiB blocks";
  std::string st = stats_json(pool);
  EXPECT_NE(st.find("\"host_store_pinned_bytes\":4194304"), std::string::npos) << st;
  EXPECT_NE(st.find("\"host_store_pinning_bytes\":0"), std::string::npos) << st;
  ASSERT_EQ(torpor_sleep(pool, 1, nullptr, 0), TORPOR_OK);
  ASSERT_EQ(torpor_wake_up(pool, nullptr, 0), TORPOR_OK);
  st = stats_json(pool);
  EXPECT_NE(st.find("\"retained_bytes\":0"), std::string::npos) << "skip_unchanged 0: " << st;
  size_t released = 0;
  ASSERT_EQ(torpor_release_host_store(pool, &released), TORPOR_OK);
  EXPECT_EQ(released, 4 * MiB);
  EXPECT_NE(stats_json(pool).find("\"host_store_bytes\":0"), std::string::npos);
  EXPECT_EQ(torpor_release_host_store(pool, nullptr), TORPOR_OK);
  // Issue 33 N12: more than the machine's memory is an error, not an OK that did nothing.
  for (size_t too_much : {SIZE_MAX, SIZE_MAX - MiB, SIZE_MAX / 2}) {
    added = 7;
    EXPECT_EQ(torpor_prepare_host_store(pool, too_much, 1, &added), TORPOR_ERROR_INVALID_ARGUMENT) << too_much;
    EXPECT_NE(std::string(torpor_last_error()).find("more than this machine's"), std::string::npos)
        << torpor_last_error();
    EXPECT_EQ(added, 7u) << "nothing written on failure";
  }
  EXPECT_NE(stats_json(pool).find("\"host_store_bytes\":0"), std::string::npos) << "nothing pinned";
  EXPECT_EQ(torpor_pool_destroy(pool), TORPOR_OK);

  o.skip_unchanged = 2;
  EXPECT_EQ(torpor_pool_create(&o, &pool), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(torpor_last_error()).find("skip_unchanged 2"), std::string::npos);
  o.skip_unchanged = 1;
  o.spill_dir = "/tmp";
  EXPECT_EQ(torpor_pool_create(&o, &pool), TORPOR_ERROR_INVALID_ARGUMENT) << "a disk tier needs a host limit";
  EXPECT_NE(std::string(torpor_last_error()).find("needs host_store_limit"), std::string::npos);
}

TEST(HostStoreCApi, MarkRangesAppliesAllInOneCallOrNothing) {
  torpor_pool_options o;
  torpor_pool_options_init(&o);
  o.backend = TORPOR_BACKEND_HOST;
  o.va_bytes = std::size_t{1} << 30;
  o.fill_on_wake = TORPOR_FILL_POISON;
  torpor_pool_t pool = nullptr;
  ASSERT_EQ(torpor_pool_create(&o, &pool), TORPOR_OK);
  void* seg = nullptr;
  ASSERT_EQ(torpor_alloc(pool, 4 * MiB, "weights", TORPOR_CLASS_STATE, nullptr, &seg), TORPOR_OK);
  auto* b = static_cast<std::byte*>(seg);
  void* ptrs[] = {b, b + MiB, b + 2 * MiB};
  size_t bytes[] = {4 * MiB, MiB, MiB};
  int classes[] = {TORPOR_CLASS_CACHE, TORPOR_CLASS_PARAMETER, TORPOR_CLASS_STATE};
  const char* names[] = {nullptr, "layers.0.w", ""};
  // A bad range anywhere: nothing changes, and the message names it.
  size_t too_long[] = {4 * MiB, MiB, 3 * MiB};
  EXPECT_EQ(torpor_mark_ranges(pool, 3, ptrs, too_long, classes, names), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(torpor_last_error()).find("range 2"), std::string::npos) << torpor_last_error();
  int bad_class[] = {TORPOR_CLASS_CACHE, 7, TORPOR_CLASS_STATE};
  EXPECT_EQ(torpor_mark_ranges(pool, 3, ptrs, bytes, bad_class, names), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(torpor_last_error()).find("range 1"), std::string::npos) << torpor_last_error();
  EXPECT_EQ(torpor_mark_ranges(pool, 1, nullptr, bytes, classes, names), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(torpor_mark_ranges(pool, 0, nullptr, nullptr, nullptr, nullptr), TORPOR_OK);
  // Issue 33 N7: a count beyond the bound is refused before any array is read (these hold 3).
  for (size_t count : {TORPOR_MAX_MARK_RANGES + 1, SIZE_MAX}) {
    EXPECT_EQ(torpor_mark_ranges(pool, count, ptrs, bytes, classes, names), TORPOR_ERROR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(torpor_last_error()).find("TORPOR_MAX_MARK_RANGES"), std::string::npos)
        << torpor_last_error();
  }
  std::string st = stats_json(pool);
  EXPECT_NE(st.find("\"state\":{\"allocated_bytes\":4194304"), std::string::npos) << "unchanged: " << st;
  // All of them: cache everywhere, then a parameter and a state range on top (later wins).
  ASSERT_EQ(torpor_mark_ranges(pool, 3, ptrs, bytes, classes, names), TORPOR_OK) << torpor_last_error();
  st = stats_json(pool);
  EXPECT_NE(st.find("\"cache\":{\"allocated_bytes\":2097152"), std::string::npos) << st;
  EXPECT_NE(st.find("\"parameter\":{\"allocated_bytes\":1048576"), std::string::npos) << st;
  EXPECT_NE(st.find("\"state\":{\"allocated_bytes\":1048576"), std::string::npos) << st;
  ASSERT_EQ(torpor_sleep(pool, 1, nullptr, 0), TORPOR_OK);
  char report[4096];
  size_t needed = 0;
  ASSERT_EQ(torpor_last_report_json(pool, report, sizeof report, &needed), TORPOR_OK);
  EXPECT_NE(std::string(report).find("\"bytes_offloaded\":2097152"), std::string::npos) << report;
  EXPECT_EQ(torpor_pool_destroy(pool), TORPOR_OK);
}

}  // namespace
}  // namespace torpor::test
