// The sleep-mode test plan of `torpor stress`, as one rank runs it:
//   1. generate greedily (prompts x new tokens), twice: the first output is the reference;
//   2. sleep(1) + wake_up(), generate;
//   3. twice: sleep(2) + wake_up({"weights"}) + reload the next weight version (the same one,
//      skipping preserved parameters, with --preserve) + wake_up({"kv_cache"}), generate;
//   then --cycles soak cycles over mixed levels and partial wakes (soak_patterns()), each
//   followed by a generate. Every output is compared, token for token, with a freshly built
//   model of the same weight version that never slept, and with that version's first output.
// Each step becomes one JSON row (bytes from the sleep and wake TransitionReports, device memory
// returned by cudaMemGetInfo / the host backend's equivalent, seconds, matching prompts, and the
// live physical bytes, host store and mapped bytes after the step, for the soak's growth check).
// A transition's row also splits the device memory in use (cuMemGetInfo) awake, asleep and after
// wake into the pool's mapped bytes, CUDA's graph allocator and the rest, and gives
// outside_torpor: in use while asleep minus the pool's mapped bytes minus the rank's baseline
// (context_bytes: in use once its context existed, before its pool and model), so memory that
// stays on the device outside the pool while asleep is visible.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "stress/model_flags.hpp"
#include "torpor/driver.hpp"
#include "torpor/group.hpp"

namespace torpor::cli {

struct StressOptions {
  ModelFlags model;
  int ranks = 0;  // 0 = default: every GPU on cuda, 2 on host
  bool processes = false;
  int nodes = 1;  // --nodes: emulated nodes of the processes (launch.hpp)
  std::string backend = "auto";
  int cycles = 0;
  std::string fill = "poison";
  std::vector<std::string> preserve;
  std::string negative_control;  // "", "zero-flags" or "stale-weights"
  int negative_rank = -1;        // -1 = the last rank
  std::string json;
  GroupTimeout group_timeout;  // 60 s unless the flags or TORPOR_GROUP_TIMEOUT_MS say otherwise
  bool progress = true;        // a progress line on rank 0's stderr when it is a terminal
  bool worker = false;
};

// A sleep/wake pattern: sleep(level, sleep_tags), then wake_up(tags) for each entry of wakes, in
// order; when level 2 put "weights" to sleep, the weights are reloaded right after the wake that
// brought "weights" back.
struct SleepPattern {
  std::string name;
  int level = 1;
  std::vector<std::string> sleep_tags;          // empty = every tag
  std::vector<std::vector<std::string>> wakes;  // each: empty = every tag
};

const std::vector<SleepPattern>& soak_patterns();
SleepPattern plan_level1();
SleepPattern plan_level2();

// One rank's run of the plan. Throws rank_failure (with the rows so far) when a step fails on
// any rank.
nlohmann::json stress_rank(const StressOptions& options, Driver& driver, Group& group, int device);

}  // namespace torpor::cli
