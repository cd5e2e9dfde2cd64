// Host topology and the page-locked budget; the design note is in host_topology.hpp.
#include "pool/store/host_topology.hpp"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <fstream>
#include <limits>

namespace torpor {

namespace {

std::optional<std::string> first_line(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  if (!f || !std::getline(f, line)) return std::nullopt;
  while (!line.empty() && std::isspace(static_cast<unsigned char>(line.back()))) line.pop_back();
  return line;
}

std::optional<long long> whole(std::string_view text) {
  long long v = 0;
  auto [at, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || at != text.data() + text.size()) return std::nullopt;
  return v;
}

std::string join(std::string_view root, std::string_view rest) {
  std::string out(root.empty() ? "/sys" : root);
  while (out.size() > 1 && out.back() == '/') out.pop_back();
  out += rest;
  return out;
}

// A bus id as sysfs names it: lower case, with the PCI domain ("3B:00.0" -> "0000:3b:00.0").
std::string sysfs_bus_id(std::string_view bus_id) {
  std::string id(bus_id);
  std::transform(id.begin(), id.end(), id.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (std::count(id.begin(), id.end(), ':') == 1) id = "0000:" + id;
  return id;
}

// `key`'s value in a memory.stat file ("key value" lines), 0 when missing.
std::size_t stat_value(const std::string& path, std::string_view key) {
  std::ifstream f(path);
  std::string k;
  unsigned long long v = 0;
  while (f >> k >> v)
    if (k == key) return static_cast<std::size_t>(v);
  return 0;
}

// v1 reports "no limit" as PAGE_COUNTER_MAX pages, just under 2^63.
constexpr std::size_t unlimited_threshold = std::size_t{1} << 62;

}  // namespace

int pci_numa_node(std::string_view sys_root, std::string_view bus_id) {
  if (bus_id.empty()) return -1;
  const std::string id = sysfs_bus_id(bus_id);
  if (id.find('/') != std::string::npos || id.find("..") != std::string::npos) return -1;
  auto line = first_line(join(sys_root, "/bus/pci/devices/" + id + "/numa_node"));
  if (!line) return -1;
  auto v = whole(*line);
  return v && *v >= 0 && *v < 1024 ? static_cast<int>(*v) : -1;
}

int numa_nodes_online(std::string_view sys_root) {
  auto line = first_line(join(sys_root, "/devices/system/node/online"));
  if (!line || line->empty()) return 1;
  int count = 0;
  std::string_view rest = *line;
  while (!rest.empty()) {
    std::size_t comma = rest.find(',');
    std::string_view item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    std::size_t dash = item.find('-');
    auto lo = whole(item.substr(0, dash));
    auto hi = dash == std::string_view::npos ? lo : whole(item.substr(dash + 1));
    if (!lo || !hi || *hi < *lo || *hi - *lo > 1024) return 1;
    count += static_cast<int>(*hi - *lo + 1);
  }
  return std::max(count, 1);
}

NumaPlacement numa_placement(std::string_view sys_root, std::string_view bus_id) {
  NumaPlacement p;
  p.nodes_online = numa_nodes_online(sys_root);
  if (p.nodes_online <= 1) {
    p.reason = "one NUMA node: no placement";
    return p;
  }
  if (bus_id.empty()) {
    p.reason = "the driver gives no PCI bus id for the device: first-touch placement";
    return p;
  }
  p.node = pci_numa_node(sys_root, bus_id);
  p.reason = p.node < 0
                 ? "the device's NUMA node is unknown (" + std::string(bus_id) + "): first-touch placement"
                 : "preferred node " + std::to_string(p.node) + " (the device's, PCI " + std::string(bus_id) + ")";
  return p;
}

bool prefer_numa_node(void* p, std::size_t bytes, int node) noexcept {
#ifdef SYS_mbind
  if (node < 0 || node >= 1024) return false;
  std::array<unsigned long, 1024 / (8 * sizeof(unsigned long))> mask{};
  mask[static_cast<std::size_t>(node) / (8 * sizeof(unsigned long))] |=
      1UL << (static_cast<unsigned>(node) % (8 * sizeof(unsigned long)));
  // maxnode counts bits; the kernel ignores the last one (a historical off-by-one), so pass one more.
  return ::syscall(SYS_mbind, p, bytes, mpol_preferred, mask.data(), mask.size() * 8 * sizeof(unsigned long) + 1, 0U) ==
         0;
#else
  (void)p, (void)bytes, (void)node;
  errno = ENOSYS;
  return false;
#endif
}

std::optional<MemPolicy> memory_policy_of(const void* p) noexcept {
#ifdef SYS_get_mempolicy
  constexpr unsigned long mpol_f_addr = 1UL << 1;
  std::array<unsigned long, 1024 / (8 * sizeof(unsigned long))> mask{};
  int mode = 0;
  if (::syscall(SYS_get_mempolicy, &mode, mask.data(), mask.size() * 8 * sizeof(unsigned long), p, mpol_f_addr) != 0)
    return std::nullopt;
  MemPolicy out;
  out.mode = mode;
  for (std::size_t w = 0; w < mask.size() && out.node < 0; ++w)
    for (unsigned b = 0; b < 8 * sizeof(unsigned long); ++b)
      if (mask[w] & (1UL << b)) {
        out.node = static_cast<int>(w * 8 * sizeof(unsigned long) + b);
        break;
      }
  return out;
#else
  (void)p;
  return std::nullopt;
#endif
}

CgroupMemory cgroup_memory(std::string_view sys_root) {
  CgroupMemory m;
  auto read_size = [](const std::string& path) -> std::optional<std::size_t> {
    auto line = first_line(path);
    if (!line) return std::nullopt;
    if (*line == "max") return std::size_t{0};
    auto v = whole(*line);
    if (!v || *v < 0) return std::nullopt;
    auto n = static_cast<std::size_t>(*v);
    return n >= unlimited_threshold ? 0 : n;
  };
  const std::string v2 = join(sys_root, "/fs/cgroup/memory.max");
  const std::string v1 = join(sys_root, "/fs/cgroup/memory/memory.limit_in_bytes");
  if (auto limit = read_size(v2)) {
    m.limit = *limit;
    m.file = v2;
    m.usage = read_size(join(sys_root, "/fs/cgroup/memory.current")).value_or(0);
    m.reclaimable = stat_value(join(sys_root, "/fs/cgroup/memory.stat"), "inactive_file");
  } else if (auto limit1 = read_size(v1)) {
    m.limit = *limit1;
    m.file = v1;
    m.usage = read_size(join(sys_root, "/fs/cgroup/memory/memory.usage_in_bytes")).value_or(0);
    m.reclaimable = stat_value(join(sys_root, "/fs/cgroup/memory/memory.stat"), "total_inactive_file");
  }
  return m;
}

std::size_t memlock_limit() noexcept {
  rlimit r{};
  if (::getrlimit(RLIMIT_MEMLOCK, &r) != 0 || r.rlim_cur == RLIM_INFINITY) return 0;
  return static_cast<std::size_t>(r.rlim_cur);
}

PinBudget pin_budget(std::size_t user_limit, const CgroupMemory& cgroup, std::size_t memlock, bool memlock_charged,
                     std::size_t held) {
  PinBudget b;
  b.cgroup_limit = cgroup.limit;
  b.cgroup_usage = cgroup.usage > cgroup.reclaimable ? cgroup.usage - cgroup.reclaimable : 0;
  b.memlock_limit = memlock;
  b.memlock_charged = memlock_charged;
  b.source = "none";
  auto consider = [&](std::size_t cap, const std::string& source) {
    if (b.bytes == 0 || cap < b.bytes) {
      b.bytes = cap;
      b.source = source;
    }
  };
  if (user_limit != 0) consider(user_limit, "host_store_limit");
  if (memlock_charged && memlock != 0) consider(std::max<std::size_t>(memlock, 1), "RLIMIT_MEMLOCK");
  if (cgroup.limit != 0) {
    // The cgroup's usage includes what the store pinned already: that stays the store's.
    const std::size_t reserve = cgroup.limit / 8;
    // Inactive file cache (the model files just read) is reclaimed before anything is killed.
    const std::size_t used = cgroup.usage > cgroup.reclaimable ? cgroup.usage - cgroup.reclaimable : 0;
    const std::size_t others = used > held ? used - held : 0;
    const std::size_t room = cgroup.limit > others + reserve ? cgroup.limit - others - reserve : 0;
    // A cap of 0 would read as "no limit": the smallest nonzero cap pins nothing more than 1 byte
    // of blocks, which rounds to none.
    consider(std::max<std::size_t>(room, 1),
             "cgroup " + (cgroup.file.empty() ? std::string("memory limit") : cgroup.file));
  }
  return b;
}

PinBudget read_pin_budget(std::string_view sys_root, std::size_t user_limit, bool memlock_charged, std::size_t held) {
  return pin_budget(user_limit, cgroup_memory(sys_root), memlock_limit(), memlock_charged, held);
}

}  // namespace torpor
