// Collective sleep and wake over a Group: agree on the request, act, agree on the outcome,
// roll a failed sleep back (the agreement and the outcome exchange are consensus.hpp's). See collective_sleep.hpp for
// the semantics.
//
// Invariants: no rank touches its pool before every rank has seen every request and found
// them equal; every rank makes the same group calls in the same order whatever happens
// locally (a local failure is caught and reported through the outcome all-gather, never
// thrown past a collective other ranks are waiting in); every rank raises the same error type.
#include "torpor/collective_sleep.hpp"

#include <fmt/core.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <functional>

#include "torpor/consensus.hpp"
#include "torpor/log.hpp"

namespace torpor {

namespace {

// A canonical text of a request: the same operation gives the same bytes on every rank.
std::string request_text(std::string_view op, int level, std::vector<std::string> tags) {
  std::sort(tags.begin(), tags.end());
  tags.erase(std::unique(tags.begin(), tags.end()), tags.end());
  std::string out = fmt::format("{} level {} tags [", op, level);
  for (std::size_t i = 0; i < tags.size(); ++i) out += fmt::format("{}{:?}", i ? ", " : "", tags[i]);
  return out + "]";
}

std::vector<std::string> resolved(const Pool& pool, const std::vector<std::string>& tags) {
  return tags.empty() ? pool.tags() : tags;
}

// "awake" or "still asleep" (some of the tags), for a message; never throws.
std::string state_of(const Pool& pool, const std::vector<std::string>& tags) noexcept {
  try {
    const auto wanted = resolved(pool, tags);
    const bool awake = std::none_of(wanted.begin(), wanted.end(), [&](const std::string& t) { return pool.asleep(t); });
    return awake ? "awake" : "still asleep";
  } catch (const std::exception&) {
    return "in an unknown state";
  }
}

// What this rank did about its own sleep when the outcome exchange itself failed. No rank can
// learn the others' outcome then, so each rank undoes its own sleep: a rank left asleep behind an
// error would look like a failed collective while refusing allocations, and a woken rank is what
// every failed collective_sleep promises.
std::string roll_back_after_lost_exchange(Group& group, const std::function<void()>& wake_back) {
  try {
    wake_back();
    return fmt::format("this rank (group rank {}) woke back up", group.rank());
  } catch (const std::exception& e) {
    log::error("collective_sleep: rollback wake on group rank {} after a failed outcome exchange failed: {}",
               group.rank(), e.what());
    return fmt::format("this rank (group rank {}) could NOT wake back up: {}", group.rank(), e.what());
  }
}

}  // namespace

TransitionReport collective_sleep(Pool& pool, Group& group, int level, const std::vector<std::string>& tags) {
  consensus::agree(group, "collective_sleep", request_text("sleep", level, tags));

  std::vector<std::string> were_awake;  // what a rollback wakes: nothing that slept before the call
  TransitionReport report;
  // Inside the action: an unknown tag must reach the outcome exchange, not skip it.
  auto sleep = [&] {
    for (const auto& t : resolved(pool, tags))
      if (!pool.asleep(t)) were_awake.push_back(t);
    report = pool.sleep(level, tags);
  };
  auto wake_back = [&] {
    if (!were_awake.empty()) pool.wake_up(were_awake);
  };
  consensus::Outcomes outcomes;
  try {
    outcomes = consensus::run_all_or_none(group, sleep, wake_back);
  } catch (const std::exception& e) {
    const std::string rolled_back = roll_back_after_lost_exchange(group, wake_back);
    consensus::raise(consensus::classify(e),
                     fmt::format("collective_sleep (level {}) on group rank {} of {} ({}): the ranks could not "
                                 "exchange their outcomes ({}); {}; other ranks may be awake or asleep: once the "
                                 "group works again (see recover in group.hpp), call collective_wake_up on every rank",
                                 level, group.rank(), group.size(), group.kind(), e.what(), rolled_back));
  }
  if (outcomes.ok()) return report;

  std::string rollback = "every rank woke back up";
  if (!outcomes.rollback_failure.empty()) {
    rollback =
        fmt::format("this rank (group rank {}) could NOT wake back up: {}", group.rank(), outcomes.rollback_failure);
    log::error("collective_sleep: rollback wake on group rank {} failed: {}", group.rank(), outcomes.rollback_failure);
  }
  outcomes.raise(
      fmt::format("collective_sleep (level {}) on group rank {} of {} ({}): rank(s) {} failed to sleep{}; {}", level,
                  group.rank(), group.size(), group.kind(), format_ranks(outcomes.failed_ranks()), outcomes.details(),
                  rollback));
}

TransitionReport collective_wake_up(Pool& pool, Group& group, const std::vector<std::string>& tags) {
  consensus::agree(group, "collective_wake_up", request_text("wake_up", 0, tags));
  TransitionReport report;
  consensus::Outcomes outcomes;
  try {
    outcomes = consensus::run_all_or_none(group, [&] { report = pool.wake_up(tags); });
  } catch (const std::exception& e) {
    // This rank's own wake stands (a wake is idempotent): say where it is, not only the group's error.
    consensus::raise(consensus::classify(e),
                     fmt::format("collective_wake_up on group rank {} of {} ({}): the ranks could not exchange "
                                 "their outcomes ({}); this rank is {}; once the group works again, call "
                                 "collective_wake_up on every rank",
                                 group.rank(), group.size(), group.kind(), e.what(), state_of(pool, tags)));
  }
  if (outcomes.ok()) return report;
  outcomes.raise(fmt::format("collective_wake_up on group rank {} of {} ({}): rank(s) {} are still asleep{}; the "
                             "ranks that woke stay awake: call collective_wake_up again on every rank once the "
                             "cause is gone",
                             group.rank(), group.size(), group.kind(), format_ranks(outcomes.failed_ranks()),
                             outcomes.details()));
}

}  // namespace torpor
