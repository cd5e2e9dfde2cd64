// A worker process's side of a process launch (launch.hpp: run_worker): end with the launcher,
// join the group the launcher's environment names, run the body, report on one JSON line.
#include <fmt/core.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "common/options.hpp"
#include "launch/launchers.hpp"
#include "torpor/tcp_group.hpp"

namespace torpor::cli {

// A rank ends with its launcher, however the launcher ends (issue 33 N17: a SIGKILLed launcher
// left its ranks running until their group timed out): SIGTERM when the parent goes, and an exit
// now if it is already gone (reparented before the request took effect).
namespace {

void end_with_the_launcher() {
  const pid_t parent = ::getppid();
  if (::prctl(PR_SET_PDEATHSIG, SIGTERM) != 0)
    fmt::print(stderr,
               "torpor: rank: cannot ask to end with the launcher (prctl: {}); a killed launcher leaves this rank "
               "until its group times out\n",
               std::strerror(errno));
  if (parent == 1 || ::getppid() != parent) {
    fmt::print(stderr, "torpor: rank: the launcher is gone; exiting\n");
    std::_Exit(1);
  }
}

}  // namespace

int run_worker(Backend backend, const GroupOptions& group_options, const RankBody& body) {
  end_with_the_launcher();
  std::unique_ptr<Group> group;
  std::unique_ptr<LauncherLayout> layout;  // set for a TCP group: the device is the rank within its node
  nlohmann::json line;
  try {
    if (options::master_addr() && options::launcher_rank()) layout = launcher_layout_from_env();
    if (layout)
      group = tcp_group_from_env(group_options);
    else
      group = unix_group_from_env(group_options);
  } catch (const std::exception& e) {
    line = {{"ok", false}, {"error", fmt::format("joining the group: {}", e.what())}};
    fmt::print("{}\n", line.dump());
    std::fflush(stdout);
    return 1;
  }
  const int rank = group->rank();
  std::string backend_name;
  bool device_kernels = false, host_memory = false;
  RankOutcome out = outcome_of(rank, [&] {
    DriverSelection sel = open_rank_driver(backend, layout ? layout->local_world_size : group->size());
    backend_name = std::string(sel.driver->backend_name());
    device_kernels = sel.driver->capabilities().compute == DriverCapabilities::Compute::device_kernels;
    host_memory = sel.driver->capabilities().host_memory;
    return body(*sel.driver, *group, layout ? layout->local_rank : rank);
  });
  line = {{"rank", rank},
          {"ok", out.ok},
          {"result", out.result},
          {"backend", backend_name},
          {"device_kernels", device_kernels},
          {"host_memory", host_memory}};
  if (!out.ok) line["error"] = out.error;
  fmt::print("{}\n", line.dump());
  std::fflush(stdout);
  if (out.ok) {
    // Rank 0 hosts the rendezvous: everyone leaves together (a failure here changes nothing).
    try {
      group->barrier();
    } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): see above: nothing changes
    }
  }
  return out.ok ? 0 : 1;
}

}  // namespace torpor::cli
