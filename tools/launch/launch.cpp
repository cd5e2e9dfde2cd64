// Rank launching for the CLI (launch.hpp): the checks and the choice between the launchers, and
// the small pieces every command that runs ranks uses. Threads share one driver (the host
// backend's multicast emulation and the cuda backend's peer access both want that); processes
// each open their own. The launcher's only job after starting the ranks is to collect outcomes
// and to make sure a failed run ends: it never decides success itself.
#include "launch/launch.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <exception>
#include <optional>
#include <string>

#include "common/options.hpp"
#include "launch/launchers.hpp"
#include "torpor/error.hpp"

namespace torpor::cli {

RankOutcome outcome_of(int rank, const std::function<nlohmann::json()>& fn) {
  RankOutcome o;
  o.rank = rank;
  try {
    o.result = fn();
    o.ok = true;
  } catch (const rank_failure& e) {
    o.error = e.what();
    o.result = e.partial();
  } catch (const std::exception& e) {
    o.error = e.what();
  } catch (...) {
    o.error = "an exception that is not a std::exception";
  }
  return o;
}

int default_ranks(Backend backend) {
  DriverSelection sel = open_driver(backend);
  // An emulated machine has as many devices as asked for: two ranks show every collective.
  return sel.driver->capabilities().host_memory ? 2 : sel.driver->device_count();
}

void GroupTimeout::resolve() {
  // Read (and so validated) even when a flag overrides it.
  const std::optional<std::string> env = options::raw(options::id::group_timeout_ms);
  const std::chrono::milliseconds from_env = env ? options::group_timeout() : std::chrono::milliseconds{0};
  const bool worker_ms_given = worker_ms > 0;
  flag_given = worker_ms_given || seconds_given;
  if (worker_ms_given)
    value = std::chrono::milliseconds(worker_ms);
  else if (env && !seconds_given)
    value = from_env;
  else  // --timeout, or the command's default
    value = std::chrono::seconds(seconds);
}

std::vector<std::string> GroupTimeout::worker_args() const { return {"--timeout-ms", std::to_string(value.count())}; }

LaunchOptions model_launch(Backend backend, int ranks, bool processes, std::chrono::milliseconds group_timeout,
                           int tail_wait_timeout_ms) {
  LaunchOptions lo;
  lo.ranks = ranks;
  lo.processes = processes;
  lo.backend = backend;
  lo.group.timeout = group_timeout;
  lo.failure_grace = std::chrono::milliseconds(tail_wait_timeout_ms) + lo.group.timeout + std::chrono::seconds(5);
  return lo;
}

DriverSelection open_rank_driver(Backend backend, int ranks) {
  HostDriverOptions host = host_driver_options_from_env();
  host.devices = std::max(host.devices, ranks);
  DriverSelection sel = open_driver(backend, host);
  if (int count = sel.driver->device_count(); count < ranks)
    throw invalid_argument(
        fmt::format("{} ranks need {} devices (one per rank); the {} backend has {}{}", ranks, ranks,
                    sel.driver->backend_name(), count,
                    sel.driver->capabilities().host_memory ? "" : " GPUs: pass --ranks N with N <= the GPU count"));
  return sel;
}

LaunchResult launch(const LaunchOptions& o, const RankBody& body) {
  if (o.ranks < 1) throw invalid_argument(fmt::format("--ranks {}: at least one rank is needed", o.ranks));
  if (o.nodes < 1 || o.ranks % o.nodes != 0)
    throw invalid_argument(fmt::format("--nodes {}: use a number of nodes that divides --ranks {}", o.nodes, o.ranks));
  if (o.nodes > 1 && !o.processes)
    throw invalid_argument(fmt::format("--nodes {}: ranks of several nodes are processes (add --processes)", o.nodes));
  return o.processes ? launch_processes(o) : launch_threads(o, body);
}

}  // namespace torpor::cli
