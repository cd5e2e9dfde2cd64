// The property test with threads, faults and the host store's books. Three threads share one
// HostDriver (synchronous, and asynchronous: device work done later by the driver's stream
// workers). Each thread has a pool of its own on a device of its own, seen through a
// fault-injecting driver of its own, and two tags of its own in one pool all threads share; each
// runs a random sequence of allocate / free / mark / write / sleep(0, 1, 2) / wake, checked after
// every step against a byte-level model of its own allocations:
//   - every awake allocation holds the model's bytes (discarded ones the poison pattern);
//   - a third of the sleeps and wakes of its own pool get a fault at a random call; after it every
//     awake allocation still holds its bytes, the books agree, and a repeat completes;
//   - the books: host store bytes in use equal the bytes of backups and retained copies, and
//     (no release pending) live device bytes equal the bytes the pool maps;
//   - no growth: once warm, repeated cycles over the same allocations take no more host store,
//     host memory or device memory;
//   - at the end nothing is left in the driver.
// The suite's name contains "Threads": CI also runs it under ThreadSanitizer.
#include <gtest/gtest.h>

#include <map>
#include <thread>

#include "support/backends.hpp"
#include "torpor/error.hpp"
#include "torpor/testing/fault_injecting_driver.hpp"

namespace torpor::test {
namespace {

constexpr int threads = 3;

struct Model {
  std::size_t n = 0;
  std::string tag;
  std::vector<std::uint8_t> bytes;
  std::vector<MemoryClass> cls;
  std::vector<bool> backed;
  int level = 0;  // 0 = awake
};

bool survives(MemoryClass c, int level) {
  return c == MemoryClass::state || (c == MemoryClass::parameter && level == 1);
}

const DriverCall sleep_faults[] = {DriverCall::device_synchronize, DriverCall::hash,  DriverCall::host_alloc,
                                   DriverCall::event_create,       DriverCall::copy,  DriverCall::event_record,
                                   DriverCall::event_synchronize,  DriverCall::unmap, DriverCall::release};
const DriverCall wake_faults[] = {DriverCall::create, DriverCall::map,  DriverCall::set_access,        DriverCall::copy,
                                  DriverCall::fill,   DriverCall::hash, DriverCall::stream_synchronize};

// One thread's view: a pool (its own or the shared one) and the tags it owns there.
struct Side {
  Pool* pool;
  FaultInjectingDriver* faults;  // null for the shared pool: no faults there
  std::vector<std::string> tags;
  std::map<void*, Model> model;
  std::map<std::string, bool> asleep;
};

class Runner {
 public:
  Runner(HostDriver& host, int t, Side own, Side shared, std::uint64_t seed)
      : host_(host), t_(t), rng_(seed), sides_{std::move(own), std::move(shared)} {}

  void run(int steps) {
    for (int step = 0; step < steps && !::testing::Test::HasFatalFailure(); ++step) {
      Side& side = sides_[pick(10) < 7 ? 0 : 1];
      std::size_t op = pick(100);
      if (op < 30)
        allocate(side);
      else if (op < 42)
        free_one(side);
      else if (op < 52)
        mark(side);
      else if (op < 66)
        write_one(side);
      else if (op < 83)
        transition(side, true);
      else
        transition(side, false);
      check_books(sides_[0], true);
      check_books(sides_[1], false);
    }
  }

  // Everything awake and checked, then the same allocations through cycles: no growth.
  void settle_and_check_growth() {
    for (Side& side : sides_) {
      std::vector<std::string> tags = known_tags(side);
      if (tags.empty()) continue;
      side.pool->wake_up(tags);
      after_wake(side, tags);
    }
    Side& own = sides_[0];
    std::vector<std::string> tags = known_tags(own);
    if (tags.empty()) return;
    std::size_t store = 0, live = 0;
    for (int cycle = 0; cycle < 5; ++cycle) {
      for (auto& [p, m] : own.model) {
        if (m.n > 0 && pick(2) == 0) {  // change some bytes, keep the others (retained copies)
          m.bytes[0] = static_cast<std::uint8_t>(m.bytes[0] + 1);
          own.pool->copy(p, m.bytes.data(), 1);
        }
      }
      own.pool->sleep(1, tags);
      own.pool->wake_up(tags);
      for (auto& [p, m] : own.model)
        for (std::size_t i = 0; i < m.n; ++i)
          if (m.cls[i] == MemoryClass::cache) m.bytes[i] = poison_byte;
      check_all(own);
      PoolStats st = own.pool->stats();
      if (cycle == 1) {
        store = st.host_store_bytes;
        live = st.mapped_bytes;
      } else if (cycle > 1) {
        EXPECT_EQ(st.host_store_bytes, store) << "thread " << t_ << ": the host store grew in cycle " << cycle;
        EXPECT_EQ(st.mapped_bytes, live) << "thread " << t_ << ": mapped bytes grew in cycle " << cycle;
      }
    }
  }

 private:
  std::size_t pick(std::size_t n) { return static_cast<std::size_t>(rng_() % n); }

  std::size_t random_size() {
    const std::size_t g = host_.options().granularity;
    switch (pick(3)) {
      case 0: return 1 + pick(4096);
      case 1: return 1 + pick(g);
      default: return 1 + pick(6 * g);
    }
  }

  void allocate(Side& side) {
    const std::string& tag = side.tags[pick(side.tags.size())];
    auto cls = static_cast<MemoryClass>(pick(3));
    std::size_t n = random_size();
    if (side.asleep[tag]) {
      EXPECT_THROW(side.pool->allocate(n, {tag, cls, "w"}), invalid_state);
      return;
    }
    void* p = side.pool->allocate(n, {tag, cls, "w"});
    Model m;
    m.n = n;
    m.tag = tag;
    m.bytes = random_bytes(rng_, n);
    m.cls.assign(n, cls);
    write(*side.pool, p, m.bytes);
    side.model[p] = std::move(m);
  }

  std::map<void*, Model>::iterator any(Side& side) {
    return std::next(side.model.begin(), static_cast<long>(pick(side.model.size())));
  }

  void free_one(Side& side) {
    if (side.model.empty()) return;
    auto it = any(side);
    side.pool->deallocate(it->first);
    side.model.erase(it);
  }

  void mark(Side& side) {
    if (side.model.empty()) return;
    auto it = any(side);
    Model& m = it->second;
    std::size_t lo = pick(m.n), len = 1 + pick(m.n - lo);
    auto cls = static_cast<MemoryClass>(pick(3));
    bool discarded = false;
    if (m.level != 0)
      for (std::size_t i = lo; i < lo + len; ++i) discarded = discarded || !m.backed[i];
    if (m.level != 0 && cls == MemoryClass::state && discarded) {
      EXPECT_THROW(side.pool->mark(at(it->first, lo), len, cls, "m"), invalid_state);
      return;
    }
    side.pool->mark(at(it->first, lo), len, cls, "m");
    for (std::size_t i = lo; i < lo + len; ++i) m.cls[i] = cls;
  }

  void write_one(Side& side) {
    if (side.model.empty()) return;
    auto it = any(side);
    Model& m = it->second;
    if (m.level != 0) return;
    std::size_t lo = pick(m.n), len = 1 + pick(m.n - lo);
    auto v = random_bytes(rng_, len);
    side.pool->copy(at(it->first, lo), v.data(), len);
    std::copy(v.begin(), v.end(), m.bytes.begin() + static_cast<long>(lo));
  }

  // The side's tags the pool knows (allocated in at least once): a few of them.
  static std::vector<std::string> known_tags(const Side& side) {
    std::vector<std::string> known = side.pool->tags(), out;
    for (const auto& t : side.tags)
      if (std::find(known.begin(), known.end(), t) != known.end()) out.push_back(t);
    return out;
  }

  std::vector<std::string> some_tags(const Side& side) {
    std::vector<std::string> known = known_tags(side), out;
    for (const auto& t : known)
      if (pick(2) == 0) out.push_back(t);
    if (out.empty() && !known.empty()) out.push_back(known[pick(known.size())]);
    return out;
  }

  void transition(Side& side, bool sleep) {
    std::vector<std::string> tags = some_tags(side);
    if (tags.empty()) return;
    int level = static_cast<int>(pick(3));
    auto call = [&] { sleep ? (void)side.pool->sleep(level, tags) : (void)side.pool->wake_up(tags); };
    if (side.faults != nullptr && pick(3) == 0) {
      const DriverCall* kinds = sleep ? sleep_faults : wake_faults;
      std::size_t count = sleep ? std::size(sleep_faults) : std::size(wake_faults);
      side.faults->fail_nth(kinds[pick(count)], 1 + pick(3));
      bool failed = false;
      try {
        call();
      } catch (const error&) {
        failed = true;
      }
      side.faults->clear();
      if (failed) check_after_failure(side, tags, sleep);
    }
    call();  // with no fault: completes whatever the faulted attempt left
    if (sleep && level != 0)
      after_sleep(side, tags, level);
    else if (!sleep)
      after_wake(side, tags);
  }

  static bool selected(const std::vector<std::string>& tags, const std::string& t) {
    return std::find(tags.begin(), tags.end(), t) != tags.end();
  }

  void after_sleep(Side& side, const std::vector<std::string>& tags, int level) {
    for (const auto& t : tags) side.asleep[t] = true;
    for (auto& [p, m] : side.model) {
      if (!selected(tags, m.tag)) continue;
      if (m.level == 0) {
        m.backed.assign(m.n, false);
        for (std::size_t i = 0; i < m.n; ++i) m.backed[i] = survives(m.cls[i], level);
        m.level = level;
      } else if (m.level < level) {
        for (std::size_t i = 0; i < m.n; ++i) m.backed[i] = m.backed[i] && survives(m.cls[i], level);
        m.level = level;
      }
    }
  }

  void after_wake(Side& side, const std::vector<std::string>& tags) {
    for (const auto& t : tags) side.asleep[t] = false;
    for (auto& [p, m] : side.model) {
      if (!selected(tags, m.tag) || m.level == 0) continue;
      for (std::size_t i = 0; i < m.n; ++i)
        if (!m.backed[i]) m.bytes[i] = poison_byte;
      m.level = 0;
    }
    check_all(side);
  }

  // After a failed sleep or wake: each allocation asleep, or awake with its bytes.
  void check_after_failure(Side& side, const std::vector<std::string>& tags, bool sleep) {
    for (auto& [p, m] : side.model) {
      auto info = side.pool->find(p);
      ASSERT_TRUE(info);
      if (info->asleep) continue;
      std::vector<std::uint8_t> expected = m.bytes;
      if (!sleep && selected(tags, m.tag) && m.level != 0)
        for (std::size_t i = 0; i < m.n; ++i)
          if (!m.backed[i]) expected[i] = poison_byte;
      ASSERT_EQ(read(*side.pool, p, m.n), expected)
          << "thread " << t_ << ": an awake allocation after a failed " << (sleep ? "sleep" : "wake");
    }
    check_books(side, side.faults != nullptr);
  }

  void check_all(Side& side) {
    for (auto& [p, m] : side.model) {
      if (m.level != 0) continue;
      ASSERT_EQ(read(*side.pool, p, m.n), m.bytes) << "thread " << t_ << " tag " << m.tag;
    }
  }

  void check_books(Side& side, bool own_device) {
    PoolStats st = side.pool->stats();
    ASSERT_EQ(st.host_store_used_bytes, st.host_copies_bytes) << "thread " << t_ << ": host store books";
    if (own_device && st.pending_releases == 0)
      ASSERT_EQ(host_.live_physical_bytes(side.pool->device()), st.mapped_bytes) << "thread " << t_;
  }

  HostDriver& host_;
  int t_;
  std::mt19937_64 rng_;
  Side sides_[2];
};

class PropertyThreads : public ::testing::TestWithParam<bool> {};

TEST_P(PropertyThreads, ConcurrentSequencesWithFaultsKeepBytesAndBooks) {
  HostDriverOptions o;
  o.devices = threads + 1;
  o.device_bytes = std::size_t{256} << 20;
  o.granularity = std::size_t{64} << 10;
  o.async = GetParam();
  o.async_seed = 5;
  o.async_max_delay = std::chrono::microseconds{50};
  HostDriver host(o);
  auto options_for = [](int device) {
    PoolOptions p;
    p.device = device;
    p.va_bytes = std::size_t{128} << 20;
    p.fill_on_wake = FillOnWake::poison;
    p.medium_limit = 4 * (std::size_t{64} << 10);
    p.medium_slab_min = 2 * (std::size_t{64} << 10);
    p.medium_slab_max = 8 * (std::size_t{64} << 10);
    p.copy_piece_bytes = 3 * 4096 + 256;
    return p;
  };
  {
    Pool shared(host, options_for(threads));
    std::vector<std::thread> workers;
    std::vector<std::string> failures(threads);
    for (int t = 0; t < threads; ++t) {
      workers.emplace_back([&, t] {
        FaultInjectingDriver faulty(host);
        Pool own(faulty, options_for(t));
        std::string w = "t" + std::to_string(t) + ".weights", kv = "t" + std::to_string(t) + ".kv";
        Runner runner(host, t, Side{&own, &faulty, {"weights", "kv_cache"}, {}, {}},
                      Side{&shared, nullptr, {w, kv}, {}, {}}, 100 + static_cast<std::uint64_t>(t));
        runner.run(150);
        if (!::testing::Test::HasFatalFailure()) runner.settle_and_check_growth();
      });
    }
    for (auto& w : workers) w.join();
    PoolStats st = shared.stats();
    EXPECT_EQ(st.host_store_used_bytes, st.host_copies_bytes);
    EXPECT_EQ(host.live_physical_bytes(threads), st.mapped_bytes);
  }
  HostDriverCounters c = host.counters();
  EXPECT_EQ(c.live_handles, 0u);
  EXPECT_EQ(c.live_physical_bytes, 0u);
  EXPECT_EQ(c.mappings, 0u);
  EXPECT_EQ(c.reservations, 0u);
  EXPECT_EQ(c.host_bytes, 0u);
  EXPECT_EQ(c.streams, 0u);
  EXPECT_EQ(c.async_conflicts, 0u);
}

INSTANTIATE_TEST_SUITE_P(Modes, PropertyThreads, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "host_async" : "host"; });

}  // namespace
}  // namespace torpor::test
