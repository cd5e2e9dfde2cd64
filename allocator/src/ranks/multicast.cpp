// Every multicast decision: see multicast.hpp.
#include "ranks/multicast.hpp"

#include <fmt/core.h>
#include <unistd.h>

#include <cstdlib>
#include <mutex>
#include <set>
#include <utility>

#include "common/options.hpp"
#include "torpor/consensus.hpp"
#include "torpor/log.hpp"

namespace torpor {

namespace {

// One rank's part of the decision.
struct Verdict {
  bool usable = false;
  bool shares_across_processes = false;
  // Ranks in one process can always share a multicast object (through the process's driver).
  std::string domain;
  std::string backend;
  std::string reason;
};

// The exchange is consensus's: every rank's verdict as canonical fields, all-gathered.
std::vector<Verdict> gather_verdicts(Group& group, const Verdict& mine) {
  const std::string wire = consensus::encode_fields(
      {mine.usable ? "1" : "0", mine.shares_across_processes ? "1" : "0", mine.domain, mine.backend, mine.reason});
  const std::vector<std::string> all = consensus::gather_text(group, wire);
  std::vector<Verdict> out;
  out.reserve(all.size());
  for (std::size_t r = 0; r < all.size(); ++r) {
    auto f = consensus::decode_fields(all[r], 5, fmt::format("multicast decision: the verdict of rank {}", r));
    out.push_back({f[0] == "1", f[1] == "1", std::move(f[2]), std::move(f[3]), std::move(f[4])});
  }
  return out;
}

}  // namespace

// --- the kill switches and one device -----------------------------------------------------------

// Which values count as set lives with the table (common/options.hpp); read on every call.
std::optional<std::string> multicast_kill_switch() { return options::multicast_kill_switch(); }

MulticastProbe probe_multicast(Driver& driver, int device) {
  MulticastProbe p;
  p.kill_switch = multicast_kill_switch();
  p.entry_points = driver.multicast_entry_points();
  p.attribute = driver.device_properties(device).multicast_attribute;
  if (p.kill_switch) {
    p.reason = fmt::format("disabled by {}", *p.kill_switch);
  } else if (!p.attribute) {
    p.reason =
        fmt::format("device {} reports no multicast support (CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 0)", device);
  } else if (!p.entry_points) {
    p.reason = "the driver library lacks the multicast entry points (cuMulticastCreate etc.)";
  } else {
    p.usable = true;
  }
  return p;
}

// --- the group ----------------------------------------------------------------------------------

MulticastDecision decide_multicast(Group& group, Driver& driver, int device) {
  // Local part: environment and attributes only; no multicast call.
  MulticastProbe probe = probe_multicast(driver, device);
  Verdict mine;
  mine.usable = probe.usable;
  mine.reason = probe.reason;
  mine.domain = std::to_string(::getpid());
  mine.backend = std::string(driver.backend_name());
  mine.shares_across_processes = probe.usable && driver.multicast_shares_across_processes();

  const std::vector<Verdict> all = gather_verdicts(group, mine);

  MulticastDecision d;
  std::vector<int> refusing;
  std::set<std::string> domains;
  for (std::size_t r = 0; r < all.size(); ++r) {
    d.rank_reasons.push_back(all[r].usable ? std::string() : all[r].reason);
    if (!all[r].usable) refusing.push_back(static_cast<int>(r));
    domains.insert(all[r].domain);
  }
  const int n = group.size();
  bool warn = true;
  if (!refusing.empty()) {
    int first = refusing.front();
    d.reason = fmt::format("rank {}: {}", first, all[static_cast<std::size_t>(first)].reason);
    if (refusing.size() > 1) {
      std::vector<int> rest(refusing.begin() + 1, refusing.end());
      d.reason += fmt::format(" (rank(s) {} cannot use it either)", format_ranks(rest));
    }
  } else if (domains.size() > 1) {
    for (std::size_t r = 0; r < all.size() && d.reason.empty(); ++r)
      if (!all[r].shares_across_processes)
        d.reason = fmt::format("rank {}: the {} backend cannot share a multicast object with a rank in another "
                               "process, and the ranks are separate processes",
                               r, all[r].backend);
  }
  if (d.reason.empty() && n == 1) {
    d.reason = "the group has a single rank; multicast needs two or more";
    warn = false;
  }
  d.use = d.reason.empty();
  if (!d.use && group.rank() == 0) {
    std::string text =
        fmt::format("multicast (NVLS) is not used by this group of {} rank(s): {}; symmetric buffers use "
                    "unicast peer mappings",
                    n, d.reason);
    if (warn) {
      d.warning = text;
      log::warn("{}", text);
    } else {
      log::info("{}", text);
    }
  }
  return d;
}

// --- NCCL's NVLS ----------------------------------------------------------------------------------

namespace {

bool switch_set(options::id key, const std::optional<std::string>& value) {
  return options::switch_set(options::option(key), value);
}

std::string named(options::id key, const std::optional<std::string>& value) {
  return fmt::format("{}={}", options::option(key).name, value.value_or(""));
}

}  // namespace

NvlsAction nccl_nvls_policy(const NvlsEnvironment& env) {
  using options::id;
  const bool user_set = env.nccl_nvls_enable.has_value() && !env.nccl_nvls_enable->empty();
  if (switch_set(id::disable_multicast, env.torpor_disable_multicast)) {
    const std::string torpor = named(id::disable_multicast, env.torpor_disable_multicast);
    if (!user_set)
      return {true, fmt::format("{} is set, so NCCL_NVLS_ENABLE=0 (NCCL creates no multicast object)", torpor)};
    if (*env.nccl_nvls_enable == "0") return {};
    return {true, fmt::format("{} overrides the user's NCCL_NVLS_ENABLE={}: NCCL_NVLS_ENABLE=0 (NCCL creates no "
                              "multicast object)",
                              torpor, *env.nccl_nvls_enable)};
  }
  if (user_set) return {};  // the user's own setting wins over a foreign kill switch
  const std::pair<id, const std::optional<std::string>*> foreign[] = {{id::torch_symm_mem_disable_multicast,
                                                                       &env.torch_symm_mem_disable_multicast},
                                                                      {id::nvshmem_disable_nvls,
                                                                       &env.nvshmem_disable_nvls}};
  for (const auto& [key, value] : foreign)
    if (switch_set(key, *value))
      return {true, fmt::format("{} is set and NCCL_NVLS_ENABLE is not, so NCCL_NVLS_ENABLE=0 (NCCL creates no "
                                "multicast object)",
                                named(key, *value))};
  return {};
}

NvlsEnvironment nvls_environment() {
  using options::id;
  return {options::raw(id::disable_multicast), options::raw(id::torch_symm_mem_disable_multicast),
          options::raw(id::nvshmem_disable_nvls), options::raw(id::nccl_nvls_enable)};
}

void apply_nccl_nvls_policy() {
  // NCCL reads NCCL_NVLS_ENABLE once per process; deciding once keeps every communicator of the
  // process under the same decision, and call_once is the lock around setenv.
  static std::once_flag once;
  std::call_once(once, [] {
    const NvlsAction action = nccl_nvls_policy(nvls_environment());
    if (!action.set_nvls_off) return;
    ::setenv("NCCL_NVLS_ENABLE", "0", 1);
    log::info("{}", action.why);
  });
}

}  // namespace torpor
