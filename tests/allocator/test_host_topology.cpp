// Host memory like the machine (host_topology.hpp): the NUMA node of a device's host store from a
// fake sysfs tree, the mbind placement the kernel reports back (get_mempolicy), and the rules of
// the page-locked budget (cgroup v2 and v1 limits, RLIMIT_MEMLOCK where registration counts
// against it), through the pool on the host backend: what stats() says, what HostDriver's
// account of registered bytes shows, and that the bytes beyond the budget still survive.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "pool/store/host_store.hpp"
#include "pool/store/host_topology.hpp"
#include "support/backends.hpp"
#include "torpor/host_driver.hpp"
#include "torpor/pool.hpp"

namespace torpor::test {
namespace {

namespace fs = std::filesystem;
constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr std::size_t GiB = std::size_t{1} << 30;

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// A fake /sys: files written on demand, removed at the end.
class FakeSys {
 public:
  FakeSys() {
    root_ = fs::temp_directory_path() /
            ("torpor-fake-sys-" + std::to_string(::getpid()) + "-" + std::to_string(std::random_device{}()));
    fs::create_directories(root_);
  }
  ~FakeSys() {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  FakeSys(const FakeSys&) = delete;
  FakeSys& operator=(const FakeSys&) = delete;
  void write(const std::string& rel, const std::string& text) {
    fs::path p = root_ / rel;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text << "\n";
  }
  void remove(const std::string& rel) { fs::remove(root_ / rel); }
  std::string root() const { return root_.string(); }

 private:
  fs::path root_;
};

TEST(HostTopology, TheDevicesNodeComesFromItsPciFunction) {
  FakeSys sys;
  sys.write("bus/pci/devices/0000:3b:00.0/numa_node", "1");
  sys.write("bus/pci/devices/0000:86:00.0/numa_node", "-1");
  sys.write("bus/pci/devices/0000:99:00.0/numa_node", "banana");
  EXPECT_EQ(pci_numa_node(sys.root(), "0000:3b:00.0"), 1);
  EXPECT_EQ(pci_numa_node(sys.root(), "0000:3B:00.0"), 1) << "CUDA writes the bus id in upper case";
  EXPECT_EQ(pci_numa_node(sys.root(), "3b:00.0"), 1) << "without the domain: 0000";
  EXPECT_EQ(pci_numa_node(sys.root(), "0000:86:00.0"), -1) << "the kernel's 'no node'";
  EXPECT_EQ(pci_numa_node(sys.root(), "0000:99:00.0"), -1) << "garbage is unknown, not node 0";
  EXPECT_EQ(pci_numa_node(sys.root(), "0000:aa:00.0"), -1) << "no such device";
  EXPECT_EQ(pci_numa_node(sys.root(), ""), -1);
  EXPECT_EQ(pci_numa_node(sys.root(), "../../../etc/passwd"), -1);
}

TEST(HostTopology, NodesOnlineParsesTheKernelsListAndDefaultsToOne) {
  FakeSys sys;
  EXPECT_EQ(numa_nodes_online(sys.root()), 1) << "no file: one node";
  sys.write("devices/system/node/online", "0");
  EXPECT_EQ(numa_nodes_online(sys.root()), 1);
  sys.write("devices/system/node/online", "0-1");
  EXPECT_EQ(numa_nodes_online(sys.root()), 2);
  sys.write("devices/system/node/online", "0-1,3,5-7");
  EXPECT_EQ(numa_nodes_online(sys.root()), 6);
  sys.write("devices/system/node/online", "3-1");
  EXPECT_EQ(numa_nodes_online(sys.root()), 1) << "nonsense: one node, no placement";
}

TEST(HostTopology, PlacementIsANoOpOnOneNodeAndTheDevicesNodeOnTwo) {
  FakeSys sys;
  sys.write("bus/pci/devices/0000:3b:00.0/numa_node", "1");
  sys.write("devices/system/node/online", "0");
  NumaPlacement one = numa_placement(sys.root(), "0000:3b:00.0");
  EXPECT_EQ(one.node, -1);
  EXPECT_NE(one.reason.find("one NUMA node"), std::string::npos) << one.reason;
  sys.write("devices/system/node/online", "0-1");
  NumaPlacement two = numa_placement(sys.root(), "0000:3b:00.0");
  EXPECT_EQ(two.node, 1);
  EXPECT_EQ(two.nodes_online, 2);
  EXPECT_NE(two.reason.find("0000:3b:00.0"), std::string::npos) << two.reason;
  EXPECT_EQ(numa_placement(sys.root(), "").node, -1) << "no bus id from the driver";
  EXPECT_EQ(numa_placement(sys.root(), "0000:86:00.0").node, -1) << "unknown device";
}

// The kernel's own record of the policy, on memory the store mapped and bound before touching it.
TEST(HostTopology, TheStoresBlocksAreBoundToTheNodeBeforeFirstTouch) {
  HostDriver d;
  int probe = 0;
  if (!memory_policy_of(&probe)) GTEST_SKIP() << "get_mempolicy is refused here (no NUMA support or seccomp)";
  {
    HostStoreOptions so;
    so.numa_node = 0;
    HostStore s(d, so);
    s.reserve(4 * MiB);
    HostSpan span = s.allocate(MiB);
    auto policy = memory_policy_of(span.ptr);
    ASSERT_TRUE(policy.has_value());
    EXPECT_EQ(policy->mode, mpol_preferred);
    EXPECT_EQ(policy->node, 0);
    s.wait_pinning();
    EXPECT_EQ(s.stats().numa_node, 0);
    s.free(span.ptr, span.bytes);
  }
  HostStore plain(d);
  plain.reserve(2 * MiB);
  HostSpan span = plain.allocate(MiB);
  auto policy = memory_policy_of(span.ptr);
  ASSERT_TRUE(policy.has_value());
  EXPECT_EQ(policy->mode, 0) << "no node: the process's default policy (first touch)";
  plain.wait_pinning();
  plain.free(span.ptr, span.bytes);
}

TEST(HostTopology, TheBudgetIsTheLeastOfTheLimitsThatApply) {
  const CgroupMemory none{};
  PinBudget b = pin_budget(0, none, 0, false, 0);
  EXPECT_EQ(b.bytes, 0u);
  EXPECT_EQ(b.source, "none");
  b = pin_budget(3 * GiB, none, 0, false, 0);
  EXPECT_EQ(b.bytes, 3 * GiB);
  EXPECT_EQ(b.source, "host_store_limit");

  // The cgroup: its limit, less what else it uses, less an eighth for the rest of the process.
  const CgroupMemory cg{.limit = 16 * GiB, .usage = 4 * GiB, .file = "/sys/fs/cgroup/memory.max"};
  b = pin_budget(0, cg, 0, false, 0);
  EXPECT_EQ(b.bytes, 16 * GiB - 4 * GiB - 2 * GiB);
  EXPECT_EQ(b.source, "cgroup /sys/fs/cgroup/memory.max");
  EXPECT_EQ(b.cgroup_limit, 16 * GiB);
  // What the store pinned is part of the usage, and stays its own.
  b = pin_budget(0, cg, 0, false, 3 * GiB);
  EXPECT_EQ(b.bytes, 16 * GiB - 1 * GiB - 2 * GiB);
  EXPECT_EQ(pin_budget(4 * GiB, cg, 0, false, 0).bytes, 4 * GiB) << "the user's smaller limit wins";
  EXPECT_EQ(pin_budget(4 * GiB, cg, 0, false, 0).source, "host_store_limit");
  // Inactive file cache (model files read at load) is reclaimable: not counted as used.
  const CgroupMemory cached{.limit = 16 * GiB, .usage = 15 * GiB, .reclaimable = 11 * GiB, .file = "memory.max"};
  EXPECT_EQ(pin_budget(0, cached, 0, false, 0).bytes, 16 * GiB - 4 * GiB - 2 * GiB);
  const CgroupMemory full{.limit = 8 * GiB, .usage = 8 * GiB, .file = "memory.max"};
  b = pin_budget(0, full, 0, false, 0);
  EXPECT_GT(b.bytes, 0u) << "a full cgroup is a limit, not 'no limit'";
  EXPECT_LT(b.bytes, HostStore::block_rounding) << "and leaves no block to pin";

  // RLIMIT_MEMLOCK only where the driver's registration is charged to it.
  EXPECT_EQ(pin_budget(0, none, 64 * MiB, false, 0).bytes, 0u);
  b = pin_budget(0, cg, 64 * MiB, true, 0);
  EXPECT_EQ(b.bytes, 64 * MiB);
  EXPECT_EQ(b.source, "RLIMIT_MEMLOCK");
  EXPECT_EQ(pin_budget(0, none, 0, true, 0).bytes, 0u) << "unlimited memlock";
}

TEST(HostTopology, CgroupLimitsAreReadFromV2ThenV1) {
  FakeSys sys;
  EXPECT_EQ(cgroup_memory(sys.root()).limit, 0u) << "no cgroup files: no limit";
  sys.write("fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712");  // v1's "unlimited"
  EXPECT_EQ(cgroup_memory(sys.root()).limit, 0u);
  sys.write("fs/cgroup/memory/memory.limit_in_bytes", std::to_string(6 * GiB));
  sys.write("fs/cgroup/memory/memory.usage_in_bytes", std::to_string(GiB));
  sys.write("fs/cgroup/memory/memory.stat", "cache 8192\ntotal_inactive_file 4096");
  CgroupMemory v1 = cgroup_memory(sys.root());
  EXPECT_EQ(v1.limit, 6 * GiB);
  EXPECT_EQ(v1.usage, GiB);
  EXPECT_EQ(v1.reclaimable, 4096u);
  EXPECT_NE(v1.file.find("memory.limit_in_bytes"), std::string::npos);
  sys.write("fs/cgroup/memory.max", "max");
  EXPECT_EQ(cgroup_memory(sys.root()).limit, 0u) << "v2 present and unlimited wins over v1";
  sys.write("fs/cgroup/memory.max", std::to_string(2 * GiB));
  sys.write("fs/cgroup/memory.current", std::to_string(512 * MiB));
  sys.write("fs/cgroup/memory.stat", "anon 1000\nfile 4096\ninactive_file 2048\nactive_file 2048");
  CgroupMemory v2 = cgroup_memory(sys.root());
  EXPECT_EQ(v2.limit, 2 * GiB);
  EXPECT_EQ(v2.usage, 512 * MiB);
  EXPECT_EQ(v2.reclaimable, 2048u);
}

PoolOptions small_pool() {
  PoolOptions o;
  o.va_bytes = 256 * MiB;
  o.medium_limit = 0;
  o.host_pin_block_bytes = 2 * MiB;
  o.host_pin_threads = 2;
  o.copy_piece_bytes = MiB;
  return o;
}

std::vector<std::vector<std::uint8_t>> fill(Pool& pool, std::vector<void*>& ptrs, int count) {
  std::mt19937_64 rng(42);
  std::vector<std::vector<std::uint8_t>> bytes;
  for (int i = 0; i < count; ++i) {
    ptrs.push_back(pool.allocate(MiB, {"weights", MemoryClass::state, "s" + std::to_string(i)}));
    std::vector<std::uint8_t> b(MiB);
    for (auto& x : b) x = static_cast<std::uint8_t>(rng());
    std::memcpy(ptrs.back(), b.data(), MiB);
    bytes.push_back(std::move(b));
  }
  return bytes;
}

TEST(HostTopologyPool, StatsNameTheDevicesNodeFromTheFakeTopology) {
  FakeSys sys;
  sys.write("bus/pci/devices/0000:3b:00.0/numa_node", "0");
  sys.write("bus/pci/devices/0000:86:00.0/numa_node", "1");
  sys.write("devices/system/node/online", "0-1");
  ScopedEnv root("TORPOR_SYSFS_ROOT", sys.root().c_str());
  HostDriverOptions ho = HostBackend::options();
  ho.pci_bus_ids = {"0000:3B:00.0", "0000:86:00.0"};
  HostDriver d(ho);
  PoolOptions o = small_pool();
  o.device = 1;
  Pool pool(d, o);
  PoolStats st = pool.stats();
  EXPECT_EQ(st.host_numa_node, 1) << st.host_numa_placement;
  EXPECT_NE(st.host_numa_placement.find("0000:86:00.0"), std::string::npos) << st.host_numa_placement;
  sys.write("devices/system/node/online", "0");
  Pool one(d, small_pool());
  EXPECT_EQ(one.stats().host_numa_node, -1) << "one node: nothing to place";
}

TEST(HostTopologyPool, ACgroupLimitCapsThePinnedStoreTheRestIsPageableAndSurvives) {
  FakeSys sys;
  sys.write("fs/cgroup/memory.max", std::to_string(16 * MiB));
  sys.write("fs/cgroup/memory.current", "0");
  ScopedEnv root("TORPOR_SYSFS_ROOT", sys.root().c_str());
  HostDriver d(HostBackend::options());
  Pool pool(d, small_pool());
  std::vector<void*> ptrs;
  auto bytes = fill(pool, ptrs, 24);
  TransitionReport r = pool.sleep(1);
  EXPECT_EQ(r.bytes_offloaded, 24 * MiB);
  pool.wait_host_store();
  PoolStats st = pool.stats();
  const std::size_t budget = 16 * MiB - 16 * MiB / 8;  // the rule, computed here
  EXPECT_EQ(st.host_store_budget_bytes, budget);
  EXPECT_NE(st.host_store_budget_source.find("memory.max"), std::string::npos) << st.host_store_budget_source;
  EXPECT_TRUE(st.host_store_capped);
  EXPECT_LE(d.counters().registered_bytes, budget) << "never page-locked past the cgroup's budget";
  EXPECT_GT(st.host_store_pageable_bytes, 0u) << "the rest is pageable";
  EXPECT_GT(r.bytes_staged, 0u) << "and went through the staging ring";
  pool.wake_up();
  for (std::size_t i = 0; i < ptrs.size(); ++i)
    ASSERT_EQ(std::memcmp(ptrs[i], bytes[i].data(), MiB), 0) << "allocation " << i;
  EXPECT_EQ(pool.prepare_host_store(64 * MiB), 0u) << "a prepare stays within the budget too";
}

TEST(HostTopologyPool, UnderNoLimitNothingIsCapped) {
  FakeSys sys;
  sys.write("fs/cgroup/memory.max", "max");
  ScopedEnv root("TORPOR_SYSFS_ROOT", sys.root().c_str());
  HostDriver d(HostBackend::options());
  Pool pool(d, small_pool());
  std::vector<void*> ptrs;
  fill(pool, ptrs, 8);
  pool.sleep(1);
  PoolStats st = pool.stats();
  EXPECT_EQ(st.host_store_budget_bytes, 0u);
  EXPECT_EQ(st.host_store_budget_source, "none");
  EXPECT_FALSE(st.host_store_capped);
  EXPECT_EQ(st.host_store_pageable_bytes, 0u);
  pool.wake_up();
}

TEST(HostTopologyPool, MemlockCountsOnlyWhereRegistrationIsChargedToIt) {
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_MEMLOCK, &old), 0);
  rlimit lower = old;
  lower.rlim_cur = 6 * MiB;
  if (old.rlim_max != RLIM_INFINITY && old.rlim_max < lower.rlim_cur) GTEST_SKIP() << "hard memlock limit too low";
  ASSERT_EQ(::setrlimit(RLIMIT_MEMLOCK, &lower), 0);
  struct Restore {
    rlimit r;
    ~Restore() { ::setrlimit(RLIMIT_MEMLOCK, &r); }
  } restore{old};
  FakeSys sys;  // no cgroup files
  ScopedEnv root("TORPOR_SYSFS_ROOT", sys.root().c_str());
  for (bool charged : {false, true}) {
    HostDriverOptions ho = HostBackend::options();
    ho.host_register_charged_to_memlock = charged;
    HostDriver d(ho);
    Pool pool(d, small_pool());
    std::vector<void*> ptrs;
    fill(pool, ptrs, 10);
    pool.sleep(1);
    pool.wait_host_store();
    PoolStats st = pool.stats();
    EXPECT_EQ(st.host_memlock_limit_bytes, 6 * MiB);
    EXPECT_EQ(st.host_memlock_charged, charged);
    if (charged) {
      EXPECT_EQ(st.host_store_budget_bytes, 6 * MiB);
      EXPECT_EQ(st.host_store_budget_source, "RLIMIT_MEMLOCK");
      EXPECT_LE(d.counters().registered_bytes, 6 * MiB);
      EXPECT_TRUE(st.host_store_capped);
    } else {
      EXPECT_EQ(st.host_store_budget_bytes, 0u) << "the CUDA driver's pinning is not charged to memlock";
      EXPECT_EQ(d.counters().registered_bytes, 10 * MiB);
    }
    pool.wake_up();
  }
}

}  // namespace
}  // namespace torpor::test
