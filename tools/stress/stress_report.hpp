// `torpor stress`'s verdict and its table, from the ranks' JSON rows (stress_plan.hpp). Pure
// functions of their input, so the bookkeeping is tested without running a model.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "launch/launch.hpp"

namespace torpor::cli {

// NOLINTNEXTLINE(bugprone-exception-escape): clang-tidy 14 takes nlohmann::json's noexcept move for a throwing one
struct StressSummary {
  bool pass = false;
  std::vector<std::string> problems;
  nlohmann::json json;  // what --json writes
};

struct StressExpectations {
  int ranks = 0;
  int cycles = 0;
  std::size_t soak_patterns = 6;  // cycles before the growth check starts (each pattern once)
  bool negative_control = false;  // then the run must fail, and pass is always false
  bool graphs = false;            // cuda with graphs on: exactly one graph captured per rank (one batch size)
};

// Aggregates rows by step over the ranks (bytes summed, seconds max, matching min) and lists
// every problem: a rank that failed, an output that differs from the reference, ranks that
// disagree on the reference, growth of live physical bytes / host store / mapped bytes after
// the soak's warm-up cycles, bytes in CUDA's graph allocator while asleep (graph memory outside
// the pool). Each rank's device memory (per_rank[].memory: the split awake / asleep / after
// wake of the first transition of each level, the range of outside_torpor) is reported, not
// judged: on a GPU it includes the libraries' own allocations.
StressSummary summarize(const LaunchResult& launch, const StressExpectations& expect);

// The table and the summary lines.
std::string render(const StressSummary& summary);

}  // namespace torpor::cli
