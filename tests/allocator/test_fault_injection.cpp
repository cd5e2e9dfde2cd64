// Fault injection: fail each kind of driver call at each position inside sleep and inside
// wake, in a first cycle and in later ones (retained copies, the staging ring), alone and in pairs
// (a second fault during the rollback of the first). After every failure the pool must be consistent (each chunk awake
// with its bytes or asleep with its backup, nothing leaked, the driver's live memory equal to what the pool says is
// mapped), and calling again once the fault is gone must succeed with every byte that had to survive intact.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <map>
#include <string>

#include "pool/store/host_store.hpp"
#include "support/backends.hpp"
#include "torpor/error.hpp"
#include "torpor/testing/fault_injecting_driver.hpp"

namespace torpor::test {
namespace {

template <typename B>
class FaultTest : public BackendTest<B> {};
TYPED_TEST_SUITE(FaultTest, Backends, BackendNames);

// Shared by the typed tests below (a free function so the test bodies stay short).
PoolOptions options_for(Driver& d) {
  std::size_t g = d.device_properties(0).granularity;
  PoolOptions o;
  o.va_bytes = std::size_t{256} << 20;
  o.fill_on_wake = FillOnWake::poison;
  o.medium_limit = 8 * g;  // the 2g..3g allocations share medium slabs, as in production
  o.medium_slab_min = 4 * g;
  o.medium_slab_max = 16 * g;
  o.copy_piece_bytes = g / 2 + 256;  // several pieces per chunk
  o.map_group_bytes = 4 * g;         // several map groups on wake
  o.hash_group_bytes = 2 * g;        // several hash groups on sleep: a later one can fail
  return o;
}

struct Item {
  void* p;
  std::size_t n;
  MemoryClass cls;
  std::vector<std::uint8_t> bytes;
};

// Several chunks in two tags: dedicated chunks and slabs, all three classes, a mixed chunk.
std::vector<Item> build(Pool& pool, std::size_t g) {
  std::mt19937_64 rng(11);
  struct Spec {
    std::size_t n;
    const char* tag;
    MemoryClass cls;
  } specs[] = {{3 * g, "weights", MemoryClass::parameter}, {2 * g + 10, "weights", MemoryClass::state},
               {1000, "weights", MemoryClass::state},      {2000, "weights", MemoryClass::state},
               {700, "weights", MemoryClass::parameter},   {2 * g, "kv_cache", MemoryClass::cache},
               {g + 1, "kv_cache", MemoryClass::state}};
  std::vector<Item> items;
  for (const Spec& s : specs) {
    Item it{pool.allocate(s.n, {s.tag, s.cls, "x"}), s.n, s.cls, random_bytes(rng, s.n)};
    write(pool, it.p, it.bytes);
    items.push_back(std::move(it));
  }
  // A mixed chunk: parameters marked inside a state allocation.
  pool.mark(items[1].p, g, MemoryClass::parameter, "x");
  return items;
}

bool survives_level2(const Item& it, std::size_t off, std::size_t g, std::size_t index) {
  if (index == 1) return off >= g;  // the mixed chunk: [0, g) is parameter
  return it.cls == MemoryClass::state;
}

// Every awake item holds its bytes (level-2 survivors exactly; discarded bytes are poison).
void check_items(Pool& pool, const std::vector<Item>& items, std::size_t g, bool slept_level2) {
  for (std::size_t i = 0; i < items.size(); ++i) {
    const Item& it = items[i];
    auto info = pool.find(it.p);
    ASSERT_TRUE(info);
    ASSERT_EQ(info->base, reinterpret_cast<device_ptr>(it.p));
    if (info->asleep) continue;
    auto v = read(pool, it.p, it.n);
    for (std::size_t k = 0; k < it.n; ++k) {
      bool keep = !slept_level2 || survives_level2(it, k, g, i);
      ASSERT_EQ(v[k], keep ? it.bytes[k] : poison_byte) << "item " << i << " byte " << k;
    }
  }
}

void check_accounting(Pool& pool, HostDriver* host) {
  if (host == nullptr) return;
  PoolStats st = pool.stats();
  ASSERT_EQ(host->live_physical_bytes(0), st.mapped_bytes) << "live device memory must be exactly what the pool maps";
}

// After a failed sleep or wake every tag's state agrees with its chunks: a tag with a sleeping
// allocation is asleep; a tag none of whose allocations sleeps is awake and takes new allocations
// (a rollback that left it marked asleep would refuse them).
void check_tags(Pool& pool, const std::vector<Item>& items) {
  std::map<std::string, bool> any_asleep;
  for (const Item& it : items) {
    auto info = pool.find(it.p);
    ASSERT_TRUE(info);
    any_asleep[info->tag] = any_asleep[info->tag] || info->asleep;
  }
  for (const auto& [tag, asleep] : any_asleep) {
    EXPECT_EQ(pool.asleep(tag), asleep) << "tag " << tag;
    if (asleep) continue;
    void* p = nullptr;
    EXPECT_NO_THROW(p = pool.allocate(100, {tag, MemoryClass::state, "probe"})) << "tag " << tag << " is awake";
    if (p != nullptr) pool.deallocate(p);
  }
}

void check_clean(HostDriver* host) {
  if (host == nullptr) return;
  HostDriverCounters c = host->counters();
  EXPECT_EQ(c.live_handles, 0u);
  EXPECT_EQ(c.live_physical_bytes, 0u);
  EXPECT_EQ(c.mappings, 0u);
  EXPECT_EQ(c.reservations, 0u);
  EXPECT_EQ(c.host_bytes, 0u);
  EXPECT_EQ(c.registered_bytes, 0u);
}

// (The host store is page-locked by registration in the background; a refused registration is
// not a failure of the sleep: test_host_store.cpp covers it.)
const DriverCall sleep_kinds[] = {DriverCall::device_synchronize,
                                  DriverCall::hash,
                                  DriverCall::event_create,
                                  DriverCall::copy,
                                  DriverCall::event_record,
                                  DriverCall::event_synchronize,
                                  DriverCall::unmap,
                                  DriverCall::release};
const DriverCall wake_kinds[] = {DriverCall::create, DriverCall::map,  DriverCall::set_access,
                                 DriverCall::copy,   DriverCall::fill, DriverCall::stream_synchronize};

TYPED_TEST(FaultTest, EveryFailureInsideSleepLeavesThePoolConsistent) {
  std::size_t g = this->granularity();
  for (DriverCall kind : sleep_kinds) {
    // How many calls of this kind a clean sleep makes.
    std::size_t count;
    {
      FaultInjectingDriver probe(this->driver());
      Pool pool(probe, options_for(this->driver()));
      build(pool, g);
      std::size_t before = probe.calls(kind);
      pool.sleep(2);
      count = probe.calls(kind) - before;
    }
    ASSERT_GT(count, 0u) << to_string(kind);
    for (std::size_t k = 1; k <= count; ++k) {
      SCOPED_TRACE(::testing::Message() << to_string(kind) << " #" << k << " of " << count);
      FaultInjectingDriver faulty(this->driver());
      {
        Pool pool(faulty, options_for(this->driver()));
        auto items = build(pool, g);
        faulty.fail_nth(kind, k);
        bool threw = false;
        try {
          pool.sleep(2);
        } catch (const error&) {
          threw = true;
        }
        // A failed release is deferred, not thrown: the chunk is unmapped and asleep either way.
        EXPECT_EQ(threw, kind != DriverCall::release);
        EXPECT_EQ(faulty.failures(), 1u);
        if (kind == DriverCall::release)
          EXPECT_EQ(pool.stats().pending_releases, 1u);
        else
          check_accounting(pool, this->host());
        check_items(pool, items, g, false);  // awake chunks still hold every byte
        faulty.clear();
        check_tags(pool, items);
        pool.sleep(2);  // the retry succeeds
        EXPECT_EQ(pool.stats().mapped_bytes, 0u);
        EXPECT_EQ(pool.stats().pending_releases, 0u);
        check_accounting(pool, this->host());
        pool.wake_up();
        check_items(pool, items, g, true);
        check_accounting(pool, this->host());
      }
      check_clean(this->host());
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

TYPED_TEST(FaultTest, EveryFailureInsideWakeLeavesThePoolConsistent) {
  std::size_t g = this->granularity();
  for (DriverCall kind : wake_kinds) {
    std::size_t count;
    {
      FaultInjectingDriver probe(this->driver());
      Pool pool(probe, options_for(this->driver()));
      build(pool, g);
      pool.sleep(2);
      std::size_t before = probe.calls(kind);
      pool.wake_up();
      count = probe.calls(kind) - before;
    }
    ASSERT_GT(count, 0u) << to_string(kind);
    for (std::size_t k = 1; k <= count; ++k) {
      SCOPED_TRACE(::testing::Message() << to_string(kind) << " #" << k << " of " << count);
      FaultInjectingDriver faulty(this->driver());
      {
        Pool pool(faulty, options_for(this->driver()));
        auto items = build(pool, g);
        pool.sleep(2);
        faulty.fail_nth(kind, k);
        EXPECT_THROW(pool.wake_up(), error);
        EXPECT_EQ(faulty.failures(), 1u);
        check_accounting(pool, this->host());
        check_items(pool, items, g, true);  // woken chunks are complete, the rest still asleep
        faulty.clear();
        check_tags(pool, items);
        pool.wake_up();
        for (const Item& it : items) EXPECT_FALSE(pool.find(it.p)->asleep);
        check_items(pool, items, g, true);
        check_accounting(pool, this->host());
        EXPECT_FALSE(pool.asleep("weights"));
      }
      check_clean(this->host());
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

TYPED_TEST(FaultTest, OutOfMemoryOnWakeIsTypedAndRetryable) {
  std::size_t g = this->granularity();
  FaultInjectingDriver faulty(this->driver());
  Pool pool(faulty, options_for(this->driver()));
  auto items = build(pool, g);
  pool.sleep(1);
  faulty.fail_from(DriverCall::create, 3);  // the trainer still holds the memory
  try {
    pool.wake_up();
    FAIL() << "expected out_of_memory";
  } catch (const out_of_memory& e) {
    EXPECT_NE(std::string(e.what()).find("out of memory"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(pool.asleep("weights") || pool.asleep("kv_cache"));
  faulty.clear();
  pool.wake_up();
  for (std::size_t i = 0; i < items.size(); ++i) {
    if (items[i].cls == MemoryClass::cache) continue;
    EXPECT_EQ(read(pool, items[i].p, items[i].n), items[i].bytes) << "item " << i;
  }
}

TYPED_TEST(FaultTest, FailuresInAllocateAndDeallocateChangeNothing) {
  std::size_t g = this->granularity();
  for (DriverCall kind : {DriverCall::create, DriverCall::map, DriverCall::set_access}) {
    FaultInjectingDriver faulty(this->driver());
    {
      Pool pool(faulty, options_for(this->driver()));
      faulty.fail_from(kind, 1);  // every try fails, the smaller slab the pool falls back to as well
      EXPECT_THROW(pool.allocate(2 * g, {"weights", MemoryClass::state, ""}), error) << to_string(kind);
      PoolStats st = pool.stats();
      EXPECT_EQ(st.chunks, 0u);
      EXPECT_EQ(st.va_used_bytes, 0u);
      check_accounting(pool, this->host());
      faulty.clear();
      void* p = pool.allocate(2 * g, {"weights", MemoryClass::state, ""});
      faulty.fail_nth(DriverCall::unmap, 1);
      EXPECT_THROW(pool.deallocate(p), error);
      ASSERT_TRUE(pool.find(p)) << "a failed free keeps the allocation";
      pool.deallocate(p);
    }
    check_clean(this->host());
  }
}

// ---------------------------------------------------------------------------------------------
// Every kind of driver call, across cycles: a sleep that reuses retained copies, a wake that
// verifies them, a sleep and a wake through the staging ring (host allocation and events
// included). Each call of each kind the clean run makes is failed in turn (all of them, or a
// spread of positions when there are many); after the failure the pool's accounting matches the
// driver's and its host store's, every awake allocation holds its bytes, and a repeat completes.

// What each item must hold: now (while awake before the operation) and after the wake that
// follows a sleep at `level`.
struct Expect {
  std::vector<Item> items;
  std::size_t g;
  int level = 0;
  std::vector<std::uint8_t> after_wake(std::size_t i) const {
    const Item& it = items[i];
    std::vector<std::uint8_t> v = it.bytes;
    for (std::size_t k = 0; k < it.n; ++k) {
      bool keep = level == 2 ? survives_level2(it, k, g, i) : it.cls != MemoryClass::cache;
      if (!keep) v[k] = poison_byte;
    }
    return v;
  }
};

void check_awake(Pool& pool, const Expect& e, bool woken_by_op) {
  for (std::size_t i = 0; i < e.items.size(); ++i) {
    const Item& it = e.items[i];
    if (pool.find(it.p)->asleep) continue;
    ASSERT_EQ(read(pool, it.p, it.n), woken_by_op ? e.after_wake(i) : it.bytes) << "item " << i;
  }
}

// The pool's figures against the driver's and the host store's own.
void check_books(Pool& pool, HostDriver* host) {
  PoolStats st = pool.stats();
  EXPECT_EQ(st.host_store_used_bytes + st.spill_used_bytes, st.host_copies_bytes)
      << "host store and disk bytes held = backups + retained copies";
  if (host == nullptr) return;
  EXPECT_EQ(host->counters().mapped_bytes, st.mapped_bytes) << "mapped = what the pool says is mapped";
  if (st.pending_releases == 0) EXPECT_EQ(host->live_physical_bytes(0), st.mapped_bytes);
}

std::vector<std::size_t> positions(std::size_t count) {
  std::vector<std::size_t> out;
  if (count <= 16) {
    for (std::size_t k = 1; k <= count; ++k) out.push_back(k);
    return out;
  }
  for (std::size_t k : {std::size_t{1}, std::size_t{2}, std::size_t{3}, count / 4, count / 2, 3 * count / 4, count - 2,
                        count - 1, count})
    if (out.empty() || out.back() != k) out.push_back(k);
  return out;
}

// setup(pool) -> Expect; op(pool) is the faulted call; wake_op: op is a wake.
template <typename Setup, typename Op>
void fail_every_call(Driver& inner, HostDriver* host, const PoolOptions& o, Setup setup, Op op, bool wake_op) {
  std::size_t tried = 0;
  for (int kind_i = 0; kind_i < static_cast<int>(DriverCall::count_); ++kind_i) {
    auto kind = static_cast<DriverCall>(kind_i);
    std::size_t count;
    {
      FaultInjectingDriver probe(inner);
      Pool pool(probe, o);
      setup(pool);
      std::size_t before = probe.calls(kind);
      op(pool);
      count = probe.calls(kind) - before;
    }
    for (std::size_t k : positions(count)) {
      SCOPED_TRACE(::testing::Message() << to_string(kind) << " #" << k << " of " << count);
      ++tried;
      FaultInjectingDriver faulty(inner);
      {
        Pool pool(faulty, o);
        Expect e = setup(pool);
        faulty.fail_nth(kind, k);
        try {
          op(pool);
        } catch (const error&) {
        }
        EXPECT_EQ(faulty.failures(), 1u);
        check_books(pool, host);
        check_awake(pool, e, wake_op);
        faulty.clear();
        check_tags(pool, e.items);
        op(pool);  // the repeat completes
        if (!wake_op) {
          EXPECT_EQ(pool.stats().mapped_bytes, 0u);
          pool.wake_up();
        }
        for (const Item& it : e.items) EXPECT_FALSE(pool.find(it.p)->asleep);
        check_awake(pool, e, true);
        check_books(pool, host);
        pool.sleep(1);  // and the pool goes on working
        pool.wake_up();
        check_books(pool, host);
      }
      check_clean(host);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
  EXPECT_GT(tried, 5u);
}

// A first level-1 sleep and wake, then item 0 changes (its pieces are copied again, the others'
// retained copies are trusted) and the cache is written anew.
Expect after_one_cycle(Pool& pool, std::size_t g) {
  Expect e{build(pool, g), g, 1};
  pool.sleep(1);
  pool.wake_up();
  std::mt19937_64 rng(12);
  for (std::size_t i = 0; i < e.items.size(); ++i) {
    Item& it = e.items[i];
    if (i == 0 || it.cls == MemoryClass::cache) {
      it.bytes = random_bytes(rng, it.n);
      write(pool, it.p, it.bytes);
    }
  }
  return e;
}

TYPED_TEST(FaultTest, EveryCallOfASleepThatReusesRetainedCopiesCanFail) {
  std::size_t g = this->granularity();
  fail_every_call(
      this->driver(), this->host(), options_for(this->driver()), [&](Pool& pool) { return after_one_cycle(pool, g); },
      [](Pool& pool) { pool.sleep(1); }, false);
}

TYPED_TEST(FaultTest, EveryCallOfAWakeThatVerifiesRetainedCopiesCanFail) {
  std::size_t g = this->granularity();
  fail_every_call(
      this->driver(), this->host(), options_for(this->driver()),
      [&](Pool& pool) {
        Expect e = after_one_cycle(pool, g);
        pool.sleep(1);  // every unchanged piece is trusted, not copied
        return e;
      },
      [](Pool& pool) { pool.wake_up(); }, true);
}

// Beyond a pinned cap of one block: backups in pageable memory through the staging ring.
PoolOptions staged_options(Driver& d) {
  PoolOptions o = options_for(d);
  o.host_store_limit = HostStore::block_rounding;
  o.staging_slots = 2;
  o.staging_slot_bytes = d.device_properties(0).granularity;
  return o;
}

Expect staged(Pool& pool, std::size_t g) {
  Expect e{build(pool, g), g, 2};
  std::mt19937_64 rng(13);
  std::size_t n = HostStore::block_rounding + 3 * g + 5;  // does not fit the pinned cap
  Item big{pool.allocate(n, {"weights", MemoryClass::state, "big"}), n, MemoryClass::state, random_bytes(rng, n)};
  write(pool, big.p, big.bytes);
  e.items.push_back(std::move(big));
  return e;
}

TYPED_TEST(FaultTest, EveryCallOfASleepThroughTheStagingRingCanFail) {
  std::size_t g = this->granularity();
  fail_every_call(
      this->driver(), this->host(), staged_options(this->driver()), [&](Pool& pool) { return staged(pool, g); },
      [](Pool& pool) { pool.sleep(2); }, false);
}

TYPED_TEST(FaultTest, EveryCallOfAWakeThroughTheStagingRingCanFail) {
  std::size_t g = this->granularity();
  fail_every_call(
      this->driver(), this->host(), staged_options(this->driver()),
      [&](Pool& pool) {
        Expect e = staged(pool, g);
        pool.sleep(2);
        return e;
      },
      [](Pool& pool) { pool.wake_up(); }, true);
}

// Level 2 in a later cycle: retained copies of the state are trusted, the parameters discarded.
TYPED_TEST(FaultTest, EveryCallOfALevel2SleepInALaterCycleCanFail) {
  std::size_t g = this->granularity();
  fail_every_call(
      this->driver(), this->host(), options_for(this->driver()),
      [&](Pool& pool) {
        Expect e = after_one_cycle(pool, g);
        e.level = 2;
        return e;
      },
      [](Pool& pool) { pool.sleep(2); }, false);
}

// The disk tier configured: every backup beyond a tiny host limit goes to a spill file.
struct SpillDir {
  SpillDir() {
    std::string base = ::testing::TempDir();
    if (base.empty() || base.back() != '/') base += '/';
    path = base + "torpor-fault-spill-XXXXXX";
    EXPECT_NE(::mkdtemp(path.data()), nullptr);
  }
  ~SpillDir() { ::rmdir(path.c_str()); }  // each pool removes its own file
  std::string path;
};

PoolOptions disk_options(Driver& d, const std::string& dir) {
  PoolOptions o = staged_options(d);
  o.host_store_limit = 1;
  o.spill_dir = dir;
  return o;
}

TYPED_TEST(FaultTest, EveryCallOfASleepToTheDiskTierCanFail) {
  std::size_t g = this->granularity();
  SpillDir dir;
  fail_every_call(
      this->driver(), this->host(), disk_options(this->driver(), dir.path), [&](Pool& pool) { return staged(pool, g); },
      [](Pool& pool) { pool.sleep(2); }, false);
}

TYPED_TEST(FaultTest, EveryCallOfAWakeFromTheDiskTierCanFail) {
  std::size_t g = this->granularity();
  SpillDir dir;
  fail_every_call(
      this->driver(), this->host(), disk_options(this->driver(), dir.path),
      [&](Pool& pool) {
        Expect e = staged(pool, g);
        pool.sleep(2);
        return e;
      },
      [](Pool& pool) { pool.wake_up(); }, true);
}

// Pairs: a failure, then every call of one kind the rollback makes fails too (the rollback's
// synchronize in a sleep; its unmaps or releases in a wake). The pool stays consistent: no chunk
// asleep while the pool forgets its mapping, and a repeat once the faults are gone completes.
TYPED_TEST(FaultTest, AFailureDuringTheRollbackOfAFailureLeavesThePoolConsistent) {
  std::size_t g = this->granularity();
  struct Pair {
    bool wake;
    DriverCall first;
    DriverCall during_rollback;
  };
  const Pair pairs[] = {
      {false, DriverCall::copy, DriverCall::stream_synchronize},
      {false, DriverCall::event_synchronize, DriverCall::stream_synchronize},
      {false, DriverCall::unmap, DriverCall::stream_synchronize},
      {false, DriverCall::copy, DriverCall::release},
      {true, DriverCall::create, DriverCall::unmap},
      {true, DriverCall::map, DriverCall::unmap},
      {true, DriverCall::set_access, DriverCall::unmap},
      {true, DriverCall::copy, DriverCall::unmap},
      {true, DriverCall::fill, DriverCall::unmap},
      {true, DriverCall::stream_synchronize, DriverCall::unmap},
      {true, DriverCall::copy, DriverCall::release},
      {true, DriverCall::set_access, DriverCall::release},
  };
  for (const Pair& pair : pairs) {
    for (std::size_t k : {std::size_t{1}, std::size_t{2}, std::size_t{4}}) {
      SCOPED_TRACE(::testing::Message() << (pair.wake ? "wake: " : "sleep: ") << to_string(pair.first) << " #" << k
                                        << ", then every " << to_string(pair.during_rollback));
      FaultInjectingDriver faulty(this->driver());
      {
        PoolOptions o = options_for(this->driver());
        Pool pool(faulty, o);
        Expect e{build(pool, g), g, 2};
        if (pair.wake) pool.sleep(2);
        faulty.fail_nth(pair.first, k);
        faulty.fail_from(pair.during_rollback, 1);
        try {
          pair.wake ? (void)pool.wake_up() : (void)pool.sleep(2);
        } catch (const error&) {
        }
        faulty.clear();  // the checks read through the pool
        check_books(pool, this->host());
        check_awake(pool, e, pair.wake);
        check_tags(pool, e.items);
        pair.wake ? (void)pool.wake_up() : (void)pool.sleep(2);
        if (!pair.wake) pool.wake_up();
        check_awake(pool, e, true);
        for (const Item& it : e.items) EXPECT_FALSE(pool.find(it.p)->asleep);
        pool.sleep(2);
        EXPECT_EQ(pool.stats().mapped_bytes, 0u);
        if (HostDriver* h = this->host()) EXPECT_EQ(h->counters().mapped_bytes, 0u) << "everything unmapped";
        pool.wake_up();
        check_awake(pool, e, true);
        check_books(pool, this->host());
      }
      check_clean(this->host());
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

// The decorator reports its inner driver's capabilities and forwards the optional calls, so code
// above the seam works the same through it; a withheld capability's call fails as on a driver
// without it and changes nothing.
TEST(FaultInjectingDriverCapabilities, ForwardsWhatTheInnerDriverCanDoAndWithholdsOnRequest) {
  HostDriver host(HostBackend::options());
  FaultInjectingDriver faulty(host);
  const std::size_t g = host.device_properties(0).granularity;
  EXPECT_EQ(faulty.capabilities().compute, DriverCapabilities::Compute::cpu_reference);
  EXPECT_EQ(faulty.capabilities().multicast, DriverCapabilities::Multicast::emulated);
  EXPECT_TRUE(faulty.capabilities().physical_accounting);
  EXPECT_FALSE(faulty.capabilities().make_current);

  // Two buffers bound to one multicast object, all made through the decorator.
  const int devs[] = {0, 1};
  MulticastHandle mc = faulty.multicast_create(devs, g);
  PhysicalHandle m0 = faulty.create(0, g, false), m1 = faulty.create(1, g, false);
  EXPECT_EQ(faulty.live_physical_bytes(0), g) << "the inner driver's account, through the decorator";
  for (int d : devs) faulty.multicast_add_device(mc, d);
  faulty.multicast_bind(mc, 0, m0, 0, g);
  faulty.multicast_bind(mc, 0, m1, 0, g);
  device_ptr mva = faulty.reserve(g, g), a = faulty.reserve(g, g), b = faulty.reserve(g, g);
  faulty.map(mva, g, faulty.as_physical(mc), 0);
  faulty.map(a, g, m0, 0);
  faulty.map(b, g, m1, 0);
  for (device_ptr va : {mva, a, b}) faulty.set_access(va, g, devs);
  const std::uint32_t v = 0xC0FFEE;
  faulty.multicast_store(mva + 64, &v, sizeof v);
  EXPECT_EQ(*reinterpret_cast<std::uint32_t*>(a + 64), v);
  EXPECT_EQ(*reinterpret_cast<std::uint32_t*>(b + 64), v);

  auto expect_not_supported = [](auto call, const char* what) {
    try {
      call();
      ADD_FAILURE() << what << " succeeded";
    } catch (const driver_error& e) {
      EXPECT_EQ(e.code(), static_cast<int>(driver_status::not_supported)) << what;
      EXPECT_NE(std::string(e.what()).find("host driver"), std::string::npos) << e.what();
    }
  };
  expect_not_supported([&] { faulty.make_current(0); }, "make_current");

  DriverCapabilities without = host.capabilities();
  without.multicast = DriverCapabilities::Multicast::none;
  without.physical_accounting = false;
  faulty.report_capabilities(without);
  EXPECT_EQ(faulty.capabilities().multicast, DriverCapabilities::Multicast::none);
  const std::uint32_t w = 7;
  expect_not_supported([&] { faulty.multicast_store(mva + 64, &w, sizeof w); }, "multicast_store");
  EXPECT_EQ(*reinterpret_cast<std::uint32_t*>(a + 64), v) << "a refused store lands nowhere";
  EXPECT_EQ(*reinterpret_cast<std::uint32_t*>(b + 64), v);
  expect_not_supported([&] { (void)faulty.live_physical_bytes(0); }, "live_physical_bytes");

  faulty.report_capabilities(std::nullopt);
  faulty.multicast_store(mva + 64, &w, sizeof w);
  EXPECT_EQ(*reinterpret_cast<std::uint32_t*>(b + 64), w) << "forwarding again";

  for (device_ptr va : {mva, a, b}) faulty.unmap(va, g);
  for (int d : devs) faulty.multicast_unbind(mc, d, 0, g);
  faulty.multicast_release(mc);
  faulty.release(m0);
  faulty.release(m1);
  for (device_ptr va : {mva, a, b}) faulty.free_reservation(va, g);
  check_clean(&host);
}

// native_stream() is the seam's way to the backend's own stream handle (NCCL takes one). A driver
// without one (the host driver) refuses it as not supported, naming itself, also through the
// decorator; nothing stream-like is made up.
TEST(FaultInjectingDriverCapabilities, NativeStreamIsRefusedWhereTheBackendHasNone) {
  HostDriver host(HostBackend::options());
  FaultInjectingDriver faulty(host);
  const Stream s = host.stream_create(0);
  for (Driver* d : {static_cast<Driver*>(&host), static_cast<Driver*>(&faulty)}) {
    try {
      (void)d->native_stream(s);
      ADD_FAILURE() << "native_stream succeeded on the " << d->backend_name() << " driver";
    } catch (const driver_error& e) {
      EXPECT_EQ(e.code(), static_cast<int>(driver_status::not_supported));
      EXPECT_NE(std::string(e.what()).find("host driver"), std::string::npos) << e.what();
    }
  }
  host.stream_destroy(s);
}

}  // namespace
}  // namespace torpor::test
