// Across nodes (issue 29) on the host backend: "2 nodes x 2 ranks" as four processes in two
// emulated nodes (HostDriverOptions::node) that share no Unix socket and meet only over TCP
// (TcpGroup on loopback). The symmetric heap then shares memory as fabric handles (the host
// backend's emulation: pidfd_getfd of the exporter's memfd), sleeps and wakes collectively at
// level 2 with every peer mapping at its address, and a rank of the second node killed in the
// middle of a collective is named on every other rank. The fabric-refusal paths: no IMEX channel
// on one rank (named in the error, or the descriptor fallback within one node) and an import
// refused after the probe said yes.
//
// Oracles: the bytes each rank wrote through its peer mappings (a pattern of writer, owner and
// round, computed independently on the reader), the addresses recorded before sleep, the
// emulator's exact accounting, and the rank numbers the test itself killed or misconfigured.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>

#include <cstring>

#include "support/processes.hpp"
#include "torpor/backend.hpp"
#include "torpor/error.hpp"
#include "torpor/host_driver.hpp"
#include "torpor/symmetric.hpp"
#include "torpor/tcp_group.hpp"

namespace torpor::test {
namespace {

using namespace std::chrono_literals;
using Fabric = HostDriverOptions::Fabric;

HostDriverOptions node_options(int node, Fabric fabric = Fabric::on) {
  HostDriverOptions o;
  o.async = host_driver_options_from_env().async;
  o.devices = 2;  // one device per rank of a node
  o.device_bytes = std::size_t{128} << 20;
  o.granularity = std::size_t{64} << 10;
  o.multicast_attribute = false;
  o.node = node;
  o.fabric = fabric;
  return o;
}

PoolOptions pool_options(int device) {
  PoolOptions o;
  o.device = device;
  o.va_bytes = std::size_t{32} << 20;
  o.exportable = true;
  return o;
}

GroupOptions timeout(std::chrono::milliseconds t) {
  GroupOptions o;
  o.timeout = t;
  return o;
}

// A port nobody listens on right now (the kernel's choice for port 0), for rank 0 to take.
int free_port() {
  int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(s);
  return ntohs(a.sin_port);
}

TcpEndpoint loopback(int port) {
  TcpEndpoint e;
  e.host = "127.0.0.1";
  e.port = port;
  return e;
}

std::vector<std::uint8_t> pattern(int writer, int owner, int round, std::size_t n) {
  std::vector<std::uint8_t> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = static_cast<std::uint8_t>(writer * 37 + owner * 11 + round * 97 + i * 7 + 3);
  return v;
}

void* at(void* p, std::size_t off) { return static_cast<std::byte*>(p) + off; }

std::vector<std::uint8_t> read(Pool& pool, const void* p, std::size_t n) {
  std::vector<std::uint8_t> v(n);
  pool.copy(v.data(), p, n);
  return v;
}

void write_through_peers(Pool& pool, SymmetricBuffer& b, std::size_t slice, int round) {
  for (int p = 0; p < b.size(); ++p) {
    auto v = pattern(b.rank(), p, round, slice);
    pool.copy(at(b.peer(p), static_cast<std::size_t>(b.rank()) * slice), v.data(), slice);
  }
}

void check_own_part(Pool& pool, SymmetricBuffer& b, std::size_t slice, int round, const std::string& when) {
  for (int w = 0; w < b.size(); ++w)
    check(read(pool, at(b.local(), static_cast<std::size_t>(w) * slice), slice) == pattern(w, b.rank(), round, slice),
          when + ": rank " + std::to_string(b.rank()) + " holds the bytes rank " + std::to_string(w) + " wrote");
}

std::vector<void*> peer_addresses(const SymmetricBuffer& b) {
  std::vector<void*> a;
  for (int r = 0; r < b.size(); ++r) a.push_back(b.peer(r));
  return a;
}

std::vector<std::uint64_t> read_table(Pool& pool, const SymmetricBuffer& b) {
  std::vector<std::uint64_t> t(static_cast<std::size_t>(b.size()) + 1);
  pool.copy(t.data(), b.peer_table(), t.size() * sizeof(std::uint64_t));
  return t;
}

constexpr int nodes = 2;
constexpr int per_node = 2;
constexpr int world = nodes * per_node;

// ---------------------------------------------------------------------------------------------

TEST(TwoNodesTwoRanks, OneHeapOverTcpSleepsAndWakesAtLevel2WithEveryPeerAtItsAddress) {
  const int port = free_port();
  auto outcomes = run_ranks(
      world,
      [&](int r) {
        const int node = r / per_node;
        const int device = r % per_node;
        HostDriver host(node_options(node));
        TcpGroup group(loopback(port), r, world, timeout(20s));
        check(!group.carries_fds(), "a TCP group carries no descriptors");
        Pool pool(host, pool_options(device));
        SymmetricHeap heap(pool, group);
        check(heap.handle_kind() == HandleKind::fabric, "parts travel as fabric handles across nodes");
        check(heap.nodes() == nodes, "the heap sees two nodes");
        const std::size_t slice = 4096;
        SymmetricBuffer& slots = heap.allocate(world * slice, {"weights", "tail.slots", false});
        SymmetricBuffer& kv = heap.allocate(100000 + world * slice, {"kv_cache", "kv", false});
        for (SymmetricBuffer* b : {&slots, &kv}) {
          auto t = read_table(pool, *b);
          for (int q = 0; q < world; ++q)
            check(t[static_cast<std::size_t>(q)] == reinterpret_cast<std::uint64_t>(b->peer(q)), "peer table entry");
          write_through_peers(pool, *b, slice, 1);
        }
        group.barrier();
        check_own_part(pool, slots, slice, 1, "before sleep");
        check_own_part(pool, kv, slice, 1, "before sleep");
        const auto slots_at = peer_addresses(slots), kv_at = peer_addresses(kv);

        pool.sleep(2);
        group.barrier();  // every rank asleep: no import keeps anyone's memory alive
        check(host.live_physical_bytes(device) == 0, "zero live physical bytes while every rank sleeps");
        auto c = host.counters();
        check(c.live_handles == 0 && c.mapped_bytes == 0, "this process holds no handle and maps nothing asleep");
        check(!slots.peers_mapped() && !kv.peers_mapped(), "no peer mapping while asleep");
        group.barrier();

        pool.wake_up({"weights"});
        check(slots.peers_mapped() && !kv.peers_mapped(), "weights re-imported first, kv_cache still asleep");
        pool.wake_up({"kv_cache"});
        check(peer_addresses(slots) == slots_at && peer_addresses(kv) == kv_at, "every peer address unchanged");
        for (SymmetricBuffer* b : {&slots, &kv}) {
          check_own_part(pool, *b, slice, 1, "after wake");
          for (int p = 0; p < world; ++p)
            check(read(pool, at(b->peer(p), static_cast<std::size_t>(r) * slice), slice) == pattern(r, p, 1, slice),
                  "rank " + std::to_string(p) + "'s part read back through its mapping after wake");
        }
        group.barrier();
        for (SymmetricBuffer* b : {&slots, &kv}) write_through_peers(pool, *b, slice, 2);
        group.barrier();
        check_own_part(pool, slots, slice, 2, "new writes after wake");
        check_own_part(pool, kv, slice, 2, "new writes after wake");
        group.barrier();
      },
      60s);
  EXPECT_EQ(failures(outcomes), "");
}

TEST(TwoNodesTwoRanks, ARankOfTheSecondNodeKilledMidCollectiveIsNamedOnEveryOtherRank) {
  const int port = free_port();
  constexpr int victim = 3;  // node 1, local rank 1
  auto outcomes = run_ranks(
      world,
      [&](int r) {
        HostDriver host(node_options(r / per_node));
        TcpGroup group(loopback(port), r, world, timeout(20s));
        Pool pool(host, pool_options(r % per_node));
        SymmetricHeap heap(pool, group);
        heap.allocate(world * 4096, {"weights", "slots", false});
        group.barrier();
        if (r == victim) {
          // In the collective sleep's agreement: the others are waiting for this rank.
          std::this_thread::sleep_for(200ms);
          ::raise(SIGKILL);
        }
        try {
          pool.sleep(2);
        } catch (const group_rank_left& e) {
          check(e.ranks() == std::vector<int>{victim}, std::string("the departed rank is named: ") + e.what());
          check(std::string(e.what()).find("rank 3") != std::string::npos, std::string("message: ") + e.what());
          report("named");
          return;
        }
        throw std::runtime_error("the collective sleep went on without rank 3");
      },
      60s);
  for (int r = 0; r < world; ++r) {
    if (r == victim) {
      EXPECT_NE(outcomes[static_cast<std::size_t>(r)].exit_code, 0) << "rank 3 was killed";
      continue;
    }
    EXPECT_EQ(outcomes[static_cast<std::size_t>(r)].exit_code, 0) << outcomes[static_cast<std::size_t>(r)].report;
    EXPECT_NE(outcomes[static_cast<std::size_t>(r)].report.find("named"), std::string::npos);
  }
}

// No IMEX channel on one rank of a group that carries only bytes: nothing can carry memory, and
// every rank's error names that rank and the cause.
TEST(FabricRefusal, NoImexChannelOnOneRankOfATcpGroupIsNamedOnEveryRank) {
  const int port = free_port();
  auto outcomes = run_ranks(3, [&](int r) {
    HostDriver host(node_options(0, r == 1 ? Fabric::no_channel : Fabric::on));
    TcpGroup group(loopback(port), r, 3, timeout(20s));
    Pool pool(host, pool_options(r % 2));
    try {
      SymmetricHeap heap(pool, group);
    } catch (const invalid_argument& e) {
      const std::string m = e.what();
      check(m.find("rank 1") != std::string::npos && m.find("no IMEX channel") != std::string::npos &&
                m.find("carries only bytes") != std::string::npos && m.find("rank 0 (") == std::string::npos,
            "the error names rank 1 alone and the cause: " + m);
      group.barrier();  // the group itself is still usable
      return;
    }
    throw std::runtime_error("a heap was built without a way to share memory");
  });
  EXPECT_EQ(failures(outcomes), "");
}

// Within one node over a Unix group, a rank without fabric takes the descriptor path: nothing
// depends on the IMEX service there.
TEST(FabricRefusal, WithinOneNodeTheDescriptorFallbackIsTaken) {
  Rendezvous rv = Rendezvous::create();
  auto outcomes = run_ranks(2, [&](int r) {
    HostDriver host(node_options(0, r == 1 ? Fabric::no_channel : Fabric::on));
    UnixSocketGroup group(rv, r, 2, timeout(20s));
    Pool pool(host, pool_options(r));
    SymmetricHeap heap(pool, group);
    check(heap.handle_kind() == HandleKind::posix_fd, "descriptors within one node");
    SymmetricBuffer& b = heap.allocate(2 * 4096, {"weights", "slots", false});
    write_through_peers(pool, b, 4096, 1);
    group.barrier();
    check_own_part(pool, b, 4096, 1, "through descriptors");
    group.barrier();
  });
  rv.remove();
  EXPECT_EQ(failures(outcomes), "");
}

// Across nodes with one rank whose imports are refused after its probe said yes: the allocation
// fails on every rank naming that rank and the driver's words, and leaves nothing behind.
TEST(FabricRefusal, AnImportRefusedOnOneNodeFailsTheAllocationEverywhereAndLeavesNothing) {
  const int port = free_port();
  auto outcomes = run_ranks(2, [&](int r) {
    HostDriver host(node_options(r, r == 1 ? Fabric::import_refused : Fabric::on));
    TcpGroup group(loopback(port), r, 2, timeout(20s));
    Pool pool(host, pool_options(0));
    SymmetricHeap heap(pool, group);
    check(heap.handle_kind() == HandleKind::fabric, "fabric across nodes");
    const HostDriverCounters before = host.counters();
    try {
      heap.allocate(2 * 4096, {"weights", "slots", false});
    } catch (const std::exception& e) {
      const std::string m = e.what();
      check(r == 1 ? m.find("not permitted") != std::string::npos && m.find("rank 0's part") != std::string::npos
                   : m.find("failed on rank(s) [1]") != std::string::npos,
            "the failing rank is named, and there the driver's words: " + m);
      check(heap.buffers().empty(), "no buffer left");
      check(pool.stats().allocations == 0, "the failed allocation freed its part and its table");
      pool.trim();  // the table's empty slab is cached for the fast path; give it back too
      const HostDriverCounters after = host.counters();
      check(host.live_physical_bytes(0) == 0 && after.live_handles == before.live_handles &&
                after.mappings == before.mappings,
            "no memory, import or mapping left behind");
      group.barrier();
      return;
    }
    throw std::runtime_error("the allocation succeeded with an import refused");
  });
  EXPECT_EQ(failures(outcomes), "");
}

// ---------------------------------------------------------------------------------------------
// TcpGroup itself

TEST(TcpGroup, AllGatherOverLoopbackAndAMissingRankIsNamedByTheTimeout) {
  const int port = free_port();
  auto outcomes = run_ranks(3, [&](int r) {
    TcpGroup group(loopback(port), r, 3, timeout(1500ms));
    // Large enough to take several frames.
    std::vector<std::byte> mine(100000, static_cast<std::byte>(r + 1));
    auto all = group.all_gather(mine);
    check(all.size() == 3, "one entry per rank");
    for (int q = 0; q < 3; ++q)
      check(all[static_cast<std::size_t>(q)] == std::vector<std::byte>(100000, static_cast<std::byte>(q + 1)),
            "rank " + std::to_string(q) + "'s bytes");
    bool refused = false;
    try {
      int fd = 0;
      group.all_gather_fds(std::span(&fd, 1));
    } catch (const invalid_state&) {
      refused = true;
    }
    check(refused, "descriptors are refused over TCP");
    if (r == 2) {
      std::this_thread::sleep_for(2500ms);  // misses the barrier below
      try {
        group.barrier();
      } catch (const error&) {
        // Late (group_timeout at once), or rank 0 already gone: either way not a hang.
      }
      return;
    }
    try {
      group.barrier();
    } catch (const group_timeout& e) {
      check(e.missing() == std::vector<int>{2}, std::string("rank 2 is named: ") + e.what());
      return;
    }
    throw std::runtime_error("the barrier completed without rank 2");
  });
  EXPECT_EQ(failures(outcomes), "");
}

// Every rank's reply holds every rank's 16 MiB: far more than a loopback socket buffers, so the
// hub must wait for each rank to read its reply (bounded by the send timeout) rather than give
// the rank up when the socket's buffer is full. Oracle: each rank's bytes are a pattern of that
// rank alone, checked in full on every rank.
TEST(TcpGroup, AnAllGatherLargerThanTheSocketBuffersReachesEveryRank) {
  const int port = free_port();
  constexpr std::size_t bytes = std::size_t{16} << 20;
  auto outcomes = run_ranks(3, [&](int r) {
    TcpGroup group(loopback(port), r, 3, timeout(20s));
    const std::vector<std::uint8_t> mine = pattern(r, r, 0, bytes);
    auto all = group.all_gather(std::as_bytes(std::span(mine)));
    check(all.size() == 3, "one entry per rank");
    for (int q = 0; q < 3; ++q) {
      const std::vector<std::uint8_t> theirs = pattern(q, q, 0, bytes);
      const auto& got = all[static_cast<std::size_t>(q)];
      check(got.size() == bytes && std::memcmp(got.data(), theirs.data(), bytes) == 0,
            "rank " + std::to_string(q) + "'s 16 MiB arrived intact");
    }
    group.barrier();
  });
  EXPECT_EQ(failures(outcomes), "");
}

TEST(TcpGroup, RangeChecksItsArgumentsAndTheLauncherEnvironment) {
  EXPECT_THROW(TcpGroup(loopback(1234), 3, 3), invalid_argument);
  EXPECT_THROW(TcpGroup(loopback(0), 1, 2), invalid_argument);  // port 0 only on rank 0
  EXPECT_THROW(TcpGroup(loopback(70000), 0, 1), invalid_argument);
  TcpEndpoint bad = loopback(0);
  bad.secret = "short";
  EXPECT_THROW(TcpGroup(bad, 0, 1), invalid_argument);
  {
    TcpGroup alone(loopback(0), 0, 1, timeout(5s));
    EXPECT_GT(alone.port(), 0);
    EXPECT_EQ(alone.all_gather(std::vector<std::byte>(3)).size(), 1u);
  }

  ::unsetenv("MASTER_ADDR");
  ::setenv("MASTER_PORT", "29500", 1);
  ::setenv("RANK", "1", 1);
  ::setenv("WORLD_SIZE", "4", 1);
  ::setenv("LOCAL_WORLD_SIZE", "2", 1);
  ::setenv("LOCAL_RANK", "1", 1);
  try {
    tcp_group_from_env();
    ADD_FAILURE() << "no MASTER_ADDR";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("MASTER_ADDR"), std::string::npos) << e.what();
  }
  auto layout = launcher_layout_from_env();
  ASSERT_TRUE(layout);
  EXPECT_EQ(layout->node(), 0);
  EXPECT_EQ(layout->nodes(), 2);
  ::setenv("LOCAL_RANK", "0", 1);  // rank 1 of nodes of 2 is local rank 1
  EXPECT_THROW(launcher_layout_from_env(), invalid_argument);
  ::setenv("LOCAL_WORLD_SIZE", "3", 1);  // 4 ranks are not whole nodes of 3
  EXPECT_THROW(launcher_layout_from_env(), invalid_argument);
  for (const char* v : {"MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK"}) ::unsetenv(v);
}

// The host backend's fabric emulation by itself: a handle made in one process is imported in
// another through the 64 bytes alone; once the exporter released its handle the bytes name
// nothing, and the import says so.
TEST(HostFabric, SixtyFourBytesCarryMemoryToAnotherProcessAndNothingOnceReleased) {
  int to_child[2], to_parent[2];
  ASSERT_EQ(::pipe(to_child), 0);
  ASSERT_EQ(::pipe(to_parent), 0);
  HostDriver host(node_options(0));
  const std::size_t bytes = host.options().granularity;
  PhysicalHandle h = host.create(0, bytes, true);
  const device_ptr va = host.reserve(bytes, bytes);
  host.map(va, bytes, h, 0);
  int dev = 0;
  host.set_access(va, bytes, std::span(&dev, 1));
  std::memset(reinterpret_cast<void*>(va), 0x5a, bytes);
  FabricHandle blob = host.export_fabric(h);
  EXPECT_TRUE(host.probe_fabric(0).supported());
  std::fflush(nullptr);
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    int code = 0;
    try {
      HostDriver other(node_options(1));
      FabricHandle got;
      if (::read(to_child[0], got.bytes.data(), got.bytes.size()) != 64) ::_exit(10);
      PhysicalHandle imported = other.import_fabric(got, bytes);
      const device_ptr v = other.reserve(bytes, bytes);
      other.map(v, bytes, imported, 0);
      other.set_access(v, bytes, std::span(&dev, 1));
      code = static_cast<unsigned char*>(reinterpret_cast<void*>(v))[bytes - 1] == 0x5a ? 0 : 11;
      other.unmap(v, bytes);
      other.release(imported);
      other.free_reservation(v, bytes);
      char c = 1;
      (void)!::write(to_parent[1], &c, 1);  // imported; now the parent releases
      if (::read(to_child[0], &c, 1) != 1) ::_exit(12);
      try {
        other.import_fabric(got, bytes);
        code = code == 0 ? 13 : code;
      } catch (const driver_error& e) {
        if (std::string(e.what()).find("released") == std::string::npos) code = 14;
      }
      try {
        FabricHandle junk = got;
        junk.bytes[0] = std::byte{0};
        other.import_fabric(junk, bytes);
        code = code == 0 ? 15 : code;
      } catch (const driver_error&) {
      }
    } catch (...) {
      code = 20;
    }
    ::_exit(code);
  }
  ASSERT_EQ(::write(to_child[1], blob.bytes.data(), blob.bytes.size()), 64);
  char c = 0;
  ASSERT_EQ(::read(to_parent[0], &c, 1), 1);
  host.unmap(va, bytes);
  host.release(h);
  host.free_reservation(va, bytes);
  ASSERT_EQ(::write(to_child[1], &c, 1), 1);
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "child step failed (see the codes in the test)";
  for (int fd : {to_child[0], to_child[1], to_parent[0], to_parent[1]}) ::close(fd);
}

TEST(HostFabric, TheInjectedImexFailuresAnswerAsARealDriverDoes) {
  HostDriver none(node_options(0, Fabric::no_channel));
  FabricProbe p = none.probe_fabric(0);
  EXPECT_EQ(p.cause, FabricProbe::Cause::no_imex_channel);
  EXPECT_EQ(p.code, static_cast<int>(driver_status::not_permitted));
  EXPECT_NE(p.describe().find("nvidia-caps-imex-channels"), std::string::npos) << p.describe();
  PhysicalHandle h = none.create(0, none.options().granularity, true);
  try {
    none.export_fabric(h);
    ADD_FAILURE() << "export without an IMEX channel";
  } catch (const driver_error& e) {
    EXPECT_EQ(e.code(), static_cast<int>(driver_status::not_permitted));
  }
  none.release(h);
  HostDriver off(node_options(0, Fabric::off));
  EXPECT_EQ(off.probe_fabric(0).cause, FabricProbe::Cause::device_without_fabric);
  EXPECT_FALSE(off.device_properties(0).fabric_handles_supported);
  EXPECT_NE(HostDriver(node_options(0)).node_name(), HostDriver(node_options(1)).node_name());
}

}  // namespace
}  // namespace torpor::test
