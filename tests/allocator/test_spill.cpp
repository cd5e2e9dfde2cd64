// The disk tier: backups beyond the host limit in a spill file, bit-exact through sleep levels,
// skipped copies and split backups; crash-safe naming and stale-file cleanup; a spill limit and
// a file-size limit that fill up mid-sleep (clear error, nothing lost, a retry works); forks and exits.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <set>
#include <string>

#include "pool/store/host_store.hpp"
#include "pool/store/spill_store.hpp"
#include "support/backends.hpp"
#include "torpor/error.hpp"
#include "torpor/host_driver.hpp"
#include "torpor/testing/spill_faults.hpp"

namespace torpor::test {
namespace {

constexpr std::size_t KiB = std::size_t{1} << 10;
constexpr std::size_t MiB = std::size_t{1} << 20;

// Runs f in a forked child and returns its exit status (128 + the signal that ended it). Not a
// death test: gtest's threadsafe style re-runs the test in the child, which would make its own
// TempDir and leave it behind when it exits.
int exit_status_of_child(const std::function<int()>& f) {
  std::fflush(nullptr);
  pid_t pid = ::fork();
  if (pid < 0) return -1;
  if (pid == 0) ::_exit(f());
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// A fresh directory under the test's temporary directory, removed with its files at the end.
struct TempDir {
  TempDir() {
    std::string base = ::testing::TempDir();
    if (base.empty() || base.back() != '/') base += '/';
    std::string tmpl = base + "torpor-spill-test-XXXXXX";
    EXPECT_NE(::mkdtemp(tmpl.data()), nullptr);
    path = tmpl;
  }
  ~TempDir() {
    for (const auto& f : files())  // files, and the empty directories some tests make in it
      if (::unlink((path + "/" + f).c_str()) != 0) ::rmdir((path + "/" + f).c_str());
    ::rmdir(path.c_str());
  }
  std::set<std::string> files() const {
    std::set<std::string> out;
    if (DIR* d = ::opendir(path.c_str())) {
      while (dirent* e = ::readdir(d))
        if (std::string(e->d_name) != "." && std::string(e->d_name) != "..") out.insert(e->d_name);
      ::closedir(d);
    }
    return out;
  }
  void touch(const std::string& name) const {
    int fd = ::open((path + "/" + name).c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
    EXPECT_GE(fd, 0);
    ::close(fd);
  }
  std::string path;
};

template <typename B>
class SpillTest : public BackendTest<B> {
 protected:
  struct Item {
    void* p;
    std::vector<std::uint8_t> bytes;
  };
  PoolOptions spilling(const std::string& dir, std::size_t host_limit) {
    PoolOptions o = this->tiered_pool(FillOnWake::poison);
    o.host_store_limit = host_limit;
    o.spill_dir = dir;
    o.staging_slots = 3;
    o.staging_slot_bytes = 64 * KiB;
    o.copy_piece_bytes = 300000;
    return o;
  }
  Item make(Pool& pool, const std::string& tag, std::size_t n, MemoryClass cls, const std::string& name,
            std::mt19937_64& rng) {
    Item it{pool.allocate(n, {tag, cls, name}), random_bytes(rng, n)};
    write(pool, it.p, it.bytes);
    return it;
  }
  // Sizes on either side of pieces, slots, pages and granules.
  std::vector<Item> items(Pool& pool, std::mt19937_64& rng) {
    std::size_t g = this->granularity();
    std::vector<Item> out;
    int i = 0;
    for (std::size_t n : {std::size_t{777}, std::size_t{4096}, 64 * KiB + 1, g - 1, g + 4097, 3 * g + 300001}) {
      out.push_back(make(pool, "weights", n, MemoryClass::state, "s" + std::to_string(i), rng));
      out.push_back(make(pool, "weights", n + 13, MemoryClass::parameter, "p" + std::to_string(i++), rng));
    }
    return out;
  }
  static bool all_poison(const std::vector<std::uint8_t>& v) {
    return std::all_of(v.begin(), v.end(), [](std::uint8_t b) { return b == poison_byte; });
  }
};
TYPED_TEST_SUITE(SpillTest, Backends, BackendNames);

TYPED_TEST(SpillTest, EveryBackupOnDiskComesBackBitExact) {
  TempDir dir;
  {
    Pool pool(this->driver(), this->spilling(dir.path, 1));  // below 2 MiB: nothing page-locked
    std::mt19937_64 rng(11);
    auto items = this->items(pool, rng);
    void* cache = pool.allocate(3 * this->granularity(), {"kv_cache", MemoryClass::cache, ""});
    PoolStats st = pool.stats();
    std::string prefix = dir.path + "/" + SpillStore::file_prefix + std::to_string(::getpid()) + "-";
    EXPECT_EQ(st.spill_path.rfind(prefix, 0), 0u) << st.spill_path;
    EXPECT_EQ(st.spill_path.substr(st.spill_path.size() - 4), ".bin");
    EXPECT_EQ(dir.files().size(), 1u);
    for (int cycle = 0; cycle < 4; ++cycle) {
      int level = cycle == 2 ? 2 : 1;
      if (cycle != 1)  // cycle 1 sleeps unchanged: the retained copies on disk are reused
        for (auto& it : items) {
          for (auto& b : it.bytes) b = static_cast<std::uint8_t>(b * 29 + 3);
          write(pool, it.p, it.bytes);
        }
      TransitionReport r = pool.sleep(level);
      SCOPED_TRACE(::testing::Message() << "cycle " << cycle << " level " << level);
      EXPECT_EQ(r.bytes_spilled, r.bytes_offloaded) << "every copy went to disk";
      if (cycle == 1) EXPECT_EQ(r.bytes_offloaded, 0u);
      st = pool.stats();
      EXPECT_GT(st.spill_used_bytes, 0u);
      EXPECT_EQ(st.host_store_used_bytes, 0u);
      EXPECT_EQ(st.host_store_pinned_bytes + st.host_store_pinning_bytes, 0u);
      TransitionReport w = pool.wake_up();
      EXPECT_EQ(w.bytes_spilled, w.bytes_restored);
      for (std::size_t i = 0; i < items.size(); ++i) {
        bool discarded = level == 2 && i % 2 == 1;  // odd items are parameters
        auto back = read(pool, items[i].p, items[i].bytes.size());
        if (discarded)
          EXPECT_TRUE(this->all_poison(back)) << "item " << i;
        else
          ASSERT_EQ(back, items[i].bytes) << "item " << i;
      }
      if (level == 2)
        for (std::size_t i = 1; i < items.size(); i += 2) write(pool, items[i].p, items[i].bytes);  // reload
    }
    pool.deallocate(cache);
    EXPECT_GT(pool.release_host_store(), 0u);
    EXPECT_EQ(pool.stats().spill_bytes, 0u);
  }
  EXPECT_TRUE(dir.files().empty()) << "the pool removes its spill file";
}

TYPED_TEST(SpillTest, PinnedFirstThenDisk) {
  TempDir dir;
  std::size_t limit = 2 * MiB;
  Pool pool(this->driver(), this->spilling(dir.path, limit));
  std::mt19937_64 rng(12);
  std::vector<typename TestFixture::Item> items;
  std::size_t total = 0;
  for (int i = 0; total < 3 * limit; ++i) {
    items.push_back(this->make(pool, "weights", this->granularity() + 777 * i, MemoryClass::state, "s", rng));
    total += items.back().bytes.size();
  }
  TransitionReport r = pool.sleep(1);
  EXPECT_EQ(r.bytes_offloaded, total);
  EXPECT_GT(r.bytes_spilled, 0u);
  EXPECT_LT(r.bytes_spilled, total) << "what fits under the limit stays in page-locked memory";
  PoolStats st = pool.stats();
  EXPECT_LE(st.host_store_pinned_bytes + st.host_store_pinning_bytes, limit);
  EXPECT_EQ(st.host_store_pageable_bytes, 0u) << "beyond the limit: disk, not pageable memory";
  pool.wake_up();
  for (auto& it : items) ASSERT_EQ(read(pool, it.p, it.bytes.size()), it.bytes);
}

TYPED_TEST(SpillTest, ABackupSplitByAFreeIsReadBackFromAnUnalignedOffset) {
  TempDir dir;
  Pool pool(this->driver(), this->spilling(dir.path, 1));
  std::mt19937_64 rng(13);
  // Three small allocations side by side in one slab: one run, one piece, one disk span.
  auto a = this->make(pool, "weights", 1000, MemoryClass::state, "a", rng);
  auto b = this->make(pool, "weights", 1000, MemoryClass::state, "b", rng);
  auto c = this->make(pool, "weights", 5000, MemoryClass::state, "c", rng);
  ASSERT_EQ(pool.chunk_info(a.p)->va, pool.chunk_info(c.p)->va);
  pool.sleep(1);
  ASSERT_GT(pool.stats().spill_bytes, 0u) << "the backups are on disk";
  pool.deallocate(a.p);  // the backup is cut: b's part now starts 1 KiB into the span
  // Read the backups through read_host_copy (what torpor.tms.get_cpu_backup uses) from every start
  // offset of 4097 consecutive ones in c: whatever file offset c's copy starts at, all but one of
  // these reads start off the direct-I/O alignment, so the bytes must be moved into place.
  static_assert(SpillStore::alignment == 4096);
  std::vector<std::uint8_t> out(5000);
  const std::uint64_t unaligned_before = SpillFaults::unaligned_reads();
  for (std::size_t k = 0; k <= SpillStore::alignment; ++k) {
    std::size_t n = k % 3 == 0 ? 5000 - k : 1 + k % 97;
    HostCopyRead r = pool.read_host_copy(static_cast<std::uint8_t*>(c.p) + k, n, out.data());
    ASSERT_TRUE(r.copied && r.asleep) << "offset " << k;
    ASSERT_TRUE(std::equal(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(n), c.bytes.begin() + k))
        << "c read from offset " << k << ", " << n << " bytes";
  }
  EXPECT_GE(SpillFaults::unaligned_reads() - unaligned_before, SpillStore::alignment - 1)
      << "every read but the aligned one starts off the alignment and moves the bytes into place";
  for (std::size_t k = 0; k < 1000; k += 7) {
    HostCopyRead r = pool.read_host_copy(static_cast<std::uint8_t*>(b.p) + k, 1000 - k, out.data());
    ASSERT_TRUE(r.copied) << "offset " << k;
    ASSERT_TRUE(std::equal(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(1000 - k), b.bytes.begin() + k))
        << "b read from offset " << k;
  }
  pool.wake_up();
  EXPECT_EQ(read(pool, b.p, 1000), b.bytes);
  EXPECT_EQ(read(pool, c.p, 5000), c.bytes);
}

// Issue 33 N1: a retained copy on disk cut by a free starts off the direct-I/O alignment; the next
// sleep that rewrote it there rounded its write up past its own extent, over the bytes another tag
// keeps in the next extent of the file. The other tag's bytes are the oracle: written once, never
// touched again, compared after every wake.
TYPED_TEST(SpillTest, ACopyCutByAFreeIsNeverRewrittenOverAnotherTagsBytes) {
  TempDir dir;
  PoolOptions o = this->spilling(dir.path, 1);
  ASSERT_TRUE(o.skip_unchanged) << "the default: copies are retained after wake";
  Pool pool(this->driver(), o);
  std::mt19937_64 rng(33);
  // Other tags' copies on both sides of w's in the file (spans are given out in address order).
  std::vector<typename TestFixture::Item> victims;
  for (int i = 0; i < 3; ++i) victims.push_back(this->make(pool, "u", 9000 + 1000 * i, MemoryClass::state, "u", rng));
  // Sizes that fill their footprints: the three are one run, one piece, one span on disk.
  auto a = this->make(pool, "w", 1024, MemoryClass::state, "a", rng);
  auto b = this->make(pool, "w", 1024, MemoryClass::state, "b", rng);
  auto c = this->make(pool, "w", 5120, MemoryClass::state, "c", rng);
  for (int i = 0; i < 3; ++i) victims.push_back(this->make(pool, "v", 9000 + 1000 * i, MemoryClass::state, "v", rng));
  pool.sleep(1);
  ASSERT_GT(pool.stats().spill_used_bytes, 0u);
  pool.wake_up();
  pool.deallocate(a.p);  // w's retained copy is cut 1 KiB in
  for (int cycle = 0; cycle < 3; ++cycle) {
    SCOPED_TRACE(::testing::Message() << "cycle " << cycle);
    for (auto* it : {&b, &c}) {
      for (auto& x : it->bytes) x = static_cast<std::uint8_t>(x * 13 + 5);
      write(pool, it->p, it->bytes);
    }
    pool.sleep(cycle == 1 ? 2 : 1);
    pool.wake_up();
    EXPECT_EQ(read(pool, b.p, b.bytes.size()), b.bytes);
    EXPECT_EQ(read(pool, c.p, c.bytes.size()), c.bytes);
    for (std::size_t i = 0; i < victims.size(); ++i)
      ASSERT_EQ(read(pool, victims[i].p, victims[i].bytes.size()), victims[i].bytes) << "other tag, item " << i;
  }
}

// Issue 33 N1, second route: a deeper sleep cuts the parameters out of each backup on disk; after the
// wake the state pieces are retained copies at unaligned file offsets, and the next level-2 sleep
// rewrites them. Every state byte of every tag comes back, cycle after cycle.
TYPED_TEST(SpillTest, DeepeningCutsBackupsAndTheNextSleepsLoseNoStateByte) {
  TempDir dir;
  Pool pool(this->driver(), this->spilling(dir.path, 1));
  std::mt19937_64 rng(34);
  struct Marked {
    typename TestFixture::Item item;
    std::size_t param_lo, param_hi;
  };
  std::vector<Marked> all;
  for (int i = 0; i < 6; ++i) {
    std::size_t n = 6000 + 1500 * i;
    auto it = this->make(pool, i % 2 ? "x" : "y", n, MemoryClass::state, "m" + std::to_string(i), rng);
    std::size_t lo = 700 + 300 * i, hi = lo + 1100 + 200 * i;
    pool.mark(static_cast<std::uint8_t*>(it.p) + lo, hi - lo, MemoryClass::parameter);
    all.push_back({it, lo, hi});
  }
  auto check = [&](bool params_back) {
    for (std::size_t i = 0; i < all.size(); ++i) {
      auto back = read(pool, all[i].item.p, all[i].item.bytes.size());
      for (std::size_t k = 0; k < back.size(); ++k) {
        bool param = k >= all[i].param_lo && k < all[i].param_hi;
        if (param && !params_back) continue;
        ASSERT_EQ(back[k], all[i].item.bytes[k]) << "item " << i << " byte " << k << (param ? " (parameter)" : "");
      }
    }
  };
  pool.sleep(1);
  pool.sleep(2);  // deepen: the parameters' parts of the backups go
  pool.wake_up();
  check(false);
  for (int cycle = 0; cycle < 3; ++cycle) {
    SCOPED_TRACE(::testing::Message() << "cycle " << cycle);
    for (std::size_t i = 0; i < all.size(); ++i) {
      if ((i + cycle) % 2 == 0)  // half change, half are skipped as unchanged
        for (auto& x : all[i].item.bytes) x = static_cast<std::uint8_t>(x * 7 + 1);
      write(pool, all[i].item.p, all[i].item.bytes);  // parameters reloaded too
    }
    pool.sleep(2);
    pool.wake_up();
    check(false);
  }
}

// Issue 33 N13: the spill file changed while the pool slept (one byte, then every byte). The wake
// must not hand back changed bytes as if they were the saved ones: each copy whose bytes changed is
// reported, naming the spill file, and holds the poison pattern; every other comes back exact.
// With skip_unchanged on and off (off, the sleep hashes only what goes to disk).
TYPED_TEST(SpillTest, ASpillFileChangedWhileAsleepIsReportedAtWakeNotRestored) {
  for (bool skip : {true, false})
    for (bool every_byte : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "skip_unchanged " << skip << ", " << (every_byte ? "every byte" : "one byte")
                                        << " changed");
      TempDir dir;
      PoolOptions o = this->spilling(dir.path, 1);
      o.skip_unchanged = skip;
      Pool pool(this->driver(), o);
      std::mt19937_64 rng(36);
      std::vector<typename TestFixture::Item> items;
      for (int i = 0; i < 5; ++i)
        items.push_back(this->make(pool, "w", 20000 + 7000 * i, MemoryClass::state, "i" + std::to_string(i), rng));
      pool.sleep(1);
      const std::string path = pool.stats().spill_path;
      {
        int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
        ASSERT_GE(fd, 0) << path;
        struct stat st {};
        ASSERT_EQ(::fstat(fd, &st), 0);
        std::vector<std::uint8_t> file(static_cast<std::size_t>(st.st_size));
        ASSERT_EQ(::pread(fd, file.data(), file.size(), 0), static_cast<ssize_t>(file.size()));
        if (every_byte)
          for (auto& x : file) x = static_cast<std::uint8_t>(~x);
        else
          file[100] = static_cast<std::uint8_t>(~file[100]);
        ASSERT_EQ(::pwrite(fd, file.data(), file.size(), 0), static_cast<ssize_t>(file.size()));
        ::close(fd);
      }
      std::string what;
      try {
        pool.wake_up();
      } catch (const error& e) {
        what = e.what();
      }
      ASSERT_FALSE(what.empty()) << "the wake must fail";
      EXPECT_NE(what.find(path), std::string::npos) << what;
      std::size_t poisoned = 0;
      for (std::size_t i = 0; i < items.size(); ++i) {
        auto back = read(pool, items[i].p, items[i].bytes.size());
        if (back == items[i].bytes) continue;
        EXPECT_TRUE(this->all_poison(back)) << "item " << i << " came back changed, not poisoned";
        ++poisoned;
      }
      EXPECT_EQ(poisoned, every_byte ? items.size() : 1u);
      EXPECT_NE(what.find(std::to_string(poisoned) + " host cop"), std::string::npos) << what;
      // The pool goes on: the next cycle keeps every byte.
      for (auto& it : items) write(pool, it.p, it.bytes);
      pool.sleep(1);
      pool.wake_up();
      for (std::size_t i = 0; i < items.size(); ++i)
        ASSERT_EQ(read(pool, items[i].p, items[i].bytes.size()), items[i].bytes);
    }
}

// The spill file read at offsets and lengths off the alignment (the window around them is read and
// the bytes moved into place), against the bytes written.
TEST(Spill, ReadsAtUnalignedOffsetsReturnTheBytesWritten) {
  TempDir dir;
  SpillStore store(dir.path, 0);
  constexpr std::size_t n = 4 * SpillStore::alignment;
  std::uint64_t off = store.allocate(n);
  ASSERT_EQ(off % SpillStore::alignment, 0u);
  std::mt19937_64 rng(5);
  std::vector<std::uint8_t> bytes = random_bytes(rng, n);
  auto* buf = static_cast<std::byte*>(std::aligned_alloc(SpillStore::alignment, n + 2 * SpillStore::alignment));
  ASSERT_NE(buf, nullptr);
  std::memcpy(buf, bytes.data(), n);
  store.write(off, buf, n);
  for (std::size_t from : {std::size_t{1}, std::size_t{100}, std::size_t{4095}, std::size_t{4097}, std::size_t{9000}}) {
    for (std::size_t len : {std::size_t{1}, std::size_t{3000}, n - from}) {
      if (from + len > n) continue;
      std::memset(buf, 0, n + 2 * SpillStore::alignment);
      store.read(off + from, buf, len);
      EXPECT_EQ(std::memcmp(buf, bytes.data() + from, len), 0) << "from " << from << ", " << len << " bytes";
    }
  }
  EXPECT_GT(SpillFaults::unaligned_reads(), 0u);
  std::free(buf);
  store.free(off, n);
}

TYPED_TEST(SpillTest, ASpillLimitIsAClearErrorThatLosesNothingAndARetryWorks) {
  TempDir probe_dir, dir;
  // Each tag needs more than the slack of the disk block "a" grows (under a block rounding plus
  // a page per piece), so "b" cannot fit in what "a" holds.
  const std::size_t item_bytes = std::max(2 * this->granularity(), 3 * MiB / 2) + 100;
  auto build = [&](Pool& pool, std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<typename TestFixture::Item> v;
    for (const char* tag : {"a", "b"})
      for (int i = 0; i < 2; ++i) v.push_back(this->make(pool, tag, item_bytes, MemoryClass::state, "x", rng));
    return v;
  };
  // What tag "a" alone takes on disk, measured without a limit.
  std::size_t a_disk = 0;
  {
    Pool pool(this->driver(), this->spilling(probe_dir.path, 1));
    build(pool, 1);
    pool.sleep(1, {"a"});
    a_disk = pool.stats().spill_bytes;
  }
  ASSERT_GT(a_disk, 0u);
  PoolOptions o = this->spilling(dir.path, 1);
  o.spill_limit = a_disk;  // room for "a", none for "b"
  Pool pool(this->driver(), o);
  auto items = build(pool, 1);
  pool.sleep(1, {"a"});
  try {
    pool.sleep(1, {"b"});
    FAIL() << "the spill limit must refuse tag b";
  } catch (const out_of_memory& e) {
    EXPECT_NE(std::string(e.what()).find("spill limit"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(pool.asleep("b"));
  for (int i = 2; i < 4; ++i) {
    EXPECT_FALSE(pool.find(items[i].p)->asleep);
    EXPECT_EQ(read(pool, items[i].p, items[i].bytes.size()), items[i].bytes) << "b keeps its bytes";
  }
  EXPECT_EQ(pool.stats().spill_bytes, a_disk) << "nothing of the failed sleep is held";
  // Free the disk: wake "a" and give its retained copies (on disk too) back.
  pool.wake_up({"a"});
  pool.release_host_store();
  pool.sleep(1, {"b"});  // the retry works
  pool.wake_up();
  for (auto& it : items) EXPECT_EQ(read(pool, it.p, it.bytes.size()), it.bytes);
}

// A read of the disk tier that fails at wake (the spill file cut short under the pool): the wake is
// a typed error, the chunks it could not restore stay asleep with their backups, nothing leaks;
// once the file reads again the retry wakes every byte.
TYPED_TEST(SpillTest, AFailedDiskReadAtWakeKeepsTheBackupsAndARetryWorks) {
  TempDir dir;
  Pool pool(this->driver(), this->spilling(dir.path, 1));
  std::mt19937_64 rng(19);
  auto items = this->items(pool, rng);
  pool.sleep(1);
  const std::string path = pool.stats().spill_path;
  std::vector<char> saved;
  {
    std::ifstream in(path, std::ios::binary);
    saved.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  ASSERT_GT(saved.size(), 0u);
  ASSERT_EQ(::truncate(path.c_str(), 0), 0);
  try {
    pool.wake_up();
    FAIL() << "a wake from a spill file cut short must fail";
  } catch (const error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  EXPECT_TRUE(pool.asleep("weights"));
  std::size_t asleep = 0;
  for (auto& it : items) {
    if (pool.find(it.p)->asleep) {
      ++asleep;
      continue;
    }
    EXPECT_EQ(read(pool, it.p, it.bytes.size()), it.bytes) << "a chunk that woke holds its bytes";
  }
  EXPECT_GT(asleep, 0u);
  if (HostDriver* h = this->host()) EXPECT_EQ(h->live_physical_bytes(0), pool.stats().mapped_bytes);
  {
    int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::pwrite(fd, saved.data(), saved.size(), 0), static_cast<ssize_t>(saved.size()));
    ::close(fd);
  }
  pool.wake_up();
  for (auto& it : items) EXPECT_EQ(read(pool, it.p, it.bytes.size()), it.bytes);
}

// A small tmpfs mounted for one test (needs root and mount permission; where CI cannot make
// one the test says so and skips). Unmounted, lazily, at the end.
struct SmallFileSystem {
  explicit SmallFileSystem(std::size_t bytes) {
    if (::geteuid() != 0) {
      why_not = "not root: cannot mount a small tmpfs";
      return;
    }
    std::string opts = "size=" + std::to_string(bytes) + ",mode=0700";
    if (::mount("tmpfs", dir.path.c_str(), "tmpfs", 0, opts.c_str()) != 0) {
      why_not = std::string("mount tmpfs: ") + std::strerror(errno);
      return;
    }
    mounted = true;
  }
  ~SmallFileSystem() {
    if (mounted) ::umount2(dir.path.c_str(), MNT_DETACH);
  }
  TempDir dir;
  bool mounted = false;
  std::string why_not;
};

// A real full disk (ENOSPC from a tmpfs that is too small, not a simulated limit): the sleep of
// the tag that does not fit is out_of_memory naming the cause, its bytes stay in device memory,
// and a tag that fits sleeps and wakes bit-exact on the same file system.
TYPED_TEST(SpillTest, ARealFullDiskIsOutOfMemoryAndLosesNothing) {
  SmallFileSystem fs(4 * MiB);
  if (!fs.mounted) GTEST_SKIP() << fs.why_not;
  Pool pool(this->driver(), this->spilling(fs.dir.path, 1));
  std::mt19937_64 rng(17);
  auto small = this->make(pool, "a", MiB, MemoryClass::state, "small", rng);
  auto big = this->make(pool, "b", 12 * MiB, MemoryClass::state, "big", rng);
  try {
    pool.sleep(1, {"b"});
    FAIL() << "12 MiB cannot spill to a 4 MiB file system";
  } catch (const out_of_memory& e) {
    EXPECT_NE(std::string(e.what()).find(std::strerror(ENOSPC)), std::string::npos) << e.what();
  }
  EXPECT_FALSE(pool.asleep("b"));
  EXPECT_FALSE(pool.find(big.p)->asleep);
  EXPECT_EQ(read(pool, big.p, big.bytes.size()), big.bytes) << "b keeps its bytes";
  EXPECT_EQ(pool.stats().spill_bytes, 0u) << "nothing of the failed sleep is held";
  pool.sleep(1, {"a"});  // what fits still goes to disk
  EXPECT_GT(pool.stats().spill_bytes, 0u);
  pool.wake_up();
  EXPECT_EQ(read(pool, small.p, small.bytes.size()), small.bytes);
  EXPECT_EQ(read(pool, big.p, big.bytes.size()), big.bytes);
}

// Clears the selected spill faults however the test ends.
struct SpillFaultScope {
  SpillFaultScope() { SpillFaults::clear(); }
  ~SpillFaultScope() { SpillFaults::clear(); }
};

// ENOSPC (and EDQUOT) where no small file system can be mounted: the spill store's fallocate or
// pwrite returns it, at every position a clean sleep of tag "b" makes that call, in a first sleep
// and at level 2 in a later cycle (retained copies of "a" on disk). Each time: out_of_memory
// naming the cause, "b" awake with every byte, nothing of the failed sleep held on disk, a new
// allocation into "b" works; once the disk has room the same sleep and a wake are bit-exact.
TYPED_TEST(SpillTest, ADiskFullAtAnyClaimOrWriteIsOutOfMemoryThatLosesNothing) {
  SpillFaultScope scope;
  struct Case {
    SpillCall call;
    int err;
    bool later_cycle;
  };
  const Case cases[] = {{SpillCall::fallocate, ENOSPC, false},
                        {SpillCall::pwrite, ENOSPC, false},
                        {SpillCall::pwrite, EDQUOT, false},
                        {SpillCall::pwrite, ENOSPC, true}};  // (later: the disk blocks held have room)
  std::size_t tried = 0;
  for (const Case& c : cases) {
    auto setup = [&](Pool& pool, std::vector<typename TestFixture::Item>& a,
                     std::vector<typename TestFixture::Item>& b) {
      std::mt19937_64 rng(23);
      std::size_t g = this->granularity();
      for (std::size_t n : {std::size_t{5000}, g + 4097, 2 * g + 300001})
        a.push_back(this->make(pool, "a", n, MemoryClass::state, "a", rng));
      // More than the slack of the disk block "a" grew, so "b" claims disk space of its own.
      for (std::size_t n : {std::size_t{777}, g - 1, 3 * g + 13, HostStore::block_rounding + 5}) {
        b.push_back(this->make(pool, "b", n, MemoryClass::state, "s", rng));
        b.push_back(this->make(pool, "b", n + 3, MemoryClass::parameter, "p", rng));
      }
      pool.sleep(1, {"a"});
      if (c.later_cycle) {  // a first cycle of "b", then new bytes: the next sleep writes again
        pool.sleep(1, {"b"});
        pool.wake_up({"b"});
        for (auto& it : b) {
          it.bytes = random_bytes(rng, it.bytes.size());
          write(pool, it.p, it.bytes);
        }
        // and more of it than the retained copies hold: the next sleep claims disk again.
        b.push_back(this->make(pool, "b", HostStore::block_rounding + 9, MemoryClass::state, "s2", rng));
        b.push_back(this->make(pool, "b", 4 * g, MemoryClass::parameter, "p2", rng));
      }
    };
    SCOPED_TRACE(::testing::Message() << "call " << static_cast<int>(c.call) << ", " << std::strerror(c.err)
                                      << (c.later_cycle ? ", level 2 in a later cycle" : ", first sleep"));
    const int level = c.later_cycle ? 2 : 1;
    std::uint64_t count = 0;
    {
      TempDir dir;
      Pool pool(this->driver(), this->spilling(dir.path, 1));
      std::vector<typename TestFixture::Item> a, b;
      setup(pool, a, b);
      std::uint64_t before = SpillFaults::calls(c.call);
      pool.sleep(level, {"b"});
      count = SpillFaults::calls(c.call) - before;
    }
    ASSERT_GT(count, 0u) << "a clean sleep of b makes this call";
    for (std::uint64_t k = 0; k < count; k += std::max<std::uint64_t>(1, count / 6)) {
      SCOPED_TRACE(::testing::Message() << "call " << static_cast<int>(c.call) << " #" << k + 1 << " of " << count
                                        << " fails with " << std::strerror(c.err)
                                        << (c.later_cycle ? ", level 2 in a later cycle" : ", first sleep"));
      ++tried;
      TempDir dir;
      Pool pool(this->driver(), this->spilling(dir.path, 1));
      std::vector<typename TestFixture::Item> a, b;
      setup(pool, a, b);
      const std::size_t held = pool.stats().spill_used_bytes;
      SpillFaults::fail(c.call, c.err, k);
      try {
        pool.sleep(level, {"b"});
        ADD_FAILURE() << "a full disk must fail the sleep";
      } catch (const out_of_memory& e) {
        EXPECT_NE(std::string(e.what()).find(std::strerror(c.err)), std::string::npos) << e.what();
      }
      EXPECT_GT(SpillFaults::failures(), 0u);
      SpillFaults::clear();
      // A chunk whose bytes reached the disk before the failure stays asleep (the sleep stopped
      // there); every other one is awake with its bytes, and the tag is asleep exactly when one
      // of its chunks is.
      EXPECT_TRUE(pool.asleep("a"));
      std::size_t b_asleep = 0;
      for (auto& it : b) {
        if (pool.find(it.p)->asleep) {
          ++b_asleep;
          continue;
        }
        ASSERT_EQ(read(pool, it.p, it.bytes.size()), it.bytes) << "b keeps its bytes";
      }
      EXPECT_EQ(pool.asleep("b"), b_asleep > 0);
      if (c.call == SpillCall::fallocate && !c.later_cycle && k == 0)
        EXPECT_EQ(b_asleep, 0u) << "the first claim of disk fails before any byte moves";
      PoolStats st = pool.stats();
      EXPECT_EQ(st.host_store_used_bytes + st.spill_used_bytes, st.host_copies_bytes)
          << "the disk holds the backups and retained copies, nothing of the failed part of the sleep";
      if (b_asleep == 0 && !c.later_cycle) EXPECT_EQ(st.spill_used_bytes, held) << "nothing of b on disk";
      if (b_asleep == 0) {
        void* probe = nullptr;
        EXPECT_NO_THROW(probe = pool.allocate(100, {"b", MemoryClass::state, "probe"})) << "b is awake";
        if (probe != nullptr) pool.deallocate(probe);
      }
      if (HostDriver* h = this->host()) EXPECT_EQ(h->live_physical_bytes(0), pool.stats().mapped_bytes);
      pool.sleep(level, {"b"});  // the disk has room again
      pool.wake_up();
      for (auto& it : a) EXPECT_EQ(read(pool, it.p, it.bytes.size()), it.bytes);
      for (std::size_t i = 0; i < b.size(); ++i) {
        auto v = read(pool, b[i].p, b[i].bytes.size());
        if (level == 2 && i % 2 == 1)  // the parameters, discarded at level 2
          EXPECT_TRUE(this->all_poison(v)) << "b item " << i;
        else
          EXPECT_EQ(v, b[i].bytes) << "b item " << i;
      }
      if (::testing::Test::HasFailure()) return;
    }
  }
  EXPECT_GE(tried, 4u);
}

// A read of the disk tier that fails at wake (EIO from pread, at several positions): the wake is a
// typed error naming the file, what did not come back stays asleep with its backup, every tag
// that woke is awake and takes allocations; the retry wakes every byte.
TYPED_TEST(SpillTest, AnIoErrorReadingTheDiskAtWakeKeepsTheBackupsAndARetryWorks) {
  SpillFaultScope scope;
  std::uint64_t count = 0;
  {
    TempDir dir;
    Pool pool(this->driver(), this->spilling(dir.path, 1));
    std::mt19937_64 rng(29);
    this->items(pool, rng);
    pool.sleep(1);
    std::uint64_t before = SpillFaults::calls(SpillCall::pread);
    pool.wake_up();
    count = SpillFaults::calls(SpillCall::pread) - before;
  }
  ASSERT_GT(count, 0u);
  for (std::uint64_t k : {std::uint64_t{0}, count / 2, count - 1}) {
    SCOPED_TRACE(::testing::Message() << "pread #" << k + 1 << " of " << count << " fails with EIO");
    TempDir dir;
    Pool pool(this->driver(), this->spilling(dir.path, 1));
    std::mt19937_64 rng(29);
    auto items = this->items(pool, rng);
    pool.sleep(1);
    SpillFaults::fail(SpillCall::pread, EIO, k, 1);
    try {
      pool.wake_up();
      ADD_FAILURE() << "a failed disk read must fail the wake";
    } catch (const error& e) {
      EXPECT_NE(std::string(e.what()).find(pool.stats().spill_path), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(std::strerror(EIO)), std::string::npos) << e.what();
    }
    SpillFaults::clear();
    std::size_t asleep = 0;
    for (auto& it : items) {
      if (pool.find(it.p)->asleep) {
        ++asleep;
        continue;
      }
      EXPECT_EQ(read(pool, it.p, it.bytes.size()), it.bytes) << "a chunk that woke holds its bytes";
    }
    EXPECT_GT(asleep, 0u);
    EXPECT_TRUE(pool.asleep("weights"));
    if (HostDriver* h = this->host()) EXPECT_EQ(h->live_physical_bytes(0), pool.stats().mapped_bytes);
    pool.wake_up();
    EXPECT_FALSE(pool.asleep("weights"));
    for (auto& it : items) EXPECT_EQ(read(pool, it.p, it.bytes.size()), it.bytes);
    if (::testing::Test::HasFailure()) return;
  }
}

TEST(Spill, StaleFilesOfProcessesThatAreGoneAreRemovedAndLiveOnesKept) {
  TempDir dir;
  std::string me = std::to_string(::getpid());
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) ::_exit(0);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);  // reaped: its pid names no process now
  std::string prefix = SpillStore::file_prefix;
  std::string dead_bin = prefix + "123-00000000000000aa.bin";  // nobody holds its lock
  std::string live_bin = prefix + me + "-00000000000000bb.bin";
  std::string dead_tmp = prefix + std::to_string(child) + "-00000000000000cc.tmp";
  std::string live_tmp = prefix + me + "-00000000000000dd.tmp";
  for (const auto& f : {dead_bin, live_bin, dead_tmp, live_tmp, std::string("unrelated.bin")}) dir.touch(f);
  // A live pool's file: locked through its own open file description, as SpillStore holds it.
  int live = ::open((dir.path + "/" + live_bin).c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(live, 0);
  ASSERT_EQ(::flock(live, LOCK_EX), 0);
  {
    HostDriver d(HostBackend::options());
    PoolOptions o;
    o.va_bytes = 64 * MiB;
    o.host_store_limit = 1;
    o.spill_dir = dir.path;
    Pool pool(d, o);
    std::set<std::string> files = dir.files();
    EXPECT_FALSE(files.count(dead_bin));
    EXPECT_FALSE(files.count(dead_tmp));
    EXPECT_TRUE(files.count(live_bin)) << "a live process's file is never removed";
    EXPECT_TRUE(files.count(live_tmp));
    EXPECT_TRUE(files.count("unrelated.bin"));
    EXPECT_EQ(files.size(), 4u) << "the four kept and the pool's own";
    EXPECT_EQ(SpillStore::remove_stale(dir.path), 0u) << "the pool's own file is locked too";
  }
  ::close(live);
  EXPECT_EQ(SpillStore::remove_stale(dir.path), 1u) << "unlocked now";
  EXPECT_EQ(dir.files(), (std::set<std::string>{live_tmp, "unrelated.bin"}));
}

// Issue 31 item 5: a spill limit without a spill directory was accepted and did nothing (the
// caller meant to bound a disk tier that is not there): refused, naming both options.
TEST(Spill, ASpillLimitWithoutASpillDirIsRefused) {
  HostDriver d(HostBackend::options());
  PoolOptions o;
  o.va_bytes = 64 * MiB;
  o.host_store_limit = 1;
  o.spill_limit = 4 * MiB;
  try {
    Pool pool(d, o);
    FAIL() << "a spill_limit without a spill_dir must be refused";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("spill_limit"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("spill_dir"), std::string::npos) << e.what();
  }
  EXPECT_EQ(d.counters().reservations, 0u) << "nothing was made";
  TempDir dir;
  o.spill_dir = dir.path;
  Pool pool(d, o);  // with the directory the same limit is fine
  EXPECT_FALSE(pool.stats().spill_path.empty());
}

TEST(Spill, AnUnusableDirectoryIsRefusedAtCreation) {
  TempDir dir;
  dir.touch("a-file");
  HostDriver d(HostBackend::options());
  PoolOptions o;
  o.va_bytes = 64 * MiB;
  o.host_store_limit = 1;
  o.spill_dir = dir.path + "/a-file";
  try {
    Pool pool(d, o);
    FAIL() << "a file is not a spill directory";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("is not a directory"), std::string::npos) << e.what();
  }
  o.spill_dir = dir.path + "/new";
  Pool pool(d, o);  // one missing level is created
  EXPECT_EQ(pool.stats().spill_path.rfind(dir.path + "/new/", 0), 0u);
}

// Issue 33 N2: a forked child that exits normally destroys its copy of the pool. That copy's spill
// store shares the parent's file; it must leave the file and its bytes alone, and a spill in the
// child is refused (the file is the parent's), so the parent wakes every byte afterwards.
int child_wakes_changes_and_sleeps(Pool& pool, std::vector<std::pair<void*, std::vector<std::uint8_t>>>& items) {
  ::alarm(60);     // a hang in the child fails the test instead of stalling it
  pool.wake_up();  // reading the parent's file is fine
  for (auto& [p, bytes] : items)
    if (read(pool, p, bytes.size()) != bytes) return 20;
  for (auto& [p, bytes] : items) {
    std::vector<std::uint8_t> other(bytes.size(), 0x5a);
    write(pool, p, other);
  }
  try {
    pool.sleep(1);
    return 21;  // writing to the parent's file must be refused
  } catch (const invalid_state& e) {
    if (std::string(e.what()).find("fork") == std::string::npos) return 22;
  }
  return 0;
}

TEST(Spill, AForkedChildThatExitsLeavesItsParentsSpillFileAndBytesAlone) {
  TempDir dir;
  HostDriver d(HostBackend::options());
  PoolOptions o;
  o.va_bytes = 64 * MiB;
  o.host_store_limit = 1;
  o.spill_dir = dir.path;
  auto pool = std::make_unique<Pool>(d, o);
  std::mt19937_64 rng(35);
  std::vector<std::pair<void*, std::vector<std::uint8_t>>> items;
  for (std::size_t n : {std::size_t{3000}, 200 * KiB, 3 * MiB + 5}) {
    items.emplace_back(pool->allocate(n, {"weights", MemoryClass::state, ""}), random_bytes(rng, n));
    write(*pool, items.back().first, items.back().second);
  }
  pool->sleep(1);
  const std::string path = pool->stats().spill_path;
  ASSERT_GT(pool->stats().spill_used_bytes, 0u);
  for (bool spill_in_child : {false, true}) {
    SCOPED_TRACE(spill_in_child ? "the child tries to spill" : "the child only exits");
    std::fflush(nullptr);
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      int rc = spill_in_child ? child_wakes_changes_and_sleeps(*pool, items) : 0;
      pool.reset();  // what a normal exit does to the child's copy
      ::_exit(rc);
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status)) << "child status " << status;
    EXPECT_EQ(WEXITSTATUS(status), 0);
    EXPECT_EQ(::access(path.c_str(), F_OK), 0) << path << " is the parent's";
  }
  pool->wake_up();
  for (auto& [p, bytes] : items) EXPECT_EQ(read(*pool, p, bytes.size()), bytes);
  pool.reset();
  EXPECT_TRUE(dir.files().empty()) << "the parent's pool removes its own file";
}

// Issue 33 N21: a pool that is never destroyed (as the one behind PyTorch's allocator) and a
// process that exits normally: the spill file, the model's state on disk, goes with the process.
void exit_with_a_pool_never_destroyed(const std::string& dir) {
  static HostDriver d(HostBackend::options());
  PoolOptions o;
  o.va_bytes = 64 * MiB;
  o.host_store_limit = 1;
  o.spill_dir = dir;
  auto* pool = new Pool(d, o);  // never deleted, on purpose
  void* p = pool->allocate(300 * KiB, {"weights", MemoryClass::state, ""});
  std::vector<std::uint8_t> bytes(300 * KiB, 0x3c);
  write(*pool, p, bytes);
  pool->sleep(1);
  if (pool->stats().spill_used_bytes == 0) std::exit(3);
  std::exit(0);
}

TEST(Spill, ANormalExitRemovesTheSpillFileOfAPoolNeverDestroyed) {
  TempDir dir;
  ASSERT_EQ(exit_status_of_child([&] {
              exit_with_a_pool_never_destroyed(dir.path);
              return 1;
            }),
            0);
  auto left = dir.files();
  EXPECT_TRUE(left.empty()) << "left behind: " << *left.begin();
}

int fill_and_retry(const std::string& dir);

// A file-size limit (RLIMIT_FSIZE) hit in the middle of a sleep, in a child process (the limit
// and SIGXFSZ are per process): the chunks whose bytes reached the file are asleep, the others
// awake with their bytes, and once the limit is lifted the retry completes the sleep.
int fill_the_disk_mid_sleep(const TempDir& dir, bool ignore_sigxfsz) {
  // Ignored, the write fails with EFBIG; by default SIGXFSZ would kill the process, and torpor
  // must not let it (issue 33 N3): the same clean error either way.
  std::signal(SIGXFSZ, ignore_sigxfsz ? SIG_IGN : SIG_DFL);
  int rc = fill_and_retry(dir.path);
  if (rc == 0 && !dir.files().empty()) return 17;  // the pool must remove its file
  return rc;
}

int fill_and_retry(const std::string& dir) {
  HostDriver d(HostBackend::options());
  PoolOptions o;
  o.va_bytes = 64 * MiB;
  o.medium_limit = 0;
  o.host_store_limit = 1;
  o.spill_dir = dir;
  o.staging_slot_bytes = 64 * KiB;
  Pool pool(d, o);
  std::mt19937_64 rng(14);
  std::vector<std::pair<void*, std::vector<std::uint8_t>>> items;
  for (int i = 0; i < 8; ++i) {
    items.emplace_back(pool.allocate(256 * KiB, {"weights", MemoryClass::state, ""}), random_bytes(rng, 256 * KiB));
    write(pool, items.back().first, items.back().second);
  }
  rlimit rl{};
  ::getrlimit(RLIMIT_FSIZE, &rl);
  rlimit low = rl;
  low.rlim_cur = 800 * KiB;  // three chunks fit, the fourth does not
  if (::setrlimit(RLIMIT_FSIZE, &low) != 0) return 10;
  try {
    pool.sleep(1);
    return 11;  // must fail
  } catch (const out_of_memory& e) {
    std::string m = e.what();
    if (m.find("RLIMIT_FSIZE") == std::string::npos && m.find("spill") == std::string::npos) return 12;
  }
  int asleep = 0;
  for (auto& [p, bytes] : items) {
    if (pool.find(p)->asleep) {
      ++asleep;
      continue;
    }
    if (read(pool, p, bytes.size()) != bytes) return 13;  // an awake chunk lost its bytes
  }
  if (asleep == static_cast<int>(items.size())) return 14;
  if (::setrlimit(RLIMIT_FSIZE, &rl) != 0) return 15;
  pool.sleep(1);  // the retry completes the sleep
  pool.wake_up();
  for (auto& [p, bytes] : items)
    if (read(pool, p, bytes.size()) != bytes) return 16;
  return 0;
}

TEST(Spill, AFileSizeLimitMidSleepIsAClearErrorAndARetryWorks) {
  TempDir dir;
  EXPECT_EQ(exit_status_of_child([&] { return fill_the_disk_mid_sleep(dir, true); }), 0);
}

TEST(Spill, AFileSizeLimitMidSleepDoesNotKillAProcessThatKeepsSigxfszDefault) {
  TempDir dir;
  EXPECT_EQ(exit_status_of_child([&] { return fill_the_disk_mid_sleep(dir, false); }), 0)
      << "128 + 25: killed by SIGXFSZ";
}

// spill_file_per_allocation (torch_memory_saver's disk layout, issue 27): a file of its own per
// allocation's backed-up range, even for allocations side by side in one slab; the files hold
// the bytes, restored bit-exact; a steady cycle reuses them; release_host_store() removes them;
// the spill limit counts every file.
TYPED_TEST(SpillTest, AFilePerAllocationKeepsEachAllocationInAFileOfItsOwn) {
  TempDir dir;
  {
    PoolOptions o = this->spilling(dir.path, 1);
    o.spill_file_per_allocation = true;
    Pool pool(this->driver(), o);
    EXPECT_TRUE(dir.files().empty()) << "no pool-wide file in this layout";
    std::mt19937_64 rng(27);
    std::vector<typename TestFixture::Item> items;
    for (std::size_t n : {std::size_t{4096}, 8 * KiB, 64 * KiB})  // side by side in one small slab
      items.push_back(this->make(pool, "weights", n, MemoryClass::state, "", rng));
    void* cache = pool.allocate(64 * KiB, {"weights", MemoryClass::cache, ""});
    for (int cycle = 0; cycle < 3; ++cycle) {
      SCOPED_TRACE(::testing::Message() << "cycle " << cycle);
      if (cycle == 2)
        for (auto& it : items) {
          for (auto& b : it.bytes) b = static_cast<std::uint8_t>(b * 29 + 3);
          write(pool, it.p, it.bytes);
        }
      pool.sleep(1);
      EXPECT_EQ(dir.files().size(), items.size()) << "one file per allocation with a backup, none for the cache";
      std::size_t on_disk = 0;
      for (const auto& f : dir.files()) on_disk += std::filesystem::file_size(dir.path + "/" + f);
      PoolStats st = pool.stats();
      EXPECT_EQ(on_disk, st.spill_bytes) << "the books: every disk byte the pool holds is in those files";
      EXPECT_EQ(st.spill_path, dir.path);
      pool.wake_up();
      for (auto& it : items) EXPECT_EQ(read(pool, it.p, it.bytes.size()), it.bytes);
    }
    pool.release_host_store();
    EXPECT_TRUE(dir.files().empty()) << "released with the copies";
    pool.deallocate(cache);
  }
  EXPECT_TRUE(dir.files().empty());
}

TYPED_TEST(SpillTest, AFilePerAllocationCountsTheSpillLimitOverEveryFile) {
  TempDir dir;
  PoolOptions o = this->spilling(dir.path, 1);
  o.spill_file_per_allocation = true;
  o.spill_limit = 64 * KiB;  // room for the first allocation's file, not for the second too
  o.skip_unchanged = false;
  Pool pool(this->driver(), o);
  std::mt19937_64 rng(28);
  auto a = this->make(pool, "weights", 40 * KiB, MemoryClass::state, "", rng);
  auto b = this->make(pool, "weights", 40 * KiB, MemoryClass::state, "", rng);
  EXPECT_THROW(pool.sleep(1), out_of_memory);
  EXPECT_FALSE(pool.asleep("weights")) << "nothing moved";
  EXPECT_LE(dir.files().size(), 1u) << "the second file was never made";
  EXPECT_EQ(read(pool, a.p, a.bytes.size()), a.bytes);
  EXPECT_EQ(read(pool, b.p, b.bytes.size()), b.bytes);
  pool.release_host_store();
  EXPECT_TRUE(dir.files().empty()) << "the first one's file held nothing: given back";
}

TEST(Spill, AFilePerAllocationNeedsASpillDir) {
  HostDriver d(HostBackend::options());
  PoolOptions o;
  o.va_bytes = 64 * MiB;
  o.spill_file_per_allocation = true;
  try {
    Pool pool(d, o);
    FAIL() << "accepted without spill_dir";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("spill_file_per_allocation needs spill_dir"), std::string::npos) << e.what();
  }
}

// torch_memory_saver's disk_backup example removes its directory before the process ends: the
// spill file is gone when torpor removes it, which is what torpor wanted, and nothing is lost
// (the descriptor kept the bytes). No error then; a file that took the name since stays.
TEST(Spill, AFileSomeoneElseRemovedIsNoErrorAndAFileInItsPlaceIsLeftAlone) {
  for (bool replaced : {false, true}) {
    SCOPED_TRACE(replaced ? "replaced" : "removed");
    TempDir dir;
    std::string path;
    ::testing::internal::CaptureStderr();
    {
      SpillStore store(dir.path, 0);
      path = store.path();
      ASSERT_EQ(::unlink(path.c_str()), 0);
      if (replaced) dir.touch(path.substr(dir.path.size() + 1));
    }
    std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(err.find("torpor error"), std::string::npos) << err;
    EXPECT_EQ(dir.files().size(), replaced ? 1u : 0u) << "a file in its place is someone else's";
  }
}

}  // namespace
}  // namespace torpor::test
