// Starting the ranks of a process launch (spawn.cpp; processes.cpp collects them).
#pragma once

#include <sys/types.h>

#include <vector>

#include "launch/launch.hpp"
#include "torpor/group.hpp"

namespace torpor::cli {

// The ranks' processes and the read ends of their stdout pipes.
struct Spawned {
  std::vector<pid_t> pids;
  std::vector<int> outs;
};

// Starts one process per rank (this program, o.worker_args, the rank's group variables in its
// environment) with its stdout on a pipe. On a failure the ranks already started are killed and
// reaped, the pipes closed, the rendezvous removed, and the error names the rank.
Spawned spawn_ranks(const LaunchOptions& o, const Rendezvous& rv);

}  // namespace torpor::cli
