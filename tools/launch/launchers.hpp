// The two ways launch() starts ranks, and the outcome both report for a rank (internal to
// tools/launch/).
#pragma once

#include <functional>
#include <nlohmann/json.hpp>

#include "launch/launch.hpp"

namespace torpor::cli {

// Runs fn as rank `rank`'s body: its result, or why it failed (with the partial result of a
// rank_failure). Never throws.
RankOutcome outcome_of(int rank, const std::function<nlohmann::json()>& fn);

// One thread per rank in this process, sharing one driver (threads.cpp).
LaunchResult launch_threads(const LaunchOptions& o, const RankBody& body);

// One process per rank, each running o.worker_args, their reports collected from their stdout
// (processes.cpp).
LaunchResult launch_processes(const LaunchOptions& o);

}  // namespace torpor::cli
