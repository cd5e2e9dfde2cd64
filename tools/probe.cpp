// `torpor probe`: backend in use and why, devices, VMM support, granularity, peer access,
// multicast attribute and whether multicast would be used (and if not, why), host memory.
// The multicast decision here is per device plus the AND over all devices of this machine;
// the collective decision across ranks is the symmetric layer's (decide_multicast), which also
// needs the driver to share multicast objects across processes when ranks are processes.
// `--config` prints the effective settings of the options table instead (name, value, source),
// without opening a driver; the JSON report always carries them under "config".
#include <fmt/core.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "commands.hpp"
#include "common/options.hpp"
#include "ranks/multicast.hpp"
#include "torpor/backend.hpp"

namespace torpor::cli {

namespace {

struct HostMemory {
  std::size_t total = 0;
  std::size_t available = 0;
};

HostMemory read_meminfo() {
  HostMemory m;
  std::ifstream in("/proc/meminfo");
  std::string key;
  std::size_t kib;
  std::string unit;
  while (in >> key >> kib) {
    std::getline(in, unit);
    if (key == "MemTotal:") m.total = kib * 1024;
    if (key == "MemAvailable:") m.available = kib * 1024;
  }
  return m;
}

// One row per variable of the options table; an invalid value keeps its text and says why.
nlohmann::json config_json() {
  nlohmann::json rows = nlohmann::json::array();
  for (const options::Setting& s : options::effective()) {
    nlohmann::json row = {{"name", std::string(s.name)},
                          {"value", s.value},
                          {"source", s.from_environment ? "environment" : "default"}};
    if (!s.error.empty()) row["error"] = s.error;
    rows.push_back(std::move(row));
  }
  return rows;
}

bool config_valid(const nlohmann::json& config) {
  for (const auto& row : config)
    if (row.contains("error")) return false;
  return true;
}

void print_config(const nlohmann::json& config) {
  std::size_t width = 0;
  for (const auto& row : config) width = std::max(width, row["name"].get<std::string>().size());
  for (const auto& row : config) {
    const std::string value = row["value"].get<std::string>();
    fmt::print("{:<{}}  {:<14} {}\n", row["name"].get<std::string>(), width, value.empty() ? "(unset)" : value,
               row["source"].get<std::string>());
    if (row.contains("error")) fmt::print("{:<{}}  INVALID: {}\n", "", width, row["error"].get<std::string>());
  }
}

nlohmann::json probe_json(Backend requested) {
  DriverSelection sel = open_driver(requested);
  Driver& d = *sel.driver;
  nlohmann::json j;
  j["config"] = config_json();
  j["backend"] = std::string(to_string(sel.backend));
  j["reason"] = sel.reason;
  j["cuda_backend_built"] = cuda_backend_built();
  int n = d.device_count();
  bool all_multicast = n > 0;
  std::string multicast_reason;
  j["devices"] = nlohmann::json::array();
  for (int i = 0; i < n; ++i) {
    DeviceProperties p = d.device_properties(i);
    MemoryInfo mi = d.memory_info(i);
    MulticastProbe mc = probe_multicast(d, i);
    if (!mc.usable && all_multicast) {
      all_multicast = false;
      multicast_reason = mc.reason;
    }
    j["devices"].push_back({{"ordinal", i},
                            {"name", p.name},
                            {"total_bytes", p.total_bytes},
                            {"free_bytes", mi.free_bytes},
                            {"vmm_supported", p.vmm_supported},
                            {"posix_fd_handles", p.posix_fd_handles_supported},
                            {"gpu_direct_rdma_vmm", p.gpu_direct_rdma_vmm},
                            {"granularity", p.granularity},
                            {"multicast_attribute", p.multicast_attribute},
                            {"multicast_usable", mc.usable},
                            {"multicast_reason", mc.reason}});
  }
  nlohmann::json peers = nlohmann::json::array();
  for (int i = 0; i < n; ++i) {
    nlohmann::json row = nlohmann::json::array();
    for (int k = 0; k < n; ++k) row.push_back(i == k ? true : d.can_access_peer(i, k));
    peers.push_back(row);
  }
  j["peer_access"] = peers;
  auto kill = multicast_kill_switch();
  j["multicast"] = {{"would_use", all_multicast},
                    {"reason", all_multicast ? std::string() : multicast_reason},
                    {"entry_points", d.multicast_entry_points()},
                    {"across_processes", d.multicast_shares_across_processes()},
                    {"kill_switch", kill ? *kill : std::string()}};
  HostMemory hm = read_meminfo();
  j["host_memory"] = {{"total_bytes", hm.total}, {"available_bytes", hm.available}};
  return j;
}

void print_human(const nlohmann::json& j) {
  fmt::print("backend    {} ({})\n", j["backend"].get<std::string>(), j["reason"].get<std::string>());
  fmt::print("devices    {}\n", j["devices"].size());
  for (const auto& dev : j["devices"]) {
    fmt::print("  [{}] {}: {} total, {} free, VMM {}, granularity {}, POSIX fd handles {}, multicast attribute {}\n",
               dev["ordinal"].get<int>(), dev["name"].get<std::string>(),
               format_bytes(dev["total_bytes"].get<std::size_t>()), format_bytes(dev["free_bytes"].get<std::size_t>()),
               dev["vmm_supported"].get<bool>() ? "yes" : "NO", format_bytes(dev["granularity"].get<std::size_t>()),
               dev["posix_fd_handles"].get<bool>() ? "yes" : "no", dev["multicast_attribute"].get<bool>() ? 1 : 0);
  }
  const auto& peers = j["peer_access"];
  if (peers.size() > 1) {
    fmt::print("peer access (row can access column)\n     ");
    for (std::size_t k = 0; k < peers.size(); ++k) fmt::print("{:>3}", k);
    fmt::print("\n");
    for (std::size_t i = 0; i < peers.size(); ++i) {
      fmt::print("  {:>3}", i);
      for (std::size_t k = 0; k < peers.size(); ++k)
        fmt::print("{:>3}", i == k ? "-" : (peers[i][k].get<bool>() ? "Y" : "n"));
      fmt::print("\n");
    }
  }
  const auto& mc = j["multicast"];
  if (mc["would_use"].get<bool>()) {
    fmt::print("multicast  would be used (every device supports it, entry points present, no kill switch)\n");
    if (!mc["across_processes"].get<bool>())
      fmt::print("           by ranks that are threads of one process only: the {} backend cannot share a multicast "
                 "object between processes\n",
                 j["backend"].get<std::string>());
  } else
    fmt::print("multicast  would NOT be used: {}\n", mc["reason"].get<std::string>());
  fmt::print("host       {} total, {} available\n", format_bytes(j["host_memory"]["total_bytes"].get<std::size_t>()),
             format_bytes(j["host_memory"]["available_bytes"].get<std::size_t>()));
}

}  // namespace

int run_probe(const ProbeOptions& o) {
  if (o.config) {
    nlohmann::json config = config_json();
    if (o.json)
      fmt::print("{}\n", nlohmann::json{{"config", config}}.dump(2));
    else
      print_config(config);
    return config_valid(config) ? 0 : 1;
  }
  nlohmann::json j = probe_json(parse_backend(o.backend));
  if (o.json)
    fmt::print("{}\n", j.dump(2));
  else
    print_human(j);
  return 0;
}

}  // namespace torpor::cli
