// Symmetric memory that survives sleep (issue 4), on the host backend: ranks 2, 4 and 8 as
// threads (one HostDriver shared, one device each) and as processes (one HostDriver each, the
// vLLM layout). Suites whose name contains "Threads" also run under TSan.
#include <gtest/gtest.h>

#include <cstring>
#include <latch>
#include <thread>

#include "support/processes.hpp"
#include "torpor/backend.hpp"
#include "torpor/error.hpp"
#include "torpor/host_driver.hpp"
#include "torpor/symmetric.hpp"
#include "torpor/testing/fault_injecting_driver.hpp"

namespace torpor::test {
namespace {

using namespace std::chrono_literals;

// TORPOR_HOST_MODE picks the emulator's mode (CI runs these tests in both).
HostDriverOptions host_options(int devices = 8, bool multicast_attribute = true) {
  HostDriverOptions o;
  o.async = host_driver_options_from_env().async;
  o.devices = devices;
  o.device_bytes = std::size_t{256} << 20;
  o.granularity = std::size_t{64} << 10;
  o.multicast_attribute = multicast_attribute;
  return o;
}

PoolOptions pool_options(int device) {
  PoolOptions o;
  o.device = device;
  o.va_bytes = std::size_t{64} << 20;
  o.exportable = true;
  return o;
}

GroupOptions with_timeout(std::chrono::milliseconds t) {
  GroupOptions o;
  o.timeout = t;
  return o;
}

std::vector<std::uint8_t> pattern(int writer, int owner, int round, std::size_t n) {
  std::vector<std::uint8_t> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = static_cast<std::uint8_t>(writer * 31 + owner * 7 + round * 101 + i * 13 + 1);
  return v;
}

std::vector<std::uint8_t> read(Pool& pool, const void* p, std::size_t n) {
  std::vector<std::uint8_t> v(n);
  pool.copy(v.data(), p, n);
  return v;
}

void* at(void* p, std::size_t off) { return static_cast<std::byte*>(p) + off; }

std::vector<std::uint64_t> read_table(Pool& pool, const SymmetricBuffer& b) {
  std::vector<std::uint64_t> t(static_cast<std::size_t>(b.size()) + 1);
  pool.copy(t.data(), b.peer_table(), t.size() * sizeof(std::uint64_t));
  return t;
}

// Every rank writes its slice of every rank's buffer through its own peer mapping.
void write_through_peers(Pool& pool, SymmetricBuffer& b, std::size_t slice, int round) {
  const int me = b.rank();
  for (int p = 0; p < b.size(); ++p) {
    auto v = pattern(me, p, round, slice);
    pool.copy(at(b.peer(p), static_cast<std::size_t>(me) * slice), v.data(), slice);
  }
}

// This rank's own part holds every writer's slice.
void check_own_part(Pool& pool, SymmetricBuffer& b, std::size_t slice, int round, const std::string& when) {
  const int me = b.rank();
  for (int w = 0; w < b.size(); ++w)
    check(read(pool, at(b.local(), static_cast<std::size_t>(w) * slice), slice) == pattern(w, me, round, slice),
          when + ": rank " + std::to_string(me) + " holds the bytes rank " + std::to_string(w) + " wrote");
}

struct Addresses {
  std::vector<void*> peers;
  void* local;
  void* table;
  void* multicast;
  bool operator==(const Addresses&) const = default;
};
Addresses addresses(const SymmetricBuffer& b) {
  Addresses a{{}, b.local(), b.peer_table(), b.multicast_address()};
  for (int r = 0; r < b.size(); ++r) a.peers.push_back(b.peer(r));
  return a;
}

// The scenario of the issue, for one rank: peer writes, sleep level 2 on every rank, zero live
// physical bytes everywhere, wake ("weights" then "kv_cache", the RL order), every address and
// every byte as before; then the mappings still carry new writes.
void sleep_wake_cycle(HostDriver& host, Driver& driver, Group& group, int device, bool shared_driver) {
  Pool pool(driver, pool_options(device));
  SymmetricHeap heap(pool, group);
  const int n = group.size();
  const std::size_t slice = 4096;
  SymmetricBuffer& slots = heap.allocate(static_cast<std::size_t>(n) * slice, {"weights", "tail.slots", false});
  SymmetricBuffer& big = heap.allocate(200000 + static_cast<std::size_t>(n) * slice, {"kv_cache", "big", false});
  check(slots.part_bytes() % pool.granularity() == 0 && slots.part_bytes() >= slots.bytes(), "part is whole chunks");
  // An ordinary parameter next to them: discarded at level 2, must not disturb anything.
  void* weight = pool.allocate(100000, {"weights", MemoryClass::parameter, "layers.0.w"});

  for (SymmetricBuffer* b : {&slots, &big}) {
    auto t = read_table(pool, *b);
    for (int r = 0; r < n; ++r)
      check(t[static_cast<std::size_t>(r)] == reinterpret_cast<std::uint64_t>(b->peer(r)), "peer table entry");
    check(t[static_cast<std::size_t>(n)] == 0, "no multicast address in the table");
    check(b->peer(group.rank()) == b->local(), "own entry is the local part");
    write_through_peers(pool, *b, slice, 1);
  }
  group.barrier();
  check_own_part(pool, slots, slice, 1, "before sleep");
  check_own_part(pool, big, slice, 1, "before sleep");
  Addresses before_slots = addresses(slots), before_big = addresses(big);

  pool.sleep(2);
  group.barrier();  // every rank asleep
  check(host.live_physical_bytes(device) == 0, "zero live physical bytes on device " + std::to_string(device) +
                                                   " while asleep (a peer's import would keep it)");
  check(!slots.peers_mapped() && !big.peers_mapped(), "no peer mapping while asleep");
  if (shared_driver) {
    auto c = host.counters();
    check(c.live_physical_bytes == 0 && c.live_handles == 0, "no handle alive anywhere while every rank sleeps");
  } else {
    // Imports of other processes' memory are not counted per device: check this process holds none.
    auto c = host.counters();
    check(c.live_handles == 0 && c.mapped_bytes == 0, "this process holds no handle and maps nothing while asleep");
  }
  bool faulted = false;
  try {
    read(pool, slots.peer((group.rank() + 1) % n), 16);
  } catch (const driver_error&) {
    faulted = true;
  }
  check(faulted || n == 1, "touching a sleeping peer address faults");
  group.barrier();  // nobody wakes before every rank has looked

  pool.wake_up({"weights"});
  check(slots.peers_mapped(), "weights buffer re-imported after waking weights");
  check(!big.peers_mapped(), "kv_cache buffer still asleep");
  pool.wake_up({"kv_cache"});
  check(addresses(slots) == before_slots && addresses(big) == before_big, "every address unchanged");
  for (SymmetricBuffer* b : {&slots, &big}) {
    check_own_part(pool, *b, slice, 1, "after wake");
    for (int p = 0; p < n; ++p)
      check(read(pool, at(b->peer(p), static_cast<std::size_t>(group.rank()) * slice), slice) ==
                pattern(group.rank(), p, 1, slice),
            "bytes read back through the peer mapping after wake");
    auto t = read_table(pool, *b);
    for (int r = 0; r < n; ++r)
      check(t[static_cast<std::size_t>(r)] == reinterpret_cast<std::uint64_t>(b->peer(r)), "peer table after wake");
  }
  group.barrier();  // every rank has checked before new writes land
  for (SymmetricBuffer* b : {&slots, &big}) write_through_peers(pool, *b, slice, 2);
  group.barrier();
  check_own_part(pool, slots, slice, 2, "after wake, new writes");
  check_own_part(pool, big, slice, 2, "after wake, new writes");
  // Wake and sleep are idempotent (and still collective).
  pool.wake_up();
  group.barrier();
  pool.deallocate(weight);
  heap.free(slots);
  group.barrier();
}

template <typename F>
std::vector<std::string> on_threads(int n, F body) {
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

std::string joined(const std::vector<std::string>& errors) {
  std::string s;
  for (std::size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) s += "rank " + std::to_string(r) + ": " + errors[r] + "\n";
  return s;
}

// ---------------------------------------------------------------------------------------------

class SymmetricThreads : public ::testing::TestWithParam<int> {};

TEST_P(SymmetricThreads, PeerWritesSurviveLevel2SleepWithEveryAddressUnchanged) {
  const int n = GetParam();
  HostDriver host(host_options());
  auto groups = make_thread_group(n, with_timeout(20s));
  auto errors =
      on_threads(n, [&](int r) { sleep_wake_cycle(host, host, *groups[static_cast<std::size_t>(r)], r, true); });
  EXPECT_EQ(joined(errors), "");
  auto c = host.counters();
  EXPECT_EQ(c.live_handles, 0u);
  EXPECT_EQ(c.mappings, 0u);
  EXPECT_EQ(c.reservations, 0u);
}
INSTANTIATE_TEST_SUITE_P(Ranks, SymmetricThreads, ::testing::Values(2, 4, 8));

class SymmetricProcesses : public ::testing::TestWithParam<int> {};

TEST_P(SymmetricProcesses, PeerWritesSurviveLevel2SleepWithEveryAddressUnchanged) {
  const int n = GetParam();
  Rendezvous rv = Rendezvous::create();
  auto outcomes = run_ranks(n, [&](int r) {
    HostDriver host(host_options());
    UnixSocketGroup group(rv, r, n, with_timeout(20s));
    sleep_wake_cycle(host, host, group, r, false);
    group.barrier();
  });
  EXPECT_EQ(failures(outcomes), "");
}
INSTANTIATE_TEST_SUITE_P(Ranks, SymmetricProcesses, ::testing::Values(2, 4, 8));

// The accounting the tests rely on can fail: a peer that keeps its import mapped keeps the
// owner's memory alive through the owner's sleep.
TEST(SymmetricAccounting, AnImportStillMappedKeepsThePeersMemoryAlive) {
  HostDriver host(host_options(2));
  Pool owner(host, pool_options(0));
  Pool peer(host, pool_options(1));
  void* p = owner.allocate(1 << 20, {"weights", MemoryClass::state, "", /*dedicated=*/true});
  int fd = host.export_fd(owner.chunk_info(p)->handle);
  PhysicalHandle imported = host.import_fd(fd);
  ::close(fd);
  device_ptr va = peer.reserve_address_range(1 << 20);
  host.map(va, 1 << 20, imported, 0);
  owner.sleep(2);
  EXPECT_EQ(host.live_physical_bytes(0), std::size_t{1} << 20) << "the peer's mapping keeps it";
  host.unmap(va, 1 << 20);
  EXPECT_EQ(host.live_physical_bytes(0), std::size_t{1} << 20) << "the peer's handle keeps it";
  host.release(imported);
  EXPECT_EQ(host.live_physical_bytes(0), 0u);
  peer.release_address_range(va);
}

// ---------------------------------------------------------------------------------------------
// Mismatch: a rank that sleeps or wakes alone is named; the documented recovery works.

struct ThreadRanks {
  explicit ThreadRanks(int n, std::chrono::milliseconds timeout)
      : host(host_options()), groups(make_thread_group(n, with_timeout(timeout))) {}
  HostDriver host;
  std::vector<std::unique_ptr<Group>> groups;
};

TEST(SymmetricThreadsMismatch, ARankThatDoesNotSleepIsNamedAndTheGroupRecovers) {
  constexpr int n = 4, absent = 2;
  ThreadRanks t(n, 1000ms);
  std::latch others_failed(n - 1);
  auto errors = on_threads(n, [&](int r) {
    Group& g = *t.groups[static_cast<std::size_t>(r)];
    Pool pool(t.host, pool_options(r));
    SymmetricHeap heap(pool, g);
    SymmetricBuffer& b = heap.allocate(n * 4096, {"weights", "slots", false});
    write_through_peers(pool, b, 4096, 1);
    g.barrier();
    if (r != absent) {
      try {
        pool.sleep(2);
        throw std::runtime_error("sleep without rank 2 succeeded");
      } catch (const group_timeout& e) {
        check(e.missing() == std::vector<int>{absent}, std::string("missing rank named: ") + e.what());
        check(std::string(e.what()).find("rank(s) [2] did not arrive") != std::string::npos, e.what());
        check(std::string(e.what()).find("collective sleep level 2 of symmetric buffers [1]") != std::string::npos,
              e.what());
      }
      // Nothing changed: still awake, peers still mapped, bytes still there.
      check(!pool.asleep("weights") && b.peers_mapped(), "a failed collective sleep changes nothing");
      check_own_part(pool, b, 4096, 1, "after the failed sleep");
      others_failed.count_down();
    } else {
      others_failed.wait();  // rank 2 "was busy"; its control plane now tells it to recover
    }
    g.recover();  // the documented recovery, on every rank
    pool.sleep(2);
    g.barrier();
    check(t.host.live_physical_bytes(r) == 0, "asleep after recovery");
    pool.wake_up();
    check_own_part(pool, b, 4096, 1, "after recovery and a full cycle");
    g.barrier();
  });
  EXPECT_EQ(joined(errors), "");
}

TEST(SymmetricThreadsMismatch, ARankThatWakesAloneIsNamedAndTheGroupRecovers) {
  constexpr int n = 3, alone = 1;
  ThreadRanks t(n, 1000ms);
  std::latch alone_failed(1);
  auto errors = on_threads(n, [&](int r) {
    Group& g = *t.groups[static_cast<std::size_t>(r)];
    Pool pool(t.host, pool_options(r));
    SymmetricHeap heap(pool, g);
    SymmetricBuffer& b = heap.allocate(n * 4096, {"weights", "slots", false});
    write_through_peers(pool, b, 4096, 1);
    g.barrier();
    pool.sleep(2);
    g.barrier();
    if (r == alone) {
      try {
        pool.wake_up();
        throw std::runtime_error("a lone wake succeeded");
      } catch (const group_timeout& e) {
        check(e.missing() == (std::vector<int>{0, 2}), std::string("missing ranks named: ") + e.what());
      }
      check(pool.asleep("weights"), "a failed collective wake leaves the pool asleep");
      alone_failed.count_down();
    } else {
      alone_failed.wait();
    }
    g.recover();
    pool.wake_up();
    check(b.peers_mapped(), "mapped after the collective wake");
    check_own_part(pool, b, 4096, 1, "after recovery and wake");
    g.barrier();
  });
  EXPECT_EQ(joined(errors), "");
}

TEST(SymmetricThreadsMismatch, RanksThatDisagreeOnTheLevelChangeNothing) {
  constexpr int n = 2;
  ThreadRanks t(n, 5s);
  auto errors = on_threads(n, [&](int r) {
    Group& g = *t.groups[static_cast<std::size_t>(r)];
    Pool pool(t.host, pool_options(r));
    SymmetricHeap heap(pool, g);
    SymmetricBuffer& b = heap.allocate(n * 4096, {"weights", "slots", false});
    write_through_peers(pool, b, 4096, 1);
    g.barrier();
    try {
      pool.sleep(r == 0 ? 1 : 2);
      throw std::runtime_error("sleeps at different levels succeeded");
    } catch (const invalid_state& e) {
      check(std::string(e.what()).find("ranks disagree") != std::string::npos, e.what());
    }
    check(!pool.asleep("weights") && b.peers_mapped(), "nothing changed");
    pool.sleep(2);  // no recovery needed: the group itself did not fail
    pool.wake_up();
    check_own_part(pool, b, 4096, 1, "after the agreed cycle");
    g.barrier();
  });
  EXPECT_EQ(joined(errors), "");
}

TEST(SymmetricThreadsMismatch, AFailedWakeOnOneRankFailsEveryRankAndARetryCompletesIt) {
  constexpr int n = 3, failing = 2;
  ThreadRanks t(n, 5s);
  auto errors = on_threads(n, [&](int r) {
    Group& g = *t.groups[static_cast<std::size_t>(r)];
    FaultInjectingDriver faulty(t.host);
    Pool pool(faulty, pool_options(r));
    SymmetricHeap heap(pool, g);
    SymmetricBuffer& b = heap.allocate(n * 4096, {"weights", "slots", false});
    write_through_peers(pool, b, 4096, 1);
    g.barrier();
    pool.sleep(2);
    if (r == failing) faulty.fail_nth(DriverCall::create, 1);  // out of device memory on wake
    try {
      pool.wake_up();
      throw std::runtime_error("wake with an out-of-memory rank succeeded");
    } catch (const out_of_memory&) {
      check(r == failing, "only the failing rank sees its own out_of_memory");
    } catch (const error& e) {
      check(r != failing, e.what());
      check(std::string(e.what()).find("failed on rank(s) [2]") != std::string::npos, e.what());
    }
    check(!b.peers_mapped(), "imports are all or none");
    pool.wake_up();  // the cause is gone: again on every rank
    check(b.peers_mapped(), "the retry completes the wake");
    check_own_part(pool, b, 4096, 1, "after the retried wake");
    g.barrier();
  });
  EXPECT_EQ(joined(errors), "");
}

// The heap drops every rank's imports before the pools sleep. When the pools' sleep then fails
// on every rank, every part is still awake: the imports are back at once, and the peers write
// through them without a wake (before the fix they stayed unmapped until a wake).
TEST(SymmetricThreadsMismatch, AFailedSleepOnEveryRankRestoresThePeerMappingsAtOnce) {
  constexpr int n = 3;
  ThreadRanks t(n, 5s);
  auto errors = on_threads(n, [&](int r) {
    Group& g = *t.groups[static_cast<std::size_t>(r)];
    FaultInjectingDriver faulty(t.host);
    Pool pool(faulty, pool_options(r));
    SymmetricHeap heap(pool, g);
    SymmetricBuffer& b = heap.allocate(n * 4096, {"weights", "slots", false});
    write_through_peers(pool, b, 4096, 1);
    g.barrier();
    // The pool's sleep fails after the heap dropped the imports: the heap's before_sleep
    // synchronizes first, then the pool's sleep does.
    faulty.fail_nth(DriverCall::device_synchronize, 2, driver_status::invalid_value);
    try {
      pool.sleep(2);
      throw std::runtime_error("a sleep whose synchronize failed succeeded");
    } catch (const driver_error&) {
    }
    check(!pool.asleep("weights"), "the failed sleep changed nothing in the pool");
    check(b.peers_mapped(), "the peers' imports are mapped again after the failed sleep");
    g.barrier();
    write_through_peers(pool, b, 4096, 2);
    g.barrier();
    check_own_part(pool, b, 4096, 2, "written through the restored imports");
    g.barrier();
  });
  EXPECT_EQ(joined(errors), "");
}

// One rank's sleep fails, the others sleep: the buffer is not awake everywhere, so imports stay
// dropped (all or none) and the next wake restores them on every rank.
TEST(SymmetricThreadsMismatch, AFailedSleepOnOneRankLeavesTheImportsToTheWake) {
  constexpr int n = 3, failing = 1;
  ThreadRanks t(n, 5s);
  auto errors = on_threads(n, [&](int r) {
    Group& g = *t.groups[static_cast<std::size_t>(r)];
    FaultInjectingDriver faulty(t.host);
    Pool pool(faulty, pool_options(r));
    SymmetricHeap heap(pool, g);
    SymmetricBuffer& b = heap.allocate(n * 4096, {"weights", "slots", false});
    write_through_peers(pool, b, 4096, 1);
    g.barrier();
    if (r == failing) faulty.fail_nth(DriverCall::device_synchronize, 2, driver_status::invalid_value);
    try {
      pool.sleep(2);
      check(r != failing, "the failing rank's sleep succeeded");
    } catch (const driver_error&) {
      check(r == failing, "only the failing rank's pool fails");
    }
    check(!b.peers_mapped(), "imports are all or none while a part sleeps");
    pool.wake_up();
    check(b.peers_mapped(), "the wake restores the imports");
    check_own_part(pool, b, 4096, 1, "after the wake");
    g.barrier();
  });
  EXPECT_EQ(joined(errors), "");
}

TEST(SymmetricThreadsMismatch, AFailedAllocationOnOneRankFailsEveryRankAndLeavesNothing) {
  constexpr int n = 3;
  ThreadRanks t(n, 5s);
  auto before = t.host.counters();
  auto errors = on_threads(n, [&](int r) {
    Group& g = *t.groups[static_cast<std::size_t>(r)];
    FaultInjectingDriver faulty(t.host);
    Pool pool(faulty, pool_options(r));
    SymmetricHeap heap(pool, g);
    if (r == 1) faulty.fail_nth(DriverCall::import_handle, 2);
    try {
      heap.allocate(n * 4096, {"weights", "slots", false});
      throw std::runtime_error("allocation with a failing import succeeded");
    } catch (const driver_error&) {
      check(r == 1, "the failing rank rethrows its driver error");
    } catch (const error& e) {
      check(std::string(e.what()).find("mapping the peers' parts failed on rank(s) [1]") != std::string::npos,
            e.what());
    }
    check(heap.buffers().empty(), "no buffer on any rank");
    g.barrier();
    check(pool.stats().allocations == 0, "the failed allocation freed its part and its table");
    pool.trim();  // the table's empty slab is cached for the fast path; give it back too
    check(t.host.live_physical_bytes(r) == 0, "the failed allocation gave its memory back");
    SymmetricBuffer& b = heap.allocate(n * 4096, {"weights", "slots", false});
    check(b.id() == 1, "ids stay in step after a failed allocation");
    g.barrier();
  });
  EXPECT_EQ(joined(errors), "");
  EXPECT_EQ(t.host.counters().live_handles, before.live_handles);
}

// ---------------------------------------------------------------------------------------------
// Multicast through HostDriver's emulation (thread ranks sharing one driver: the emulation fans a
// store out only within one driver instance).

void unset_kill_switches() {
  for (const char* v :
       {"TORPOR_DISABLE_MULTICAST", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "NCCL_NVLS_ENABLE"})
    ::unsetenv(v);
}

class SymmetricThreadsMulticast : public ::testing::Test {
 protected:
  void SetUp() override { unset_kill_switches(); }
};

TEST_F(SymmetricThreadsMulticast, StoresReachEveryRankBeforeAndAfterSleepAtTheSameAddress) {
  constexpr int n = 4;
  ThreadRanks t(n, 10s);
  auto errors = on_threads(n, [&](int r) {
    Group& g = *t.groups[static_cast<std::size_t>(r)];
    Pool pool(t.host, pool_options(r));
    SymmetricHeap heap(pool, g);
    SymmetricBuffer& b = heap.allocate(64 * 1024, {"weights", "nvls", true});
    check(heap.multicast_decision() && heap.multicast_decision()->use, "the group decided for multicast");
    check(b.multicast_address() != nullptr, "multicast address");
    auto mc = reinterpret_cast<device_ptr>(b.multicast_address());
    auto membership = [&] {
      auto info = t.host.multicast_at(mc);
      check(info.has_value(), "a multicast object is mapped at the buffer's multicast address");
      check(info->devices == std::vector<int>({0, 1, 2, 3}) && info->added == std::vector<int>({0, 1, 2, 3}),
            "every rank's device named and added");
      for (int d = 0; d < n; ++d) check(info->bound_bytes[d] == b.part_bytes(), "every rank's part bound");
      check(info->handles == static_cast<std::size_t>(n), "one handle per rank (creator and imports)");
    };
    membership();
    check(read_table(pool, b)[n] == mc, "the peer table's last entry is the multicast address");
    // Each rank stores its own 64 bytes through the multicast mapping: every part receives all.
    auto store = [&](int round) {
      auto v = pattern(r, -1, round, 64);
      t.host.multicast_store(mc + static_cast<std::size_t>(r) * 64, v.data(), 64);
      g.barrier();
      for (int w = 0; w < n; ++w)
        check(read(pool, at(b.local(), static_cast<std::size_t>(w) * 64), 64) == pattern(w, -1, round, 64),
              "rank " + std::to_string(r) + " received the multicast store of rank " + std::to_string(w));
    };
    store(1);
    g.barrier();
    pool.sleep(2);
    g.barrier();
    check(!t.host.multicast_at(mc), "nothing mapped at the multicast address while asleep");
    check(t.host.counters().multicast_objects == 0, "every multicast handle released while asleep");
    check(t.host.live_physical_bytes(r) == 0, "memory returned");
    g.barrier();
    pool.wake_up();
    check(reinterpret_cast<device_ptr>(b.multicast_address()) == mc, "same multicast address after wake");
    membership();
    for (int w = 0; w < n; ++w)
      check(read(pool, at(b.local(), static_cast<std::size_t>(w) * 64), 64) == pattern(w, -1, 1, 64),
            "bytes stored before sleep survive it");
    g.barrier();  // every rank has looked before new stores land
    store(2);
    g.barrier();
  });
  EXPECT_EQ(joined(errors), "");
  EXPECT_EQ(t.host.counters().multicast_objects, 0u);
}

TEST_F(SymmetricThreadsMulticast, AFailedBindOnOneRankTearsDownEveryRank) {
  constexpr int n = 3;
  ThreadRanks t(n, 5s);
  auto errors = on_threads(n, [&](int r) {
    Group& g = *t.groups[static_cast<std::size_t>(r)];
    FaultInjectingDriver faulty(t.host);
    Pool pool(faulty, pool_options(r));
    SymmetricHeap heap(pool, g);
    if (r == 2) faulty.fail_nth(DriverCall::multicast_bind, 1, driver_status::not_permitted);
    try {
      heap.allocate(64 * 1024, {"weights", "nvls", true});
      throw std::runtime_error("allocation with a failing bind succeeded");
    } catch (const driver_error& e) {
      check(r == 2, e.what());
    } catch (const error& e) {
      check(std::string(e.what()).find("binding to the multicast object failed on rank(s) [2]") != std::string::npos,
            e.what());
    }
    g.barrier();
    check(t.host.counters().multicast_objects == 0, "no multicast handle left on any rank");
    check(pool.stats().allocations == 0, "no allocation left");
    pool.trim();  // the table's empty slab is cached for the fast path
    check(t.host.live_physical_bytes(r) == 0, "no memory left");
    g.barrier();
  });
  EXPECT_EQ(joined(errors), "");
}

// The driver enforces the order (as on the GPU): bind and map only after every device was added.
TEST(HostMulticastOrder, BindOrMapBeforeEveryDeviceWasAddedIsAnError) {
  HostDriver host(host_options(2));
  std::vector<int> devices{0, 1};
  const std::size_t g = host.options().granularity;
  MulticastHandle mc = host.multicast_create(devices, g);
  PhysicalHandle mem0 = host.create(0, g, true);
  device_ptr va = host.reserve(g, g);
  host.multicast_add_device(mc, 0);
  EXPECT_THROW(host.multicast_bind(mc, 0, mem0, 0, g), driver_error);
  EXPECT_THROW(host.map(va, g, host.as_physical(mc), 0), driver_error);
  // Shared by fd with another rank of this driver; a second driver instance cannot import it.
  int fd = host.multicast_export_fd(mc);
  MulticastHandle other = host.multicast_import_fd(fd);
  HostDriver stranger(host_options(2));
  EXPECT_THROW(stranger.multicast_import_fd(fd), driver_error);
  ::close(fd);
  host.multicast_add_device(other, 1);
  EXPECT_THROW(host.multicast_add_device(mc, 1), driver_error) << "added twice";
  host.multicast_bind(mc, 0, mem0, 0, g);
  host.map(va, g, host.as_physical(mc), 0);
  host.set_access(va, g, std::span(devices.data(), 1));
  auto info = host.multicast_at(va);
  ASSERT_TRUE(info);
  EXPECT_EQ(info->handles, 2u);
  EXPECT_EQ(info->bound_bytes[0], g);
  host.unmap(va, g);
  host.multicast_unbind(mc, 0, 0, g);
  host.multicast_release(mc);
  host.multicast_release(other);
  host.release(mem0);
  host.free_reservation(va, g);
  EXPECT_EQ(host.counters().multicast_objects, 0u);
  EXPECT_EQ(host.counters().live_handles, 0u);
}

// ---------------------------------------------------------------------------------------------
// Probe matrix: attribute on/off x each kill switch x one rank disagreeing. The decision, its
// text, the one warning on rank 0, and no multicast call of any kind when the answer is no.

struct KillSwitch {
  const char* name;
  const char* value;
};
constexpr KillSwitch kill_switches[] = {{nullptr, nullptr},
                                        {"TORPOR_DISABLE_MULTICAST", "1"},
                                        {"TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"},
                                        {"NVSHMEM_DISABLE_NVLS", "1"},
                                        {"NCCL_NVLS_ENABLE", "0"}};

std::size_t multicast_calls(const FaultInjectingDriver& d) {
  std::size_t c = 0;
  for (DriverCall k : {DriverCall::multicast_create, DriverCall::multicast_add_device, DriverCall::multicast_bind,
                       DriverCall::multicast_unbind, DriverCall::multicast_release, DriverCall::multicast_granularity,
                       DriverCall::multicast_export, DriverCall::multicast_import})
    c += d.calls(k);
  return c;
}

std::string no_attribute(int device) {
  return "device " + std::to_string(device) +
         " reports no multicast support (CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 0)";
}

std::size_t count_of(const std::string& hay, const std::string& needle) {
  std::size_t c = 0;
  for (auto at = hay.find(needle); at != std::string::npos; at = hay.find(needle, at + 1)) ++c;
  return c;
}

TEST(SymmetricThreadsProbe, DecisionWarningAndNoMulticastCallAcrossTheMatrix) {
  constexpr int n = 2;
  for (bool attribute : {true, false}) {
    for (const KillSwitch& k : kill_switches) {
      for (bool rank1_disagrees : {false, true}) {
        unset_kill_switches();
        if (k.name) ::setenv(k.name, k.value, 1);
        SCOPED_TRACE(testing::Message() << "attribute " << attribute << ", kill switch " << (k.name ? k.name : "none")
                                        << ", rank 1 disagrees " << rank1_disagrees);
        // One driver for the ranks that agree; rank 1 gets its own (attribute off) to disagree.
        HostDriver shared(host_options(n, attribute));
        HostDriver dissenter(host_options(n, false));
        auto groups = make_thread_group(n, with_timeout(10s));
        std::vector<std::optional<MulticastDecision>> decisions(n);
        std::vector<std::size_t> calls(n);
        testing::internal::CaptureStderr();
        auto errors = on_threads(n, [&](int r) {
          HostDriver& mine = (r == 1 && rank1_disagrees) ? dissenter : shared;
          FaultInjectingDriver counting(mine);
          Pool pool(counting, pool_options(r));
          SymmetricHeap heap(pool, *groups[static_cast<std::size_t>(r)]);
          SymmetricBuffer& b = heap.allocate(64 * 1024, {"weights", "nvls", true});
          pool.sleep(2);
          pool.wake_up();
          decisions[static_cast<std::size_t>(r)] = heap.multicast_decision();
          check((b.multicast_address() != nullptr) == heap.multicast_decision()->use, "address iff multicast");
          calls[static_cast<std::size_t>(r)] = multicast_calls(counting);
          heap.free(b);
          calls[static_cast<std::size_t>(r)] = multicast_calls(counting);
        });
        std::string log = testing::internal::GetCapturedStderr();
        unset_kill_switches();
        ASSERT_EQ(joined(errors), "");

        std::string reason;
        if (k.name)
          reason = std::string("rank 0: disabled by ") + k.name + "=" + k.value + " (rank(s) [1] cannot use it either)";
        else if (!attribute)
          reason = "rank 0: " + no_attribute(0) + " (rank(s) [1] cannot use it either)";
        else if (rank1_disagrees)
          reason = "rank 1: " + no_attribute(1);
        const bool use = reason.empty();
        std::string warning = "multicast (NVLS) is not used by this group of 2 rank(s): " + reason +
                              "; symmetric buffers use unicast peer mappings";
        for (int r = 0; r < n; ++r) {
          const auto& d = decisions[static_cast<std::size_t>(r)];
          ASSERT_TRUE(d);
          EXPECT_EQ(d->use, use) << "rank " << r;
          EXPECT_EQ(d->reason, reason) << "rank " << r << ": every rank reaches the same decision";
          EXPECT_EQ(d->warning, (!use && r == 0) ? warning : "") << "rank " << r;
          if (!use) {
            EXPECT_EQ(calls[static_cast<std::size_t>(r)], 0u) << "rank " << r << " made a multicast call";
          }
        }
        if (use) {
          EXPECT_GT(calls[0], 0u);
          EXPECT_EQ(count_of(log, "multicast (NVLS) is not used"), 0u) << log;
        } else {
          EXPECT_EQ(count_of(log, "torpor warn: " + warning), 1u) << "one warning, on rank 0:\n" << log;
          EXPECT_EQ(count_of(log, "multicast (NVLS) is not used"), 1u) << log;
        }
      }
    }
  }
}

TEST(SymmetricProcessesProbe, AKillSwitchOnOneRankDecidesForTheGroupWithoutAMulticastCall) {
  for (bool attribute : {true, false}) {
    for (const KillSwitch& k : kill_switches) {
      if (!k.name) continue;
      SCOPED_TRACE(testing::Message() << "attribute " << attribute << ", kill switch " << k.name << " on rank 1 only");
      unset_kill_switches();
      Rendezvous rv = Rendezvous::create();
      auto outcomes = run_ranks(2, [&](int r) {
        if (r == 1) ::setenv(k.name, k.value, 1);
        HostDriver host(host_options(2, attribute));
        FaultInjectingDriver counting(host);
        UnixSocketGroup group(rv, r, 2, with_timeout(10s));
        Pool pool(counting, pool_options(r));
        SymmetricHeap heap(pool, group);
        SymmetricBuffer& b = heap.allocate(64 * 1024, {"weights", "nvls", true});
        pool.sleep(2);
        pool.wake_up();
        auto d = *heap.multicast_decision();
        std::string expected = attribute ? std::string("rank 1: disabled by ") + k.name + "=" + k.value
                                         : "rank 0: " + no_attribute(0) + " (rank(s) [1] cannot use it either)";
        check(!d.use && d.reason == expected, "decision: " + d.reason + " (expected " + expected + ")");
        check(d.rank_reasons[1] == std::string("disabled by ") + k.name + "=" + k.value, "rank 1's own verdict");
        check(d.warning.empty() == (r != 0), "the warning is logged on rank 0 only");
        check(b.multicast_address() == nullptr, "unicast");
        heap.free(b);
        check(multicast_calls(counting) == 0, "no multicast call");
        group.barrier();
      });
      EXPECT_EQ(failures(outcomes), "");
    }
  }
}

TEST(SymmetricProcessesProbe, HostDriverProcessesNeverShareMulticast) {
  unset_kill_switches();
  Rendezvous rv = Rendezvous::create();
  auto outcomes = run_ranks(2, [&](int r) {
    HostDriver host(host_options(2, true));
    FaultInjectingDriver counting(host);
    UnixSocketGroup group(rv, r, 2, with_timeout(10s));
    Pool pool(counting, pool_options(r));
    SymmetricHeap heap(pool, group);
    heap.allocate(64 * 1024, {"weights", "nvls", true});
    auto d = *heap.multicast_decision();
    check(!d.use &&
              d.reason.find("cannot share a multicast object with a rank in another process") != std::string::npos,
          d.reason);
    check(multicast_calls(counting) == 0, "no multicast call");
    group.barrier();
  });
  EXPECT_EQ(failures(outcomes), "");
}

// ---------------------------------------------------------------------------------------------
// Misuse

TEST(SymmetricThreadsMisuse, APoolThatCannotExportIsRefusedOnEveryRank) {
  HostDriver host(host_options(2));
  auto groups = make_thread_group(2, with_timeout(5s));
  auto errors = on_threads(2, [&](int r) {
    PoolOptions o = pool_options(r);
    o.exportable = r == 0;
    Pool pool(host, o);
    try {
      SymmetricHeap heap(pool, *groups[static_cast<std::size_t>(r)]);
    } catch (const invalid_argument& e) {
      check(std::string(e.what()).find("rank 1: its pool is not exportable") != std::string::npos, e.what());
      return;
    }
    throw std::runtime_error("a heap over a non-exportable pool was created");
  });
  EXPECT_EQ(joined(errors), "");
}

TEST(SymmetricThreadsMisuse, DifferentSizesOnDifferentRanksAreRefused) {
  HostDriver host(host_options(2));
  auto groups = make_thread_group(2, with_timeout(5s));
  auto errors = on_threads(2, [&](int r) {
    Pool pool(host, pool_options(r));
    SymmetricHeap heap(pool, *groups[static_cast<std::size_t>(r)]);
    try {
      heap.allocate(r == 0 ? 4096 : 8192);
    } catch (const invalid_state& e) {
      check(std::string(e.what()).find("rank 0: allocate bytes 4096") != std::string::npos, e.what());
      check(heap.buffers().empty(), "nothing allocated");
      return;
    }
    throw std::runtime_error("mismatched sizes were allocated");
  });
  EXPECT_EQ(joined(errors), "");
}

}  // namespace
}  // namespace torpor::test
