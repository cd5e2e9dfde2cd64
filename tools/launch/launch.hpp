// Running one body per rank, as threads of this process (one device each, one shared driver) or
// as processes (one per device, the vLLM layout: this program re-executed with --worker, the
// group from the environment through a UnixSocketGroup, one JSON line back on stdout).
//
// Failure handling never waits forever: every collective inside a body is bounded by the group
// timeout and the tail's wait bound, and on top of that, once one rank has failed, the others get
// `failure_grace` to finish; a process still running then is killed, a thread still running is
// reported as such (launch() returns with abandoned = true and the caller must exit the process
// without unwinding: those threads still use the driver and the group).
//
// The room: launch.cpp (this interface's small functions), threads.cpp and processes.cpp (the
// two launchers; spawn.cpp starts the processes), worker.cpp (a worker process's side).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "torpor/backend.hpp"
#include "torpor/driver.hpp"
#include "torpor/group.hpp"

namespace torpor::cli {

// What a rank body runs with: the driver (shared by the threads of one process), its group,
// and its device (= its rank).
using RankBody = std::function<nlohmann::json(Driver& driver, Group& group, int device)>;

struct LaunchOptions {
  int ranks = 1;
  bool processes = false;
  Backend backend = Backend::automatic;
  GroupOptions group;
  std::chrono::milliseconds failure_grace{std::chrono::seconds(15)};
  // Processes only: the command line of one worker, after argv[0] (the launcher adds nothing
  // but the environment: TORPOR_GROUP_RENDEZVOUS, TORPOR_RANK, TORPOR_WORLD_SIZE).
  std::vector<std::string> worker_args;
  // Processes only: the ranks in this many emulated nodes of ranks / nodes consecutive ranks each
  // (issue 29's layout). Above 1 the workers share no Unix socket: each gets the launcher's
  // variables (MASTER_ADDR=127.0.0.1, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE)
  // and TORPOR_HOST_NODE, and they meet over a TcpGroup on loopback.
  int nodes = 1;
  // Processes only: a worker still running after this is killed.
  std::chrono::seconds deadline{std::chrono::hours(1)};
};

// NOLINTNEXTLINE(bugprone-exception-escape): clang-tidy 14 takes nlohmann::json's noexcept move for a throwing one
struct RankOutcome {
  int rank = 0;
  bool ok = false;
  nlohmann::json result;  // the body's result (ok), or what it reported before failing
  std::string error;      // why not ok
};

struct LaunchResult {
  std::vector<RankOutcome> ranks;
  bool abandoned = false;       // threads still running (see above)
  std::string backend;          // "host" or "cuda": for reports only
  bool device_kernels = false;  // the ranks' math ran as device kernels (their capability)
  bool host_memory = false;     // the ranks' pool memory was host RAM (their capability)
};

// The rank count when none is asked for: one per GPU on the cuda backend, else 2.
int default_ranks(Backend backend);

// The launch of a command that runs the tiny model on every rank (stress, rl-loop): `ranks` of
// `backend`, as processes or threads, every group wait bounded by `group_timeout`; after a
// failure the others get the tail's wait bound (`tail_wait_timeout_ms`) plus the group's to
// notice. The caller adds the worker command line.
LaunchOptions model_launch(Backend backend, int ranks, bool processes, std::chrono::milliseconds group_timeout,
                           int tail_wait_timeout_ms);

// The driver a launch uses: `backend`, with the host backend's emulated machine big enough for
// `ranks` devices (TORPOR_HOST_DEVICES and TORPOR_HOST_DEVICE_MEMORY otherwise apply).
DriverSelection open_rank_driver(Backend backend, int ranks);

// Threads: runs body on every rank here. Processes: starts the workers (each calls
// run_worker) and collects their JSON lines.
LaunchResult launch(const LaunchOptions& options, const RankBody& body);

// In a worker process: the group from the environment (a TcpGroup when the launcher's MASTER_ADDR
// and RANK are set, else the UnixSocketGroup of TORPOR_GROUP_RENDEZVOUS), the body, one JSON line on stdout
// ({"rank", "ok", "result"} or {"rank", "ok": false, "error"}). Returns the exit code.
int run_worker(Backend backend, const GroupOptions& group, const RankBody& body);

// The error of a failed body with its partial result: a body throws this to report what it
// measured before failing.
class rank_failure : public std::runtime_error {
 public:
  rank_failure(const std::string& what, nlohmann::json partial)
      : std::runtime_error(what), partial_(std::move(partial)) {}
  const nlohmann::json& partial() const noexcept { return partial_; }

 private:
  nlohmann::json partial_;
};

// The accepted range of every --timeout (seconds): 0 would silently become the default and a
// larger value overflows the group's clocks.
inline constexpr int max_timeout_s = 86400;

// The bound on every group wait of a command that runs ranks (stress, rl-loop, symmetric-check):
// --timeout (seconds) when given; else TORPOR_GROUP_TIMEOUT_MS when set, so the variable works
// for the CLI as it does for the library; else the command's own default. An invalid variable is
// an invalid_argument naming it, flag or not: a value that is set but ignored hides a typo. A
// process launch hands its workers the resolved value (--timeout-ms, hidden), so every rank of a
// run waits the same, whatever their environment says.
struct GroupTimeout {
  int seconds = 60;                    // --timeout's target; holds the command's default until given
  bool seconds_given = false;          // --timeout was given (the command line sets it)
  std::int64_t worker_ms = 0;          // --timeout-ms, from the launcher (at least 1); 0 = not given
  std::chrono::milliseconds value{0};  // after resolve(): what the group gets
  bool flag_given = false;             // after resolve(): --timeout or --timeout-ms was given

  // Sets value from the flags, the environment and the default, in that order; call once the
  // flags are parsed, after any default that depends on other flags is set in `seconds`.
  void resolve();
  // The worker's command line: --timeout-ms <value>.
  std::vector<std::string> worker_args() const;
};

}  // namespace torpor::cli
