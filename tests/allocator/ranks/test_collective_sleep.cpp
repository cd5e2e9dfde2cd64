// CallbackGroup (a Group over an embedder's collectives) and collective sleep / wake over any
// Group. The embedder's transport here is make_thread_group: one thread per rank, each with its
// own HostDriver and Pool. The oracle for restored bytes is a pattern computed from (rank,
// allocation) independently of the pool. Suites whose name contains "Threads" run under TSan.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>

#include "torpor/backend.hpp"
#include "torpor/callback_group.hpp"
#include "torpor/collective_sleep.hpp"
#include "torpor/host_driver.hpp"
#include "torpor/testing/fault_injecting_driver.hpp"
#include "torpor/torpor.h"

namespace torpor::test {
namespace {

using namespace std::chrono_literals;

GroupOptions short_timeout() {
  GroupOptions o;
  o.timeout = 20s;
  return o;
}

// One CallbackGroup per rank whose callbacks run over a thread group, as a torch process
// group's all_gather_object / barrier would.
struct CallbackRanks {
  explicit CallbackRanks(int n) : transport(make_thread_group(n, short_timeout())) {
    for (int r = 0; r < n; ++r) {
      Group* t = transport[static_cast<std::size_t>(r)].get();
      GroupCallbacks cb;
      cb.all_gather = [t](std::span<const std::byte> mine) { return t->all_gather(mine); };
      cb.barrier = [t] { t->barrier(); };
      groups.push_back(std::make_unique<CallbackGroup>(r, n, std::move(cb), short_timeout()));
    }
  }
  std::vector<std::unique_ptr<Group>> transport;
  std::vector<std::unique_ptr<CallbackGroup>> groups;
};

// Runs fn(rank) on one thread per rank; the what() of each rank's exception ("" when none).
std::vector<std::string> on_every_rank(int n, const std::function<void(int)>& fn) {
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = std::string("!") + e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

std::vector<std::uint8_t> pattern(int rank, int item, std::size_t n) {
  std::vector<std::uint8_t> v(n);
  std::uint32_t x = 2654435761u * static_cast<std::uint32_t>(rank * 131 + item + 7);
  for (auto& b : v) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<std::uint8_t>(x >> 24);
  }
  return v;
}

// One rank's pool: two tags, state class (kept bit-exact at every level).
struct Rank {
  explicit Rank(int r) : rank(r), host(driver_options()), faulty(host), pool(faulty, options()) {
    for (int i = 0; i < 4; ++i) {
      AllocationOptions a;
      a.tag = i % 2 ? "kv_cache" : "weights";
      a.memory_class = MemoryClass::state;
      std::size_t n = (std::size_t{1} << 20) + static_cast<std::size_t>(i) * 4096;
      void* p = pool.allocate(n, a);
      auto bytes = pattern(r, i, n);
      pool.copy(p, bytes.data(), n);
      items.push_back({p, n});
    }
  }
  // TORPOR_HOST_MODE picks the emulator's mode (CI runs these tests in both).
  static HostDriverOptions driver_options() {
    HostDriverOptions o;
    o.async = host_driver_options_from_env().async;
    return o;
  }
  static PoolOptions options() {
    PoolOptions o;
    o.va_bytes = std::size_t{256} << 20;
    o.fill_on_wake = FillOnWake::poison;
    return o;
  }
  bool intact() {
    for (std::size_t i = 0; i < items.size(); ++i) {
      std::vector<std::uint8_t> got(items[i].second);
      pool.copy(got.data(), items[i].first, got.size());
      if (got != pattern(rank, static_cast<int>(i), got.size())) return false;
    }
    return true;
  }
  bool awake() { return !pool.asleep("weights") && !pool.asleep("kv_cache"); }

  int rank;
  HostDriver host;
  FaultInjectingDriver faulty;
  Pool pool;
  std::vector<std::pair<void*, std::size_t>> items;
};

std::vector<std::unique_ptr<Rank>> make_ranks(int n) {
  std::vector<std::unique_ptr<Rank>> out;
  for (int r = 0; r < n; ++r) out.push_back(std::make_unique<Rank>(r));
  return out;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(CollectiveSleepThreads, SleepAndWakeRestoreEveryRankBitExact) {
  const int n = 3;
  CallbackRanks g(n);
  auto ranks = make_ranks(n);
  std::vector<int> asleep_after_sleep(n, 0);
  auto errors = on_every_rank(n, [&](int r) {
    auto& me = *ranks[static_cast<std::size_t>(r)];
    auto& group = *g.groups[static_cast<std::size_t>(r)];
    collective_sleep(me.pool, group, 1);
    asleep_after_sleep[static_cast<std::size_t>(r)] = me.pool.asleep("weights") && me.pool.asleep("kv_cache");
    collective_wake_up(me.pool, group);
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(errors[static_cast<std::size_t>(r)], "") << "rank " << r;
    EXPECT_TRUE(asleep_after_sleep[static_cast<std::size_t>(r)]) << "rank " << r;
    EXPECT_TRUE(ranks[static_cast<std::size_t>(r)]->awake()) << "rank " << r;
    EXPECT_TRUE(ranks[static_cast<std::size_t>(r)]->intact()) << "rank " << r;
  }
}

TEST(CollectiveSleepThreads, MismatchedRequestIsRejectedOnEveryRankAndNoRankSleeps) {
  const int n = 3;
  CallbackRanks g(n);
  auto ranks = make_ranks(n);
  std::vector<int> invalid(n, 0);
  auto errors = on_every_rank(n, [&](int r) {
    auto& me = *ranks[static_cast<std::size_t>(r)];
    try {
      // Rank 2 asks for another tag set; tag order and duplicates do not count as a difference.
      std::vector<std::string> tags = r == 2 ? std::vector<std::string>{"weights"}
                                             : (r == 1 ? std::vector<std::string>{"kv_cache", "weights", "weights"}
                                                       : std::vector<std::string>{"weights", "kv_cache"});
      collective_sleep(me.pool, *g.groups[static_cast<std::size_t>(r)], 1, tags);
    } catch (const invalid_argument&) {
      invalid[static_cast<std::size_t>(r)] = 1;
      throw;
    }
  });
  for (int r = 0; r < n; ++r) {
    const auto& e = errors[static_cast<std::size_t>(r)];
    EXPECT_TRUE(invalid[static_cast<std::size_t>(r)]) << "rank " << r << ": " << e;
    EXPECT_TRUE(contains(e, "rank(s) [2]")) << e;
    EXPECT_TRUE(ranks[static_cast<std::size_t>(r)]->awake()) << "rank " << r;
    EXPECT_TRUE(ranks[static_cast<std::size_t>(r)]->intact()) << "rank " << r;
  }
}

TEST(CollectiveSleepThreads, OneRankFailingToSleepFailsEveryRankAndLeavesEveryRankAwakeAndIntact) {
  const int n = 3;
  CallbackRanks g(n);
  auto ranks = make_ranks(n);
  ranks[1]->faulty.fail_nth(DriverCall::copy, 3);  // rank 1's offload fails part way
  auto errors = on_every_rank(n, [&](int r) {
    collective_sleep(ranks[static_cast<std::size_t>(r)]->pool, *g.groups[static_cast<std::size_t>(r)], 1);
  });
  for (int r = 0; r < n; ++r) {
    const auto& e = errors[static_cast<std::size_t>(r)];
    EXPECT_TRUE(contains(e, "rank(s) [1] failed to sleep")) << "rank " << r << ": " << e;
    EXPECT_TRUE(contains(e, "every rank woke back up")) << e;
    EXPECT_TRUE(ranks[static_cast<std::size_t>(r)]->awake()) << "rank " << r;
    EXPECT_TRUE(ranks[static_cast<std::size_t>(r)]->intact()) << "rank " << r;
  }
  // The group is usable: the next collective sleep succeeds everywhere.
  errors = on_every_rank(n, [&](int r) {
    auto& me = *ranks[static_cast<std::size_t>(r)];
    collective_sleep(me.pool, *g.groups[static_cast<std::size_t>(r)], 1);
    collective_wake_up(me.pool, *g.groups[static_cast<std::size_t>(r)]);
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(errors[static_cast<std::size_t>(r)], "") << "rank " << r;
    EXPECT_TRUE(ranks[static_cast<std::size_t>(r)]->intact()) << "rank " << r;
  }
}

// A one-rank CallbackGroup whose all-gather can be made to fail at its n-th call from now, as an
// embedder's transport that breaks between the sleep and the outcome exchange (issue 33 N4).
struct BreakableGroup {
  BreakableGroup() {
    GroupCallbacks cb;
    cb.all_gather = [this](std::span<const std::byte> mine) {
      ++calls;
      if (calls == fail_at) throw std::runtime_error("the embedder's transport broke");
      return std::vector<std::vector<std::byte>>{std::vector<std::byte>(mine.begin(), mine.end())};
    };
    cb.barrier = [] {};
    group = std::make_unique<CallbackGroup>(0, 1, std::move(cb), short_timeout());
  }
  int calls = 0;
  int fail_at = -1;
  std::unique_ptr<CallbackGroup> group;
};

TEST(CollectiveSleep, AFailedOutcomeExchangeWakesThisRankBackAndSaysSo) {
  BreakableGroup g;
  Rank me(0);
  // How many all-gathers one collective sleep makes: the last of them is the outcome exchange.
  collective_sleep(me.pool, *g.group, 1);
  const int per_sleep = g.calls;
  collective_wake_up(me.pool, *g.group);
  ASSERT_TRUE(me.awake());
  g.calls = 0;
  g.fail_at = per_sleep;
  try {
    collective_sleep(me.pool, *g.group, 1);
    FAIL() << "collective_sleep returned although its outcome exchange failed";
  } catch (const std::exception& e) {
    EXPECT_TRUE(contains(e.what(), "could not exchange their outcomes")) << e.what();
    EXPECT_TRUE(contains(e.what(), "the embedder's transport broke")) << e.what();
    EXPECT_TRUE(contains(e.what(), "woke back up")) << e.what();
  }
  EXPECT_TRUE(me.awake()) << "the rank stayed asleep behind the error";
  EXPECT_TRUE(me.intact());
  AllocationOptions a;
  a.tag = "weights";
  EXPECT_NE(me.pool.allocate(4096, a), nullptr) << "the tag refuses allocations after the failed sleep";
}

TEST(CollectiveSleep, AFailedOutcomeExchangeOfAWakeSaysWhereThisRankIs) {
  BreakableGroup g;
  Rank me(0);
  collective_sleep(me.pool, *g.group, 1);
  g.calls = 0;
  collective_wake_up(me.pool, *g.group);
  const int per_wake = g.calls;
  collective_sleep(me.pool, *g.group, 1);
  g.calls = 0;
  g.fail_at = per_wake;
  try {
    collective_wake_up(me.pool, *g.group);
    FAIL() << "collective_wake_up returned although its outcome exchange failed";
  } catch (const std::exception& e) {
    EXPECT_TRUE(contains(e.what(), "could not exchange their outcomes")) << e.what();
    EXPECT_TRUE(contains(e.what(), "this rank is awake")) << e.what();
  }
  EXPECT_TRUE(me.awake());
  EXPECT_TRUE(me.intact());
}

TEST(CollectiveSleepThreads, ATagOneRankDoesNotHaveFailsEveryRankWithoutAHang) {
  const int n = 2;
  // A rank that skipped the outcome exchange shows as a group_timeout (not invalid_argument).
  auto transport = make_thread_group(n, short_timeout());
  auto ranks = make_ranks(n);
  AllocationOptions extra;
  extra.tag = "extra";
  ranks[0]->pool.allocate(4096, extra);  // only rank 0 knows the tag
  std::vector<int> invalid(n, 0);
  auto errors = on_every_rank(n, [&](int r) {
    try {
      collective_sleep(ranks[static_cast<std::size_t>(r)]->pool, *transport[static_cast<std::size_t>(r)], 1,
                       {"weights", "extra"});
    } catch (const invalid_argument&) {
      invalid[static_cast<std::size_t>(r)] = 1;
      throw;
    }
  });
  for (int r = 0; r < n; ++r) {
    const auto& e = errors[static_cast<std::size_t>(r)];
    EXPECT_TRUE(invalid[static_cast<std::size_t>(r)]) << "rank " << r << ": " << e;
    EXPECT_TRUE(contains(e, "rank(s) [1] failed to sleep")) << e;
    EXPECT_TRUE(ranks[static_cast<std::size_t>(r)]->awake()) << "rank " << r;
    EXPECT_TRUE(ranks[static_cast<std::size_t>(r)]->intact()) << "rank " << r;
  }
  EXPECT_FALSE(ranks[0]->pool.asleep("extra"));
}

TEST(CollectiveSleepThreads, OneRankFailingToWakeIsNamedEverywhereAndAWakeAgainCompletes) {
  const int n = 2;
  CallbackRanks g(n);
  auto ranks = make_ranks(n);
  auto errors = on_every_rank(n, [&](int r) {
    collective_sleep(ranks[static_cast<std::size_t>(r)]->pool, *g.groups[static_cast<std::size_t>(r)], 1);
  });
  ASSERT_EQ(errors, std::vector<std::string>(n));
  ranks[1]->faulty.fail_from(DriverCall::create, 1);  // rank 1's device is full
  std::vector<int> oom(n, 0);
  errors = on_every_rank(n, [&](int r) {
    try {
      collective_wake_up(ranks[static_cast<std::size_t>(r)]->pool, *g.groups[static_cast<std::size_t>(r)]);
    } catch (const out_of_memory&) {
      oom[static_cast<std::size_t>(r)] = 1;
      throw;
    }
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_TRUE(oom[static_cast<std::size_t>(r)]) << "rank " << r << ": " << errors[static_cast<std::size_t>(r)];
    EXPECT_TRUE(contains(errors[static_cast<std::size_t>(r)], "rank(s) [1] are still asleep"))
        << errors[static_cast<std::size_t>(r)];
  }
  EXPECT_TRUE(ranks[0]->awake());
  EXPECT_TRUE(ranks[0]->intact());
  EXPECT_FALSE(ranks[1]->awake());
  ranks[1]->faulty.clear();
  errors = on_every_rank(n, [&](int r) {
    collective_wake_up(ranks[static_cast<std::size_t>(r)]->pool, *g.groups[static_cast<std::size_t>(r)]);
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(errors[static_cast<std::size_t>(r)], "") << "rank " << r;
    EXPECT_TRUE(ranks[static_cast<std::size_t>(r)]->awake()) << "rank " << r;
    EXPECT_TRUE(ranks[static_cast<std::size_t>(r)]->intact()) << "rank " << r;
  }
}

TEST(CollectiveSleepThreads, WorksOverAThreadGroupDirectly) {
  const int n = 2;
  auto groups = make_thread_group(n, short_timeout());
  auto ranks = make_ranks(n);
  auto errors = on_every_rank(n, [&](int r) {
    auto& me = *ranks[static_cast<std::size_t>(r)];
    collective_sleep(me.pool, *groups[static_cast<std::size_t>(r)], 2, {"kv_cache"});
    collective_wake_up(me.pool, *groups[static_cast<std::size_t>(r)], {"kv_cache"});
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(errors[static_cast<std::size_t>(r)], "");
    EXPECT_TRUE(ranks[static_cast<std::size_t>(r)]->intact()) << "rank " << r;  // state class survives level 2
  }
}

TEST(CallbackGroup, RangeChecksItsArguments) {
  auto ok = [] {
    GroupCallbacks cb;
    cb.all_gather = [](std::span<const std::byte>) { return std::vector<std::vector<std::byte>>{}; };
    cb.barrier = [] {};
    return cb;
  };
  EXPECT_THROW(CallbackGroup(2, 2, ok()), invalid_argument);
  EXPECT_THROW(CallbackGroup(-1, 2, ok()), invalid_argument);
  EXPECT_THROW(CallbackGroup(0, 0, ok()), invalid_argument);
  GroupCallbacks no_barrier = ok();
  no_barrier.barrier = nullptr;
  EXPECT_THROW(CallbackGroup(0, 1, no_barrier), invalid_argument);
  CallbackGroup g(1, 2, ok());
  EXPECT_EQ(g.kind(), "torch");
  EXPECT_EQ(g.rank(), 1);
  EXPECT_EQ(g.size(), 2);
}

TEST(CallbackGroup, AMalformedReplyIsATypedErrorNamingTheRankAndBreaksTheGroupUntilRecover) {
  int entries = 1;
  bool throw_it = false;
  GroupCallbacks cb;
  cb.all_gather = [&](std::span<const std::byte> mine) {
    if (throw_it) throw std::runtime_error("the process group is gone");
    std::vector<std::vector<std::byte>> out(static_cast<std::size_t>(entries));
    for (auto& e : out) e.assign(mine.begin(), mine.end());
    return out;
  };
  cb.barrier = [] {};
  CallbackGroup g(1, 2, cb);
  std::string mine = "abc";
  auto bytes = std::as_bytes(std::span(mine.data(), mine.size()));
  try {
    g.all_gather(bytes);
    FAIL() << "expected invalid_state";
  } catch (const invalid_state& e) {
    EXPECT_TRUE(contains(e.what(), "group rank 1 of 2 (torch)")) << e.what();
    EXPECT_TRUE(contains(e.what(), "returned 1 entries for 2 ranks")) << e.what();
  }
  entries = 2;
  EXPECT_THROW(g.barrier(), invalid_state);  // broken until recover()
  g.recover();
  EXPECT_EQ(g.all_gather(bytes).size(), 2u);
  throw_it = true;
  try {
    g.all_gather(bytes);
    FAIL() << "expected error";
  } catch (const invalid_state&) {
    FAIL() << "a failing callback is not a malformed reply";
  } catch (const error& e) {
    EXPECT_TRUE(contains(e.what(), "group rank 1 of 2 (torch)")) << e.what();
    EXPECT_TRUE(contains(e.what(), "the process group is gone")) << e.what();
  }
}

TEST(CallbackGroup, AReplyThatLosesThisRanksBytesIsMalformed) {
  GroupCallbacks cb;
  cb.all_gather = [](std::span<const std::byte>) { return std::vector<std::vector<std::byte>>(2); };
  cb.barrier = [] {};
  CallbackGroup g(0, 2, cb);
  std::string mine = "x";
  EXPECT_THROW(g.all_gather(std::as_bytes(std::span(mine.data(), mine.size()))), invalid_state);
}

// The C API: callbacks over a thread group's collectives, one pool handle per rank.
int c_all_gather(void* user, const void* mine, size_t bytes, torpor_gather_t out) {
  try {
    auto all = static_cast<Group*>(user)->all_gather({static_cast<const std::byte*>(mine), bytes});
    for (const auto& part : all)
      if (torpor_gather_append(out, part.data(), part.size()) != TORPOR_OK) return 2;
    return 0;
  } catch (const std::exception& e) {
    torpor_gather_fail(out, e.what());
    return 1;
  }
}
int c_barrier(void* user) {
  try {
    static_cast<Group*>(user)->barrier();
    return 0;
  } catch (const std::exception&) {
    return 1;
  }
}
int c_short_gather(void*, const void* mine, size_t bytes, torpor_gather_t out) {
  return torpor_gather_append(out, mine, bytes) == TORPOR_OK ? 0 : 2;  // one part for two ranks
}

TEST(CollectiveSleepThreads, TheCApiSleepsAndWakesEveryRankAndRejectsAMismatch) {
  const int n = 2;
  auto transport = make_thread_group(n, short_timeout());
  std::vector<torpor_pool_t> pools(n);
  std::vector<torpor_group_t> groups(n);
  std::vector<void*> ptrs(n);
  const std::size_t bytes = std::size_t{1} << 20;
  for (int r = 0; r < n; ++r) {
    torpor_pool_options o;
    torpor_pool_options_init(&o);
    o.backend = TORPOR_BACKEND_HOST;
    o.va_bytes = std::size_t{256} << 20;
    ASSERT_EQ(torpor_pool_create(&o, &pools[r]), TORPOR_OK) << torpor_last_error();
    ASSERT_EQ(torpor_alloc(pools[r], bytes, TORPOR_TAG_KV_CACHE, TORPOR_CLASS_STATE, "s", &ptrs[r]), TORPOR_OK);
    auto p = pattern(r, 0, bytes);
    ASSERT_EQ(torpor_copy(pools[r], ptrs[r], p.data(), bytes), TORPOR_OK);
    torpor_group_callbacks cb{c_all_gather, c_barrier, transport[static_cast<std::size_t>(r)].get()};
    ASSERT_EQ(torpor_group_create_callbacks(r, n, &cb, 0, &groups[r]), TORPOR_OK) << torpor_last_error();
  }
  std::vector<int> st(n);
  std::vector<std::string> why(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      const char* tags[] = {TORPOR_TAG_KV_CACHE};
      st[r] = torpor_collective_sleep(pools[r], groups[r], r == 0 ? 1 : 2, tags, 1);  // levels differ
      why[r] = torpor_last_error();
      if (st[r] != TORPOR_ERROR_INVALID_ARGUMENT) return;
      st[r] = torpor_collective_sleep(pools[r], groups[r], 1, tags, 1);
      if (st[r] == TORPOR_OK) st[r] = torpor_collective_wake_up(pools[r], groups[r], tags, 1);
    });
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    EXPECT_TRUE(contains(why[r], "rank(s) [1]")) << why[r];
    EXPECT_EQ(st[r], TORPOR_OK) << torpor_last_error();
    std::vector<std::uint8_t> got(bytes);
    ASSERT_EQ(torpor_copy(pools[r], got.data(), ptrs[r], bytes), TORPOR_OK);
    EXPECT_EQ(got, pattern(r, 0, bytes)) << "rank " << r;
  }
  torpor_group_callbacks short_cb{c_short_gather, c_barrier, nullptr};
  torpor_group_t bad = nullptr;
  ASSERT_EQ(torpor_group_create_callbacks(0, 2, &short_cb, 0, &bad), TORPOR_OK);
  EXPECT_EQ(torpor_collective_sleep(pools[0], bad, 1, nullptr, 0), TORPOR_ERROR_INVALID_STATE);
  EXPECT_TRUE(contains(torpor_last_error(), "returned 1 entries for 2 ranks")) << torpor_last_error();
  EXPECT_EQ(torpor_group_destroy(bad), TORPOR_OK);
  torpor_group_t never = nullptr;
  EXPECT_EQ(torpor_group_create_callbacks(2, 2, &short_cb, 0, &never), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(torpor_group_create_callbacks(0, 2, &short_cb, -1, &never), TORPOR_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(never, nullptr);
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(torpor_group_destroy(groups[r]), TORPOR_OK);
    EXPECT_EQ(torpor_collective_wake_up(pools[r], groups[r], nullptr, 0), TORPOR_ERROR_INVALID_HANDLE);
    EXPECT_EQ(torpor_pool_destroy(pools[r]), TORPOR_OK);
  }
  EXPECT_EQ(torpor_group_destroy(groups[0]), TORPOR_ERROR_INVALID_HANDLE);
  EXPECT_TRUE(contains(torpor_last_error(), "torpor_group_destroy: group handle ")) << torpor_last_error();
  EXPECT_TRUE(contains(torpor_last_error(), " is not a live group (destroyed twice?)")) << torpor_last_error();
}

UniqueFd memfd_with(const std::string& text) {
  UniqueFd fd(::memfd_create("torpor-test", MFD_CLOEXEC));
  if (!fd || ::write(fd.get(), text.data(), text.size()) != static_cast<ssize_t>(text.size()))
    throw std::runtime_error("memfd");
  return fd;
}
std::string read_fd(int fd) {
  char buf[64] = {};
  ssize_t n = ::pread(fd, buf, sizeof buf, 0);
  return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string();
}

TEST(CallbackGroupThreads, FileDescriptorsTravelThroughTheUnixGroupItBootstrapsOnce) {
  const int n = 3;
  CallbackRanks g(n);
  std::vector<std::vector<std::string>> seen(n);
  std::vector<const Group*> fd_groups(n);
  auto errors = on_every_rank(n, [&](int r) {
    auto& group = *g.groups[static_cast<std::size_t>(r)];
    for (int round = 0; round < 2; ++round) {
      UniqueFd mine = memfd_with("rank " + std::to_string(r) + " round " + std::to_string(round));
      int fd = mine.get();
      auto all = group.all_gather_fds(std::span<const int>(&fd, 1));
      if (round == 0) fd_groups[static_cast<std::size_t>(r)] = group.fd_group();
      EXPECT_EQ(group.fd_group(), fd_groups[static_cast<std::size_t>(r)]) << "the Unix group is created once";
      for (auto& from : all)
        for (auto& f : from) seen[static_cast<std::size_t>(r)].push_back(read_fd(f.get()));
    }
    group.barrier();
  });
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(errors[static_cast<std::size_t>(r)], "");
    ASSERT_NE(fd_groups[static_cast<std::size_t>(r)], nullptr);
    EXPECT_EQ(fd_groups[static_cast<std::size_t>(r)]->kind(), "unix");
    std::vector<std::string> expected;
    for (int round = 0; round < 2; ++round)
      for (int q = 0; q < n; ++q) expected.push_back("rank " + std::to_string(q) + " round " + std::to_string(round));
    EXPECT_EQ(seen[static_cast<std::size_t>(r)], expected) << "rank " << r;
  }
}

}  // namespace
}  // namespace torpor::test
