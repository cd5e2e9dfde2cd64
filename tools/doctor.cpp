// `torpor doctor`: whether torpor can run at full speed on this machine, and what to change
// where it cannot. `torpor probe` reports what torpor sees; doctor judges it against what torpor
// needs and says the fix for each finding.
//
// Every check yields one status:
//   ok           nothing to do
//   info         worth knowing, no effect on speed (a feature this machine lacks that torpor
//                does without: multicast falls back to unicast, fabric handles to POSIX fds)
//   off          a kill switch is in force (deliberate: named, no effect on the verdict)
//   slow         torpor runs, but slower than it could (a low memlock limit, huge pages off,
//                no peer access between GPUs)
//   limited      torpor runs, but cannot give some memory back while asleep (NCCL without
//                communicator suspend, NCCL graph registration on)
//   unusable     torpor cannot use the GPU (no GPU, no VMM): it would run on the host emulator
// The exit status is the verdict: 0 full speed, 1 runs with a slow or limited finding, 2 the
// GPU cannot be used (--backend host judges the emulator's host side only, so never 2), other
// values for a usage error (CLI11's, command_line.cpp). Nothing here creates a multicast object: the multicast
// check reads the kill switches first and the device attribute only (ranks/multicast.hpp).
#include <fmt/core.h>
#include <sys/resource.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.hpp"
#include "common/options.hpp"
#include "ranks/groups/nccl/nccl_info.hpp"
#include "ranks/multicast.hpp"
#include "torpor/backend.hpp"
#include "torpor/error.hpp"

namespace torpor::cli {

namespace {

struct Check {
  std::string name;
  std::string status;
  std::string detail;
  std::string fix;  // "" when there is nothing to do
};

// The NCCL version that first has ncclCommSuspend / ncclCommResume.
constexpr int nccl_suspend_version = 22907;

std::string nccl_version_text(int v) { return fmt::format("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100); }

std::size_t host_memory_total() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  std::size_t kib = 0;
  std::string rest;
  while (in >> key >> kib) {
    std::getline(in, rest);
    if (key == "MemTotal:") return kib * 1024;
  }
  return 0;
}

Check memlock_check(std::size_t need) {
  Check c{"memlock", "ok", "", ""};
  rlimit rl{};
  if (::getrlimit(RLIMIT_MEMLOCK, &rl) != 0) {
    c.status = "info";
    c.detail = "RLIMIT_MEMLOCK could not be read";
    return c;
  }
  if (rl.rlim_cur == RLIM_INFINITY) {
    c.detail = "RLIMIT_MEMLOCK unlimited";
    return c;
  }
  const auto limit = static_cast<std::size_t>(rl.rlim_cur);
  if (limit >= need) {
    c.detail = fmt::format("RLIMIT_MEMLOCK {} covers the host store's {}", format_bytes(limit), format_bytes(need));
    return c;
  }
  c.status = "slow";
  c.detail = fmt::format(
      "RLIMIT_MEMLOCK is {}, below the host store's {}: page-locking beyond it can be refused (mlock-based pinning, "
      "RDMA registration), and a refused cuMemHostRegister leaves the store pageable (copies through the staging "
      "ring, slower sleeps)",
      format_bytes(limit), format_bytes(need));
  c.fix = "raise it: `ulimit -l unlimited` in the launching shell, `memlock unlimited` in "
          "/etc/security/limits.conf, or `docker run --ulimit memlock=-1`";
  return c;
}

Check huge_pages_check() {
  Check c{"huge pages", "ok", "", ""};
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  if (!std::getline(f, line)) {
    c.status = "info";
    c.detail = "/sys/kernel/mm/transparent_hugepage/enabled not readable: the kernel does not say";
    return c;
  }
  if (line.find("[never]") != std::string::npos) {
    c.status = "slow";
    c.detail = fmt::format("transparent huge pages are off ({}): the host store's first touch faults 4 KiB pages and "
                           "page-locking it runs at about half the speed (the first sleep)",
                           line);
    c.fix = "`echo madvise | sudo tee /sys/kernel/mm/transparent_hugepage/enabled` (torpor asks with "
            "madvise(MADV_HUGEPAGE))";
    return c;
  }
  c.detail = fmt::format("transparent huge pages: {}", line);
  return c;
}

// Every kill switch in force, "NAME=value", in the table's order.
std::vector<std::string> kill_switches_in_force() {
  std::vector<std::string> out;
  for (options::id key : {options::id::disable_multicast, options::id::torch_symm_mem_disable_multicast,
                          options::id::nvshmem_disable_nvls, options::id::nccl_nvls_enable}) {
    const options::Option& o = options::option(key);
    auto text = options::raw(key);
    if (text && options::switch_set(o, text)) out.push_back(fmt::format("{}={}", o.name, *text));
  }
  return out;
}

std::string join(const std::vector<std::string>& items, std::string_view sep) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : std::string(sep)) + s;
  return out;
}

// What to do about a device's fabric answer; "" where nothing would help (no multi-node NVLink).
std::string fabric_fix(FabricProbe::Cause cause) {
  switch (cause) {
    case FabricProbe::Cause::no_imex_channel:
      return "where ranks span nodes: run nvidia-imex and create a channel (/dev/nvidia-caps-imex-channels/channel0; "
             "containers: pass it through, e.g. NVIDIA_IMEX_CHANNELS=0)";
    case FabricProbe::Cause::not_permitted:
      return "where ranks span nodes: start the IMEX daemon on every node of the domain (listed in its nodes_config) "
             "and grant this process a channel";
    case FabricProbe::Cause::driver_too_old: return "where ranks span nodes: a CUDA driver of 12.3 or newer";
    default: return "";
  }
}

// Fabric handles (multi-node NVLink): each device is asked with a real allocation and export
// (Driver::probe_fabric), since the device attribute alone has said yes where the export then
// failed. Without them symmetric memory shares POSIX descriptors, which reach the ranks of one
// node only: worth knowing, no effect on speed.
Check fabric_check(Driver& d) {
  Check c{"fabric handles", "info", "", ""};
  std::vector<std::pair<std::string, std::vector<int>>> answers;  // each distinct answer, its devices
  std::string fix;
  bool all = d.device_count() > 0;
  for (int i = 0; i < d.device_count(); ++i) {
    FabricProbe p;
    try {
      p = d.probe_fabric(i);
    } catch (const std::exception& e) {
      p.cause = FabricProbe::Cause::failed;
      p.detail = e.what();
    }
    all = all && p.supported();
    if (fix.empty()) fix = fabric_fix(p.cause);
    const std::string said = p.describe();
    auto it = std::find_if(answers.begin(), answers.end(), [&](const auto& a) { return a.first == said; });
    if (it == answers.end())
      answers.push_back({said, {i}});
    else
      it->second.push_back(i);
  }
  std::vector<std::string> parts;
  for (const auto& [said, devices] : answers) {
    std::vector<std::string> ids;
    for (int i : devices) ids.push_back(std::to_string(i));
    parts.push_back(fmt::format("device(s) {}: {}", join(ids, ", "), said));
  }
  if (all) {
    c.status = "ok";
    c.detail = fmt::format("{}; symmetric memory can span nodes", join(parts, "; "));
  } else {
    c.detail = fmt::format("{}; symmetric memory falls back to POSIX descriptors, which serve the ranks of one node",
                           join(parts, "; "));
    c.fix = fix;
  }
  return c;
}

void device_checks(Driver& d, bool gpu, std::vector<Check>& checks) {
  const int n = d.device_count();
  // Driver and VMM.
  Check vmm{"driver and VMM", "ok", "", ""};
  std::vector<std::string> without_vmm;
  for (int i = 0; i < n; ++i) {
    DeviceProperties p = d.device_properties(i);
    if (!p.vmm_supported) without_vmm.push_back(fmt::format("{} ({})", i, p.name));
  }
  if (!without_vmm.empty()) {
    vmm.status = "unusable";
    vmm.detail = fmt::format("device(s) {} lack CUDA virtual memory management", join(without_vmm, ", "));
    vmm.fix = "a GPU and driver with VMM (CUDA 10.2 or later, not under vGPU profiles that disable it)";
  } else {
    vmm.detail = fmt::format("{} device(s), all with VMM{}", n, gpu ? "" : " (emulated)");
  }
  checks.push_back(vmm);

  checks.push_back(fabric_check(d));

  // Multicast: the kill switches first; never created here.
  Check mc{"multicast", "info", "", ""};
  std::vector<std::string> switches = kill_switches_in_force();
  if (!switches.empty()) {
    mc.status = "off";
    mc.detail = fmt::format("disabled by {} (torpor and NCCL's NVLS take the unicast path)", join(switches, ", "));
  } else {
    bool all = n > 0;
    std::string why;
    for (int i = 0; i < n && all; ++i) {
      MulticastProbe p = probe_multicast(d, i);
      if (!p.usable) {
        all = false;
        why = p.reason;
      }
    }
    if (all) {
      mc.status = "ok";
      mc.detail = fmt::format("usable on every device ({})", gpu ? "hardware" : "emulated");
    } else {
      mc.detail = fmt::format("not usable: {}; the unicast path is used", why);
    }
  }
  checks.push_back(mc);

  // Peer access between every pair.
  Check peers{"peer access", "ok", "", ""};
  if (n < 2) {
    peers.status = "info";
    peers.detail = fmt::format("{} device: nothing to reach", n);
  } else {
    std::vector<std::string> missing;
    for (int i = 0; i < n; ++i)
      for (int k = 0; k < n; ++k)
        if (i != k && !d.can_access_peer(i, k)) missing.push_back(fmt::format("{}->{}", i, k));
    if (missing.empty()) {
      peers.detail = fmt::format("every pair of the {} devices", n);
    } else {
      peers.status = "slow";
      peers.detail = fmt::format("no peer access for {} (symmetric memory between them goes through the host)",
                                 join(missing, ", "));
      peers.fix = "put the ranks on GPUs with NVLink or a common PCIe switch (`nvidia-smi topo -m`); enable IOMMU "
                  "passthrough where it blocks P2P";
    }
  }
  checks.push_back(peers);
}

Check nccl_check() {
  Check c{"NCCL", "info", "", ""};
  NcclInfo info = nccl_info();
  if (!info.built || !info.usable) {
    c.detail = info.why_not + " (torpor's own groups and the fused tail do not need it)";
    if (info.built) c.fix = "install NCCL 2.29.7 or later, or point TORPOR_NCCL_LIBRARY at it";
    return c;
  }
  if (info.comm_suspend) {
    c.status = "ok";
    c.detail =
        fmt::format("{} {}: can suspend communicators (ncclCommSuspend)", info.name, nccl_version_text(info.version));
    return c;
  }
  c.status = "limited";
  c.detail = fmt::format("{} {} has no ncclCommSuspend/ncclCommResume: NCCL's own device memory stays allocated "
                         "while torpor sleeps",
                         info.name, nccl_version_text(info.version));
  c.fix =
      fmt::format("NCCL {} or later (TORPOR_NCCL_LIBRARY can point at it)", nccl_version_text(nccl_suspend_version));
  return c;
}

Check graph_register_check() {
  Check c{"NCCL_GRAPH_REGISTER", "ok", "", ""};
  auto v = options::raw(options::id::nccl_graph_register);
  if (!v) {
    c.status = "info";
    c.detail = "unset (NCCL registers graph buffers): torpor.graph sets 0 for its captures";
    c.fix = "an engine capturing collectives with torch.cuda.graph outside torpor.graph: NCCL_GRAPH_REGISTER=0";
  } else if (*v == "0") {
    c.detail = "0: NCCL does not register graph buffers";
  } else {
    c.status = "limited";
    c.detail = fmt::format("{}: NCCL registers the buffers captured collectives use, which pins torpor's graph memory "
                           "through sleep and goes stale after wake",
                           *v);
    c.fix = "NCCL_GRAPH_REGISTER=0";
  }
  return c;
}

Check alloc_conf_check() {
  Check c{"PyTorch allocator", "ok", "", ""};
  std::vector<std::string> set;
  bool expandable = false;
  for (options::id key : {options::id::pytorch_cuda_alloc_conf, options::id::pytorch_alloc_conf}) {
    if (auto v = options::raw(key)) {
      set.push_back(fmt::format("{}={}", options::option(key).name, *v));
      std::string lower = *v;
      std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char ch) { return std::tolower(ch); });
      lower.erase(std::remove(lower.begin(), lower.end(), ' '), lower.end());
      expandable = expandable || lower.find("expandable_segments:true") != std::string::npos;
    }
  }
  if (set.empty()) {
    c.detail = "PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF unset";
  } else if (expandable) {
    c.status = "info";
    c.detail =
        fmt::format("{}: expandable segments are turned off inside torpor's pools and back on after", join(set, ", "));
  } else {
    c.detail = join(set, ", ");
  }
  return c;
}

struct Report {
  std::string backend;
  std::string reason;
  std::vector<Check> checks;
  int exit_code = 0;
  std::string verdict;
};

Report diagnose(Backend requested, std::size_t host_store) {
  Report r;
  bool gpu = false;
  try {
    DriverSelection sel = open_driver(requested);
    r.backend = std::string(to_string(sel.backend));
    r.reason = sel.reason;
    gpu = sel.backend == Backend::cuda;
    // The emulator's devices say nothing about this machine's GPUs: judged only when asked for.
    if (!gpu && requested != Backend::host)
      r.checks.push_back({"GPU", "unusable", fmt::format("torpor would run on the host emulator: {}", sel.reason),
                          "a GPU with VMM and its driver (libcuda) visible to this process; TORPOR_BACKEND=host runs "
                          "on the emulator deliberately"});
    else
      device_checks(*sel.driver, gpu, r.checks);
  } catch (const error& e) {
    r.backend = std::string(to_string(requested));
    r.reason = e.what();
    r.checks.push_back(
        {"GPU", "unusable", e.what(), "a GPU with VMM and its driver (libcuda) visible to this process"});
  }
  r.checks.push_back(memlock_check(host_store));
  r.checks.push_back(huge_pages_check());
  r.checks.push_back(nccl_check());
  r.checks.push_back(graph_register_check());
  r.checks.push_back(alloc_conf_check());
  std::vector<std::string> slow;
  bool unusable = false;
  for (const Check& c : r.checks) {
    if (c.status == "unusable") unusable = true;
    if (c.status == "slow" || c.status == "limited") slow.push_back(c.name);
  }
  if (unusable) {
    r.exit_code = 2;
    r.verdict = "torpor cannot use a GPU here (it would run on the host emulator)";
  } else if (!slow.empty()) {
    r.exit_code = 1;
    r.verdict = fmt::format("torpor runs here, not at full speed: {} (the fixes are above)", join(slow, ", "));
  } else {
    r.verdict = fmt::format("torpor can run at full speed here ({} backend)", r.backend);
  }
  return r;
}

nlohmann::json to_json(const Report& r) {
  nlohmann::json checks = nlohmann::json::array();
  for (const Check& c : r.checks)
    checks.push_back({{"name", c.name}, {"status", c.status}, {"detail", c.detail}, {"fix", c.fix}});
  return {{"backend", r.backend},           {"reason", r.reason},  {"checks", checks}, {"exit_code", r.exit_code},
          {"full_speed", r.exit_code == 0}, {"verdict", r.verdict}};
}

void print_human(const Report& r) {
  fmt::print("backend              {} ({})\n", r.backend, r.reason);
  for (const Check& c : r.checks) {
    fmt::print("{:<20} {:<9} {}\n", c.name, c.status, c.detail);
    if (!c.fix.empty()) fmt::print("{:<20} {:<9} fix: {}\n", "", "", c.fix);
  }
  fmt::print("verdict: {} (exit {})\n", r.verdict, r.exit_code);
}

}  // namespace

int run_doctor(const DoctorOptions& o) {
  const std::size_t need = o.host_store != 0 ? o.host_store : host_memory_total();
  Report r = diagnose(parse_backend(o.backend), need);
  if (o.json)
    fmt::print("{}\n", to_json(r).dump(2));
  else
    print_human(r);
  return r.exit_code;
}

}  // namespace torpor::cli
