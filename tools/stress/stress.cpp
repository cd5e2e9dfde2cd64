// `torpor stress`: the sleep-mode test plan (stress_plan.hpp) on the tiny MoE model over N ranks,
// as threads of this process (default) or one process per device (--processes), then the table
// and the verdict (stress_report.hpp). Exit 0 only when every output of every rank matches the
// first one token for token and the soak shows no growth; the negative control always exits
// non-zero (it proves the check catches lost state).
#include <fmt/core.h>

#include <cstdio>
#include <cstdlib>

#include "commands.hpp"
#include "launch/launch.hpp"
#include "output.hpp"
#include "stress/stress_plan.hpp"
#include "stress/stress_report.hpp"
#include "torpor/error.hpp"

namespace torpor::cli {

namespace {

std::vector<std::string> worker_args(const StressOptions& o, int ranks) {
  std::vector<std::string> a = {"stress",         "--worker",
                                "--backend",      o.backend,
                                "--ranks",        std::to_string(ranks),
                                "--cycles",       std::to_string(o.cycles),
                                "--fill-on-wake", o.fill};
  auto t = o.group_timeout.worker_args();
  a.insert(a.end(), t.begin(), t.end());
  for (const auto& g : o.preserve) {
    a.emplace_back("--preserve");
    a.push_back(g);
  }
  if (!o.negative_control.empty()) {
    a.emplace_back("--negative-control");
    a.push_back(o.negative_control);
    a.emplace_back("--negative-control-rank");
    a.push_back(std::to_string(o.negative_rank));
  }
  if (!o.progress) a.emplace_back("--no-progress");
  auto m = o.model.args();
  a.insert(a.end(), m.begin(), m.end());
  return a;
}

int stress_main(StressOptions o) {
  const Backend backend = parse_backend(o.backend);
  if (o.ranks == 0) o.ranks = default_ranks(backend);
  if (o.ranks < 1) throw invalid_argument(fmt::format("--ranks {}: at least one rank is needed", o.ranks));
  if (o.negative_rank == -1) o.negative_rank = o.ranks - 1;  // the default: the last rank
  if (o.negative_rank < 0 || o.negative_rank >= o.ranks)
    throw invalid_argument(fmt::format("--negative-control-rank {}: use a rank in [0, {}] ({} ranks)", o.negative_rank,
                                       o.ranks - 1, o.ranks));
  LaunchOptions lo = model_launch(backend, o.ranks, o.processes, o.group_timeout.value, o.model.wait_timeout_ms);
  lo.nodes = o.nodes;
  lo.worker_args = worker_args(o, o.ranks);
  LaunchResult r =
      launch(lo, [&o](Driver& driver, Group& group, int device) { return stress_rank(o, driver, group, device); });

  StressExpectations ex;
  ex.ranks = o.ranks;
  ex.cycles = o.cycles;
  ex.soak_patterns = soak_patterns().size();
  ex.negative_control = !o.negative_control.empty();
  ex.graphs = r.device_kernels && !o.model.no_graphs;  // the runner captures graphs where its kernels run on a device
  StressSummary s = summarize(r, ex);
  s.json["processes"] = o.processes;
  if (o.json != "-") fmt::print("{}", render(s));
  bool written = true;
  if (!o.json.empty()) {
    if (o.json == "-")
      fmt::print("{}\n", s.json.dump(2));
    else
      written = write_json_file(o.json, s.json, "stress");
  }
  std::fflush(stdout);
  if (r.abandoned) {
    // Some rank threads never returned (they still use the driver and the group): leave now.
    fmt::print(stderr, "torpor stress: exiting with rank threads still running\n");
    std::fflush(stderr);
    std::_Exit(1);
  }
  return s.pass && written ? 0 : 1;
}

int stress_worker(const StressOptions& o) {
  GroupOptions go;
  go.timeout = o.group_timeout.value;
  return run_worker(parse_backend(o.backend), go,
                    [&o](Driver& driver, Group& group, int device) { return stress_rank(o, driver, group, device); });
}

}  // namespace

int run_stress(const StressOptions& o) { return o.worker ? stress_worker(o) : stress_main(o); }

}  // namespace torpor::cli
