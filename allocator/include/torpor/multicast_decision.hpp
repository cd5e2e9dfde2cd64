// The group's multicast decision. Each rank probes its own device (probe_multicast: kill
// switches first, then the device attribute and the driver's entry points); the verdicts are
// all-gathered and ANDed, so every rank reaches the same answer. When the ranks are separate
// processes, every driver must also be able to share a multicast object across processes
// (HostDriver emulates multicast inside one driver instance only, so its thread ranks must share
// one HostDriver).
//
// When the answer is no, nothing multicast is ever called (not even the granularity query), and
// rank 0 logs one warning naming the cause and the rank it came from. A group of one rank does
// not use multicast either (logged at info: nothing is lost).
#pragma once

#include <string>
#include <vector>

#include "torpor/driver.hpp"
#include "torpor/group.hpp"

namespace torpor {

struct MulticastDecision {
  bool use = false;
  // Why not ("" when used), naming the rank: "rank 1: disabled by TORPOR_DISABLE_MULTICAST=1".
  std::string reason;
  // The warning rank 0 logged ("" on the other ranks, when used, and for a single rank).
  std::string warning;
  // Each rank's own verdict, by rank ("" = usable).
  std::vector<std::string> rank_reasons;
};

// Collective: every rank of `group` calls it with its own driver and device.
MulticastDecision decide_multicast(Group& group, Driver& driver, int device);

}  // namespace torpor
