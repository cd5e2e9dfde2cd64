// Randomized model test of the host store with and without its disk tier (issue 33): random
// sequences of allocate / free / mark / write / sleep at levels 0-2 / partial wakes / reuse of
// freed space, with injected copy faults during sleep and wake, a spill limit that fills up, and
// forked children that wake, check and destroy their copy of the pool, checked against a
// byte-level model written independently of the pool:
//   - an awake allocation holds the model's bytes: state always, parameters after level 1 or when
//     preserved ("keep.*"), the poison pattern where a sleep discarded them;
//   - a failed sleep or wake throws a typed error; once the fault is gone a wake of the same tags
//     succeeds, every tag is awake and takes allocations again, and each byte is what either
//     outcome of the failed sleep allows (kept, or discarded by its level) — never anything else;
//   - a forked child sees the parent's bytes, and its exit changes nothing for the parent.
// Every configuration: disk tier off; on with direct I/O; on with buffered I/O; each with
// skip_unchanged on and off. The bytes that differ from the model are counted, not only
// asserted, so a long run reports how many were lost. TORPOR_TEST_MODEL_OPS sets the operations
// per configuration (CI: a few hundred; bench/results holds a 10,000-operation run).
#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <string>

#include "support/backends.hpp"
#include "support/sanitizers.hpp"
#include "torpor/error.hpp"
#include "torpor/host_driver.hpp"
#include "torpor/testing/fault_injecting_driver.hpp"

namespace torpor::test {
namespace {

enum class Disk { off, direct, buffered };

struct Config {
  Disk disk = Disk::off;
  bool skip_unchanged = true;
};

std::string describe(const Config& c) {
  const char* d = c.disk == Disk::off ? "no disk tier" : c.disk == Disk::direct ? "disk, direct I/O" : "disk, buffered";
  return std::string(d) + (c.skip_unchanged ? ", skip_unchanged" : ", no skip_unchanged");
}

// A fresh directory, removed with its files at the end.
struct ScratchDir {
  ScratchDir() {
    std::string base = ::testing::TempDir();
    if (base.empty() || base.back() != '/') base += '/';
    std::string tmpl = base + "torpor-model-test-XXXXXX";
    EXPECT_NE(::mkdtemp(tmpl.data()), nullptr);
    path = tmpl;
  }
  ~ScratchDir() {
    if (DIR* d = ::opendir(path.c_str())) {
      while (dirent* e = ::readdir(d))
        if (std::string(e->d_name) != "." && std::string(e->d_name) != "..") ::unlink((path + "/" + e->d_name).c_str());
      ::closedir(d);
    }
    ::rmdir(path.c_str());
  }
  std::string path;
};

struct Modeled {
  std::size_t n = 0;
  std::string tag;
  std::vector<std::uint8_t> bytes;  // the contents while awake
  std::vector<MemoryClass> cls;     // per byte
  std::vector<bool> keep;           // per byte: named "keep.*" (preserved at level 2)
  std::vector<bool> backed;         // while asleep: bytes that have a backup
  std::vector<bool> unsure;         // after a failed sleep: kept or discarded, either is right
  int level = 0;                    // 0 = awake
};

// The table of pool.hpp, restated: what a sleep of `level` keeps of a byte.
bool survives(MemoryClass c, bool keep, int level) {
  if (c == MemoryClass::state) return true;
  if (c == MemoryClass::cache) return false;
  return level <= 1 || keep;
}

int ops_per_config() {
  const char* v = std::getenv("TORPOR_TEST_MODEL_OPS");
  if (v == nullptr || *v == '\0') {
#if defined(TORPOR_TEST_ASAN) || defined(TORPOR_TEST_TSAN)
    return 200;
#else
    return 800;
#endif
  }
  char* end = nullptr;
  long n = std::strtol(v, &end, 10);
  if (*end != '\0' || n < 1 || n > 10'000'000) {
    ADD_FAILURE() << "TORPOR_TEST_MODEL_OPS=" << v << " is not a count in [1, 10000000]";
    return 1;
  }
  return static_cast<int>(n);
}

struct Tally {
  std::size_t ops = 0, sleeps = 0, wakes = 0, failed_sleeps = 0, failed_wakes = 0, forks = 0, spilled = 0;
  std::size_t bytes_checked = 0, bytes_lost = 0;
};

class ModelRun {
 public:
  ModelRun(const Config& c, std::uint64_t seed, const std::string& dir)
      : config_(c), rng_(seed), host_(HostBackend::options()), faulty_(host_) {
    g_ = host_.device_properties(0).granularity;
    PoolOptions o;
    o.va_bytes = 2048 * g_;
    o.fill_on_wake = FillOnWake::poison;
    o.medium_limit = 8 * g_;
    o.medium_slab_min = 4 * g_;
    o.medium_slab_max = 16 * g_;
    o.skip_unchanged = c.skip_unchanged;
    o.copy_piece_bytes = 3 * 4096 + 256;  // pieces straddle allocations, chunks and file pages
    if (c.disk != Disk::off) {
      const std::size_t limits[] = {1, 3 * g_, 40 * g_};  // all on disk; a few pieces in memory; most
      o.host_store_limit = limits[seed % 3];
      o.spill_dir = dir;
      o.spill_try_direct_io = c.disk == Disk::direct;
      o.spill_limit = seed % 4 == 3 ? 24 * g_ : 0;  // sometimes the disk tier fills up mid-sleep
      o.staging_slots = 3;
      o.staging_slot_bytes = 64 * 1024;
    }
    pool_ = std::make_unique<Pool>(faulty_, o);
    pool_->set_preserve({"keep.*"});
    if (c.disk != Disk::off) {
      const bool direct = pool_->stats().spill_direct_io;
      // Buffered always when asked; direct where the file system takes it (say so when it does not).
      EXPECT_TRUE(c.disk == Disk::direct || !direct);
      if (c.disk == Disk::direct && !direct) std::printf("note: %s does not take O_DIRECT\n", dir.c_str());
    }
  }

  void run(int steps) {
    for (int s = 0; s < steps && !::testing::Test::HasFatalFailure(); ++s) {
      ++tally.ops;
      std::size_t op = pick(100);
      if (op < 24)
        allocate();
      else if (op < 36)
        free_one();
      else if (op < 46)
        mark_one();
      else if (op < 58)
        write_one();
      else if (op < 76)
        sleep_some();
      else if (op < 95)
        wake_some();
      else
        fork_and_check();
    }
    if (::testing::Test::HasFatalFailure()) return;
    faulty_.clear();
    pool_->wake_up();
    for (auto& [p, m] : model_) settle_awake(p, m);
    tally.spilled += pool_->stats().spill_used_bytes;
    pool_.reset();
    HostDriverCounters c = host_.counters();
    EXPECT_EQ(c.live_handles, 0u);
    EXPECT_EQ(c.live_physical_bytes, 0u);
    EXPECT_EQ(c.host_bytes, 0u);
  }

  Tally tally;

 private:
  std::size_t pick(std::size_t n) { return static_cast<std::size_t>(rng_() % n); }

  std::size_t random_size() {
    switch (pick(4)) {
      case 0: return 1 + pick(4096);
      case 1: return 1 + pick(g_ / 2);
      case 2: return g_ / 2 + 1 + pick(3 * g_);
      default: return 1 + pick(12 * g_);  // past medium_limit: dedicated chunks too
    }
  }

  bool tag_asleep(const std::string& t) const {
    auto it = asleep_.find(t);
    return it != asleep_.end() && it->second;
  }

  std::vector<std::string> random_tags() {
    std::vector<std::string> t;
    if (pick(3) == 0) return t;  // every tag
    for (const auto& name : tag_names_)
      if (asleep_.count(name) && pick(2) == 0) t.push_back(name);
    if (t.empty() && !asleep_.empty()) t.push_back(asleep_.begin()->first);
    return t;
  }

  static bool selected(const std::vector<std::string>& tags, const std::string& t) {
    return tags.empty() || std::find(tags.begin(), tags.end(), t) != tags.end();
  }

  // Whether a selected tag holding allocations is asleep (or awake, for asleep = false).
  bool any_selected(const std::vector<std::string>& tags, bool asleep) const {
    return std::any_of(model_.begin(), model_.end(), [&](const auto& kv) {
      return selected(tags, kv.second.tag) && (kv.second.level != 0) == asleep;
    });
  }

  std::map<void*, Modeled>::iterator any() { return std::next(model_.begin(), static_cast<long>(pick(model_.size()))); }

  void allocate() {
    const std::string tag = tag_names_[pick(tag_names_.size())];
    const auto cls = static_cast<MemoryClass>(pick(3));
    const bool keep = pick(2) == 0;
    const std::size_t n = random_size();
    if (tag_asleep(tag)) {
      EXPECT_THROW(pool_->allocate(n, {tag, cls, keep ? "keep.w" : "w"}), invalid_state);
      return;
    }
    void* p = nullptr;
    try {
      p = pool_->allocate(n, {tag, cls, keep ? "keep.w" : "w"});
    } catch (const out_of_memory&) {
      return;  // the emulated device is full: nothing was allocated
    }
    Modeled m;
    m.n = n;
    m.tag = tag;
    m.bytes = random_bytes(rng_, n);
    m.cls.assign(n, cls);
    m.keep.assign(n, keep);
    m.unsure.assign(n, false);
    write(*pool_, p, m.bytes);
    ASSERT_EQ(model_.count(p), 0u) << "an address handed out twice";
    model_[p] = std::move(m);
    asleep_.try_emplace(tag, false);
  }

  void free_one() {
    if (model_.empty()) return;
    auto it = any();
    pool_->deallocate(it->first);
    model_.erase(it);
  }

  void mark_one() {
    if (model_.empty()) return;
    auto it = any();
    Modeled& m = it->second;
    const std::size_t lo = pick(m.n), len = 1 + pick(m.n - lo);
    const auto cls = static_cast<MemoryClass>(pick(3));
    const bool keep = pick(2) == 0;
    // Bytes a sleep discarded cannot become state while asleep (Pool::mark): nothing changes.
    auto all_backed = [&] {
      const auto first = m.backed.begin() + static_cast<long>(lo);
      return std::all_of(first, first + static_cast<long>(len), [](bool b) { return b; });
    };
    if (m.level != 0 && cls == MemoryClass::state && !all_backed()) {
      EXPECT_THROW(pool_->mark(at(it->first, lo), len, cls, keep ? "keep.m" : "m"), invalid_state);
      return;
    }
    pool_->mark(at(it->first, lo), len, cls, keep ? "keep.m" : "m");
    for (std::size_t i = lo; i < lo + len; ++i) {
      m.cls[i] = cls;
      m.keep[i] = keep;
    }
  }

  void write_one() {
    if (model_.empty()) return;
    auto it = any();
    Modeled& m = it->second;
    if (m.level != 0) return;
    const std::size_t lo = pick(m.n), len = 1 + pick(m.n - lo);
    auto v = random_bytes(rng_, len);
    pool_->copy(at(it->first, lo), v.data(), len);
    std::copy(v.begin(), v.end(), m.bytes.begin() + static_cast<long>(lo));
  }

  // The model's side of a sleep of `level` that reached allocation m.
  static void model_sleep(Modeled& m, int level) {
    if (m.level == 0) {
      m.backed.assign(m.n, false);
      for (std::size_t i = 0; i < m.n; ++i) m.backed[i] = survives(m.cls[i], m.keep[i], level);
      m.level = level;
    } else if (m.level < level) {  // deepening uses the classes as they are now
      for (std::size_t i = 0; i < m.n; ++i) m.backed[i] = m.backed[i] && survives(m.cls[i], m.keep[i], level);
      m.level = level;
    }
  }

  void sleep_some() {
    const int level = static_cast<int>(pick(3));
    const auto tags = random_tags();
    // A fault only where the sleep has work: one that finds its tags asleep copies nothing.
    if (level > 0 && any_selected(tags, false) && pick(3) == 0) {
      const DriverCall kinds[] = {DriverCall::copy, DriverCall::copy, DriverCall::host_alloc, DriverCall::fill};
      faulty_.fail_nth(kinds[pick(4)], 1 + pick(3), pick(2) ? driver_status::unknown : driver_status::out_of_memory);
    }
    try {
      pool_->sleep(level, tags);
    } catch (const std::exception& e) {
      faulty_.clear();
      failed_sleep(level, tags, e);
      return;
    }
    faulty_.clear();
    ++tally.sleeps;
    if (level == 0) return;
    for (auto& [t, a] : asleep_)
      if (selected(tags, t)) a = true;
    for (auto& [p, m] : model_)
      if (selected(tags, m.tag)) model_sleep(m, level);
  }

  // A failed sleep left each chunk awake with its bytes or asleep with its backup (pool.hpp): a
  // wake of the same tags brings every tag back, and each byte a completed sleep would have
  // discarded is either its old value or poison.
  void failed_sleep(int level, const std::vector<std::string>& tags, const std::exception& e) {
    ++tally.failed_sleeps;
    const bool typed = dynamic_cast<const out_of_memory*>(&e) != nullptr ||
                       dynamic_cast<const driver_error*>(&e) != nullptr || dynamic_cast<const error*>(&e) != nullptr;
    EXPECT_TRUE(typed) << "an untyped error from a failed sleep: " << e.what();
    for (auto& [p, m] : model_) {
      if (!selected(tags, m.tag) || level == 0) continue;
      const std::vector<bool> before = m.level != 0 ? m.backed : std::vector<bool>(m.n, true);
      model_sleep(m, level);  // the stricter outcome; an unsure byte accepts either at the check
      for (std::size_t i = 0; i < m.n; ++i)
        if (before[i] && !m.backed[i]) m.unsure[i] = true;
    }
    ASSERT_NO_THROW(pool_->wake_up(tags)) << "a wake after a failed sleep (" << e.what() << ")";
    wake_model(tags);
    for (auto& [t, a] : asleep_) {
      if (!selected(tags, t)) continue;
      EXPECT_FALSE(pool_->asleep(t)) << "tag '" << t << "' stays asleep after a failed sleep and a wake";
      void* probe = nullptr;
      EXPECT_NO_THROW(probe = pool_->allocate(4096, {t, MemoryClass::state, "probe"})) << "tag '" << t << "'";
      if (probe) pool_->deallocate(probe);
    }
  }

  void wake_some() {
    const auto tags = random_tags();
    if (any_selected(tags, true) && pick(3) == 0) {
      const DriverCall kinds[] = {DriverCall::copy, DriverCall::create, DriverCall::map, DriverCall::fill};
      faulty_.fail_nth(kinds[pick(4)], 1 + pick(3), pick(2) ? driver_status::unknown : driver_status::out_of_memory);
    }
    try {
      pool_->wake_up(tags);
    } catch (const std::exception& e) {
      faulty_.clear();
      ++tally.failed_wakes;
      // The chunks that did not wake keep their backups: a second wake completes it.
      ASSERT_NO_THROW(pool_->wake_up(tags)) << "a wake after a failed wake (" << e.what() << ")";
    }
    faulty_.clear();
    ++tally.wakes;
    wake_model(tags);
  }

  void wake_model(const std::vector<std::string>& tags) {
    for (auto& [t, a] : asleep_)
      if (selected(tags, t)) a = false;
    for (auto& [p, m] : model_)
      if (selected(tags, m.tag) && m.level != 0) settle_awake(p, m);
  }

  // Applies the wake to the model and compares every byte; counts the ones that differ.
  void settle_awake(void* p, Modeled& m) {
    auto info = pool_->find(p);
    ASSERT_TRUE(info) << "a live allocation is not found";
    ASSERT_EQ(info->base, reinterpret_cast<device_ptr>(p)) << "an address moved";
    ASSERT_FALSE(info->asleep);
    const auto actual = read(*pool_, p, m.n);
    std::size_t lost = 0;
    for (std::size_t i = 0; i < m.n; ++i) {
      const bool discarded = m.level != 0 && !m.backed[i];
      const std::uint8_t want = discarded ? poison_byte : m.bytes[i];
      const bool ok = actual[i] == want || (m.unsure[i] && (actual[i] == poison_byte || actual[i] == m.bytes[i]));
      if (!ok) ++lost;
      m.bytes[i] = actual[i] == want || !m.unsure[i] ? want : actual[i];  // an unsure byte is what it became
      m.unsure[i] = false;
    }
    m.level = 0;
    tally.bytes_checked += m.n;
    tally.bytes_lost += lost;
    EXPECT_EQ(lost, 0u) << lost << " of " << m.n << " bytes differ from the model (tag " << m.tag << ")";
  }

  // A child wakes everything, checks it against the model and destroys its copy of the pool, as
  // a normal exit of a forked worker does; the parent's bytes must not notice. (The child does not
  // write: the host backend's device memory is shared with the child, a GPU's is not reachable.)
  void fork_and_check() {
    ++tally.forks;
    std::fflush(nullptr);
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::alarm(60);
      int rc = 0;
      try {
        pool_->wake_up();
        for (auto& [p, m] : model_) {
          const auto actual = read(*pool_, p, m.n);
          for (std::size_t i = 0; i < m.n; ++i) {
            const bool discarded = m.level != 0 && !m.backed[i];
            if (!m.unsure[i] && actual[i] != (discarded ? poison_byte : m.bytes[i])) rc = 10;
          }
        }
      } catch (const std::exception&) {
        rc = 11;
      }
      pool_.reset();
      ::_exit(rc);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status)) << "the forked child ended with status " << status;
    EXPECT_EQ(WEXITSTATUS(status), 0) << "the forked child saw other bytes than the model (10) or failed (11)";
  }

  Config config_;
  std::mt19937_64 rng_;
  HostDriver host_;
  FaultInjectingDriver faulty_;
  std::size_t g_ = 0;
  std::unique_ptr<Pool> pool_;
  std::map<void*, Modeled> model_;
  std::map<std::string, bool> asleep_;
  const std::vector<std::string> tag_names_ = {"weights", "kv_cache", "default", "extra"};
};

class DiskTierModel : public ::testing::TestWithParam<Config> {};

TEST_P(DiskTierModel, RandomSequencesLoseNoByte) {
  const Config c = GetParam();
  const int ops = ops_per_config();
  Tally total;
  const int seeds = 4;
  for (int seed = 1; seed <= seeds && !HasFatalFailure(); ++seed) {
    SCOPED_TRACE(::testing::Message() << describe(c) << ", seed " << seed);
    ScratchDir dir;
    const std::uint64_t mix = static_cast<std::uint64_t>(c.disk) * 31 + (c.skip_unchanged ? 17 : 0);
    ModelRun run(c, static_cast<std::uint64_t>(seed) * 7919 + mix, dir.path);
    run.run(std::max(1, ops / seeds));
    const Tally& t = run.tally;
    total.ops += t.ops;
    total.sleeps += t.sleeps;
    total.wakes += t.wakes;
    total.failed_sleeps += t.failed_sleeps;
    total.failed_wakes += t.failed_wakes;
    total.forks += t.forks;
    total.spilled += t.spilled;
    total.bytes_checked += t.bytes_checked;
    total.bytes_lost += t.bytes_lost;
  }
  std::printf("model: %s: %zu operations, %zu sleeps (%zu failed), %zu wakes (%zu failed and retried), %zu forks, "
              "%zu bytes checked, %zu bytes lost\n",
              describe(c).c_str(), total.ops, total.sleeps + total.failed_sleeps, total.failed_sleeps, total.wakes,
              total.failed_wakes, total.forks, total.bytes_checked, total.bytes_lost);
  EXPECT_EQ(total.bytes_lost, 0u);
  if (ops >= 400) {  // short runs (the sanitizer builds) may draw no failing fault
    EXPECT_GT(total.failed_sleeps, 0u) << "no sleep failed: the fault paths did not run";
    EXPECT_GT(total.failed_wakes, 0u) << "no wake failed: the fault paths did not run";
    EXPECT_GT(total.forks, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, DiskTierModel,
                         ::testing::Values(Config{Disk::off, true}, Config{Disk::off, false},
                                           Config{Disk::direct, true}, Config{Disk::direct, false},
                                           Config{Disk::buffered, true}, Config{Disk::buffered, false}),
                         [](const ::testing::TestParamInfo<Config>& i) {
                           std::string n = i.param.disk == Disk::off      ? "NoDisk"
                                           : i.param.disk == Disk::direct ? "DiskDirect"
                                                                          : "DiskBuffered";
                           return n + (i.param.skip_unchanged ? "SkipUnchanged" : "CopyAll");
                         });

}  // namespace
}  // namespace torpor::test
