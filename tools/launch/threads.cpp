// The threads launcher (launchers.hpp): one thread per rank, all on one driver and a thread
// group. A rank that is still running failure_grace after the first failure is abandoned: the
// state the threads use is shared with them, so it outlives this call (see launch.hpp).
#include <fmt/core.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "launch/launchers.hpp"

namespace torpor::cli {

namespace {

using clock_type = std::chrono::steady_clock;

}  // namespace

LaunchResult launch_threads(const LaunchOptions& o, const RankBody& body) {
  DriverSelection sel = open_rank_driver(o.backend, o.ranks);
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    int done = 0;
    std::optional<clock_type::time_point> first_failure;
    std::vector<RankOutcome> out;
    std::vector<bool> finished;
    std::shared_ptr<Driver> driver;
    std::vector<std::unique_ptr<Group>> groups;
    RankBody body;
  };
  // Shared with the threads, so that abandoning a thread that never returns stays safe.
  auto sh = std::make_shared<Shared>();
  sh->driver = sel.driver;
  sh->groups = make_thread_group(o.ranks, o.group);
  sh->body = body;
  sh->out.resize(static_cast<std::size_t>(o.ranks));
  sh->finished.assign(static_cast<std::size_t>(o.ranks), false);
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(o.ranks));
  for (int r = 0; r < o.ranks; ++r)
    threads.emplace_back([sh, r] {
      RankOutcome out =
          outcome_of(r, [&] { return sh->body(*sh->driver, *sh->groups[static_cast<std::size_t>(r)], r); });
      std::lock_guard lock(sh->mu);
      if (!out.ok && !sh->first_failure) sh->first_failure = clock_type::now();
      sh->out[static_cast<std::size_t>(r)] = std::move(out);
      sh->finished[static_cast<std::size_t>(r)] = true;
      ++sh->done;
      sh->cv.notify_all();
    });

  LaunchResult result;
  result.backend = std::string(sel.driver->backend_name());
  result.device_kernels = sel.driver->capabilities().compute == DriverCapabilities::Compute::device_kernels;
  result.host_memory = sel.driver->capabilities().host_memory;
  std::unique_lock lock(sh->mu);
  for (;;) {
    if (sh->done == o.ranks) break;
    if (sh->first_failure && clock_type::now() >= *sh->first_failure + o.failure_grace) break;
    sh->cv.wait_for(lock, std::chrono::milliseconds(100));
  }
  if (sh->done == o.ranks) {
    lock.unlock();
    for (auto& t : threads) t.join();
    result.ranks = sh->out;
    return result;
  }
  for (int r = 0; r < o.ranks; ++r)
    if (!sh->finished[static_cast<std::size_t>(r)]) {
      auto& out = sh->out[static_cast<std::size_t>(r)];
      out.rank = r;
      out.ok = false;
      out.error = fmt::format("still running {:.0f} s after the first failure (abandoned)",
                              std::chrono::duration<double>(o.failure_grace).count());
    }
  result.ranks = sh->out;
  result.abandoned = true;
  lock.unlock();
  for (auto& t : threads) t.detach();
  return result;
}

}  // namespace torpor::cli
