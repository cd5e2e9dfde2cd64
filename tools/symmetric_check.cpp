// `torpor symmetric-check`: symmetric memory across processes, one per device, end to end.
//
// The parent makes a rendezvous and starts --ranks copies of this program (one process per
// device, the vLLM layout), then prints one row per rank. Every rank allocates one symmetric
// buffer, writes its slice of every rank's buffer through its peer mappings (a device-to-device
// copy into the peer-mapped address: NVLink on a GPU machine), sleeps at level 2 together with the
// others, measures the device memory returned (cuMemGetInfo on cuda), wakes, and checks that every
// address is unchanged and every byte is as written (own part, and read back through every peer
// mapping). Multicast is never requested: the group's decision is reported only (no multicast
// call is made to reach it).
//
// --group nccl carries the bytes over NCCL (NcclGroup; fds still over the Unix socket);
// --timeout-check adds a phase where the last rank stays away from a barrier: the others must
// time out naming it, then every rank recovers and the group works again.
//
// On the cuda backend it needs one device per rank with peer access (and libnccl for --group
// nccl); otherwise it prints SKIP and the reason, and exits 0 (but a TORPOR_NCCL_LIBRARY that
// does not load is an error: the user named it). The host backend runs it anywhere
// (CI smoke test).
#include "symmetric_check.hpp"

#include <fmt/core.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>
#include <thread>

#include "commands.hpp"
#include "common/options.hpp"
#include "launch/launch.hpp"
#include "output.hpp"
#include "ranks/multicast.hpp"
#include "torpor/backend.hpp"
#include "torpor/error.hpp"
#include "torpor/group.hpp"
#include "torpor/nccl_group.hpp"
#include "torpor/pool.hpp"
#include "torpor/symmetric.hpp"

namespace torpor::cli {

namespace {

using clock_type = std::chrono::steady_clock;
double since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }

std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The bytes `writer` puts into `owner`'s buffer: 64-bit words, distinct per (writer, owner, word).
void fill_pattern(std::uint64_t* out, std::size_t words, std::size_t first_word, int writer, int owner) {
  std::uint64_t seed = mix(static_cast<std::uint64_t>(writer) * 1000003u + static_cast<std::uint64_t>(owner) + 1);
  for (std::size_t i = 0; i < words; ++i) out[i] = mix(seed ^ (first_word + i));
}

// Compares `bytes` of device memory at `src` with the pattern, through a host staging buffer.
bool matches(Pool& pool, const void* src, std::size_t bytes, int writer, int owner, std::uint64_t* stage,
             std::size_t stage_bytes, std::vector<std::uint64_t>& expect) {
  for (std::size_t off = 0; off < bytes; off += stage_bytes) {
    std::size_t n = std::min(stage_bytes, bytes - off);
    pool.copy(stage, static_cast<const std::byte*>(src) + off, n);
    expect.resize(n / 8);
    fill_pattern(expect.data(), n / 8, off / 8, writer, owner);
    if (std::memcmp(stage, expect.data(), n) != 0) return false;
  }
  return true;
}

GroupOptions group_options(const SymmetricCheckOptions& o) {
  GroupOptions go;
  go.timeout = o.timeout.value;
  return go;
}

// A host staging buffer and the pattern scratch that check a rank's bytes.
struct Staging {
  std::uint64_t* stage = nullptr;
  std::size_t bytes = 0;
  std::vector<std::uint64_t> expect;
};

// Peer writes: fill the scratch slice (on this device) for each owner, then copy it into the
// owner's part through the peer mapping: a device-to-device copy over the link. Returns the
// seconds the peer copies took.
double write_peer_slices(Pool& pool, SymmetricBuffer& buf, void* scratch, std::size_t slice, int rank, int n,
                         Staging& st) {
  double copy_seconds = 0;
  for (int p = 0; p < n; ++p) {
    for (std::size_t off = 0; off < slice; off += st.bytes) {
      std::size_t k = std::min(st.bytes, slice - off);
      fill_pattern(st.stage, k / 8, off / 8, rank, p);
      pool.copy(static_cast<std::byte*>(scratch) + off, st.stage, k);
    }
    auto t = clock_type::now();
    pool.copy(static_cast<std::byte*>(buf.peer(p)) + static_cast<std::size_t>(rank) * slice, scratch, slice);
    if (p != rank) copy_seconds += since(t);
  }
  return copy_seconds;
}

// Every address of the buffer: own part, peer table, each rank's part.
struct Addresses {
  void* local = nullptr;
  void* table = nullptr;
  std::vector<void*> peers;
  bool operator==(const Addresses&) const = default;
};

Addresses addresses_of(const SymmetricBuffer& buf, int n) {
  Addresses a{buf.local(), buf.peer_table(), {}};
  a.peers.reserve(static_cast<std::size_t>(n));
  for (int p = 0; p < n; ++p) a.peers.push_back(buf.peer(p));
  return a;
}

// The peer table in device memory holds every rank's address.
bool table_matches(Pool& pool, const SymmetricBuffer& buf, int n) {
  std::vector<std::uint64_t> table(static_cast<std::size_t>(n) + 1);
  pool.copy(table.data(), buf.peer_table(), table.size() * 8);
  for (int p = 0; p < n; ++p)
    if (table[static_cast<std::size_t>(p)] != reinterpret_cast<std::uint64_t>(buf.peer(p))) return false;
  return true;
}

// What the level-2 sleep and the wake returned and took.
struct SleepMeasure {
  std::size_t free_before = 0, free_asleep = 0;
  std::size_t released_by_pool = 0;
  double sleep_seconds = 0, wake_seconds = 0;
};

SleepMeasure sleep_and_wake(Pool& pool, Group& group, Driver& driver, int device) {
  SleepMeasure m;
  m.free_before = driver.memory_info(device).free_bytes;
  auto t_sleep = clock_type::now();
  TransitionReport sr = pool.sleep(2);
  m.sleep_seconds = since(t_sleep);
  m.released_by_pool = sr.bytes_released;
  group.barrier();  // every rank asleep, every import gone
  m.free_asleep = driver.memory_info(device).free_bytes;
  group.barrier();
  auto t_wake = clock_type::now();
  pool.wake_up();
  m.wake_seconds = since(t_wake);
  return m;
}

// Optional: the last rank stays away from one barrier; the others must time out naming it,
// then every rank recovers the group and it works again.
std::string timeout_phase(const SymmetricCheckOptions& o, Group& group) {
  const int rank = group.rank(), n = group.size();
  std::string result = "not run";
  if (!o.timeout_check || n <= 1) return result;
  const auto t = o.timeout.value;
  if (rank == n - 1) {
    // Long enough for the others to give up (NCCL: its timeout, then the bootstrap's).
    std::this_thread::sleep_for(o.group == "nccl" ? t * 5 / 2 : t * 3 / 2);
    result = "absent on purpose";
  } else {
    try {
      group.barrier();
      result = "FAIL: the barrier returned without the last rank";
    } catch (const group_timeout& e) {
      result = e.missing() == std::vector<int>{n - 1}
                   ? fmt::format("ok: rank {} named", n - 1)
                   : fmt::format("FAIL: named {}: {}", format_ranks(e.missing()), e.what());
    }
  }
  group.recover();
  group.barrier();
  if (result.rfind("FAIL", 0) != 0) result += ", recovered";
  return result;
}

// One rank's check (a RankBody for launch/launch.hpp): the result row the parent prints.
nlohmann::json check_rank(const SymmetricCheckOptions& o, Driver& driver, Group& bootstrap, int device) {
  std::unique_ptr<Group> nccl;
  Group* group = &bootstrap;
  if (o.group == "nccl") {
    nccl = std::make_unique<NcclGroup>(bootstrap, driver, bootstrap.rank(), group_options(o));
    group = nccl.get();
  }
  const int rank = group->rank(), n = group->size();
  const std::size_t bytes = parse_size(o.bytes);

  PoolOptions po;
  po.device = device;
  po.exportable = true;
  Pool pool(driver, po);
  SymmetricHeap heap(pool, *group);
  MulticastDecision decision = decide_multicast(*group, driver, device);
  SymmetricBuffer& buf = heap.allocate(bytes, {tags::weights, "symmetric-check", false});
  const std::size_t slice = buf.part_bytes() / static_cast<std::size_t>(n) / 8 * 8;
  Staging st;
  st.bytes = std::min<std::size_t>(slice, std::size_t{64} << 20);
  st.stage = static_cast<std::uint64_t*>(driver.host_alloc(st.bytes));
  void* scratch = pool.allocate(slice, {"scratch", MemoryClass::cache, "source"});

  const double copy_seconds = write_peer_slices(pool, buf, scratch, slice, rank, n, st);
  group->barrier();
  const Addresses before = addresses_of(buf, n);
  const SleepMeasure m = sleep_and_wake(pool, *group, driver, device);
  const bool addresses = addresses_of(buf, n) == before && table_matches(pool, buf, n);

  bool own_ok = true, peers_ok = true;
  for (int w = 0; w < n; ++w)
    own_ok = own_ok && matches(pool, static_cast<std::byte*>(buf.local()) + static_cast<std::size_t>(w) * slice, slice,
                               w, rank, st.stage, st.bytes, st.expect);
  for (int p = 0; p < n; ++p)
    peers_ok = peers_ok && matches(pool, static_cast<std::byte*>(buf.peer(p)) + static_cast<std::size_t>(rank) * slice,
                                   slice, rank, p, st.stage, st.bytes, st.expect);
  group->barrier();
  driver.host_free(st.stage);
  pool.deallocate(scratch);

  const std::string timeout_result = timeout_phase(o, *group);
  std::size_t returned = m.free_asleep > m.free_before ? m.free_asleep - m.free_before : 0;
  bool memory_ok = returned >= buf.part_bytes();
  nlohmann::json j = {{"rank", rank},
                      {"device", device},
                      {"device_name", driver.device_properties(device).name},
                      {"backend", std::string(driver.backend_name())},
                      {"part_bytes", buf.part_bytes()},
                      {"peer_copy_bytes", slice * static_cast<std::size_t>(n - 1)},
                      {"peer_copy_seconds", copy_seconds},
                      {"free_before", m.free_before},
                      {"free_asleep", m.free_asleep},
                      {"returned", returned},
                      {"released_by_pool", m.released_by_pool},
                      {"sleep_seconds", m.sleep_seconds},
                      {"wake_seconds", m.wake_seconds},
                      {"memory_returned", memory_ok},
                      {"addresses_unchanged", addresses},
                      {"own_bytes_intact", own_ok},
                      {"peer_bytes_intact", peers_ok},
                      {"group", std::string(group->kind())},
                      {"group_timeout_ms", group->timeout().count()},
                      {"timeout_check", timeout_result},
                      {"multicast", decision.use ? std::string("used") : "not used: " + decision.reason}};
  group->barrier();
  return j;
}

// Whether a rank's row passes every check.
bool row_passes(const nlohmann::json& j) {
  return j.value("memory_returned", false) && j.value("addresses_unchanged", false) &&
         j.value("own_bytes_intact", false) && j.value("peer_bytes_intact", false) &&
         j.value("timeout_check", std::string("FAIL")).rfind("FAIL", 0) != 0;
}

// Why this machine cannot run the check on `backend`, or "". The emulated (host-memory) backend
// runs it anywhere but cannot carry NCCL; a device backend needs a device per rank, peer access
// and POSIX fd handles.
std::string skip_reason(const SymmetricCheckOptions& o) {
  const Backend requested = parse_backend(o.backend);
  DriverSelection sel;
  try {
    sel = open_driver(requested);
  } catch (const std::exception& e) {
    return e.what();
  }
  const DriverCapabilities caps = sel.driver->capabilities();
  if (o.group == "nccl") {
    // A library the user named must load, whatever this machine has: a wrong path is their
    // mistake to hear about, not a reason to skip (issue 33 N20).
    if (auto named = options::raw(options::id::nccl_library))
      if (std::string why; !NcclGroup::available(&why))
        throw invalid_argument(fmt::format("TORPOR_NCCL_LIBRARY={}: {}", *named, why));
    // NCCL runs on the CUDA runtime: the driver must make a device current for it.
    if (!caps.make_current)
      return sel.reason.starts_with("requested") ? "the nccl group needs the cuda backend"
                                                 : "no usable GPU for the nccl group: " + sel.reason;
    if (std::string why; !NcclGroup::available(&why)) return why;
  }
  if (caps.host_memory) return "";
  Driver& d = *sel.driver;
  int count = d.device_count();
  if (count < o.ranks) return fmt::format("needs {} GPUs (one per rank), this machine has {}", o.ranks, count);
  for (int a = 0; a < o.ranks; ++a)
    for (int b2 = 0; b2 < o.ranks; ++b2)
      if (a != b2 && !d.can_access_peer(a, b2))
        return fmt::format("GPU {} cannot access GPU {} (no peer access)", a, b2);
  if (!d.device_properties(0).posix_fd_handles_supported) return "GPU 0 cannot export memory as POSIX fds";
  return "";
}

int parent(const SymmetricCheckOptions& o) {
  if (o.ranks < 1) throw invalid_argument("--ranks must be at least 1");
  if (parse_size(o.bytes) == 0) throw invalid_argument("--bytes 0: use a size of at least one byte");
  if (std::string why = skip_reason(o); !why.empty()) {
    fmt::print("SKIP: symmetric-check on {} ranks: {}\n", o.ranks, why);
    return 0;
  }
  // One process per device (the vLLM layout), through the CLI's rank launcher: this program
  // again with --worker, the group from the environment, one JSON row back per rank.
  LaunchOptions lo;
  lo.ranks = o.ranks;
  lo.processes = true;
  lo.nodes = o.nodes;
  if (o.nodes > 1 && o.group != "unix")
    throw invalid_argument("--nodes: the ranks of several nodes meet over TCP; leave --group at unix");
  lo.backend = parse_backend(o.backend);
  lo.group = group_options(o);
  lo.worker_args = {"symmetric-check", "--worker", "--ranks", std::to_string(o.ranks), "--bytes", o.bytes, "--backend",
                    o.backend,         "--group",  o.group};
  auto t = o.timeout.worker_args();
  lo.worker_args.insert(lo.worker_args.end(), t.begin(), t.end());
  if (o.timeout_check) lo.worker_args.emplace_back("--timeout-check");
  lo.deadline = std::chrono::ceil<std::chrono::seconds>(o.timeout.value) + std::chrono::seconds(60);
  const LaunchResult launched =
      launch(lo, [&](Driver& d, Group& g, int device) { return check_rank(o, d, g, device); });

  nlohmann::json all = nlohmann::json::array();
  bool ok = true;
  fmt::print("{:>4} {:>6} {:>10} {:>11} {:>12} {:>12} {:>12} {:>8} {:>8} {:>9} {:>6} {:>6}\n", "rank", "device", "part",
             "peer GB/s", "free before", "free asleep", "returned", "sleep s", "wake s", "addresses", "own", "peers");
  std::string multicast;
  for (const RankOutcome& out : launched.ranks) {
    const int r = out.rank;
    if (!out.ok || !out.result.is_object()) {
      fmt::print("{:>4} FAILED: {}\n", r, out.error.empty() ? std::string("no result") : out.error);
      ok = false;
      continue;
    }
    const nlohmann::json& j = out.result;
    all.push_back(j);
    double gbs =
        j["peer_copy_seconds"].get<double>() > 0
            ? static_cast<double>(j["peer_copy_bytes"].get<std::size_t>()) / j["peer_copy_seconds"].get<double>() / 1e9
            : 0.0;
    auto yes = [](bool b) { return b ? "ok" : "FAIL"; };
    fmt::print("{:>4} {:>6} {:>10} {:>11.1f} {:>12} {:>12} {:>12} {:>8.3f} {:>8.3f} {:>9} {:>6} {:>6}\n", r,
               j["device"].get<int>(), format_bytes(j["part_bytes"].get<std::size_t>()), gbs,
               format_bytes(j["free_before"].get<std::size_t>()), format_bytes(j["free_asleep"].get<std::size_t>()),
               format_bytes(j["returned"].get<std::size_t>()), j["sleep_seconds"].get<double>(),
               j["wake_seconds"].get<double>(), yes(j["addresses_unchanged"].get<bool>()),
               yes(j["own_bytes_intact"].get<bool>()), yes(j["peer_bytes_intact"].get<bool>()));
    if (!j["memory_returned"].get<bool>()) fmt::print("     rank {}: less memory returned than its part\n", r);
    ok = ok && row_passes(j);
    multicast = j["multicast"].get<std::string>();
  }
  fmt::print("multicast: {}\n", multicast);
  for (const auto& j : all)
    if (j["timeout_check"].get<std::string>() != "not run")
      fmt::print("timeout check ({} group), rank {}: {}\n", j["group"].get<std::string>(), j["rank"].get<int>(),
                 j["timeout_check"].get<std::string>());
  fmt::print("{}\n",
             ok ? "PASS: every rank's memory returned while asleep; addresses and bytes intact after wake" : "FAIL");
  const bool written =
      o.json.empty() || write_json_file(o.json, nlohmann::json{{"ranks", all}, {"pass", ok}}, "symmetric-check");
  return ok && written ? 0 : 1;
}

}  // namespace

int run_symmetric_check(const SymmetricCheckOptions& o) {
  if (!o.worker) return parent(o);
  return run_worker(parse_backend(o.backend), group_options(o),
                    [&o](Driver& d, Group& g, int device) { return check_rank(o, d, g, device); });
}

}  // namespace torpor::cli
