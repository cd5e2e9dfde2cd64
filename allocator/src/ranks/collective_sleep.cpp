// Collective sleep and wake over a Group: agree on the request, act, agree on the outcome,
// roll a failed sleep back. See collective_sleep.hpp for the semantics.
//
// Invariants: no rank touches its pool before every rank has seen every request and found
// them equal; every rank makes the same group calls in the same order whatever happens
// locally (a local failure is caught and reported through the outcome all-gather, never
// thrown past a collective other ranks are waiting in); every rank raises the same error type.
#include "torpor/collective_sleep.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <span>

#include "torpor/log.hpp"

namespace torpor {

namespace {

// The error types a rank's failure travels as, so every rank raises the failed rank's type.
enum class Failure : std::uint8_t {
  none = 0,
  error,
  invalid_argument,
  invalid_state,
  out_of_memory,
  timeout,
  unavailable,
  driver,
};

struct Outcome {
  Failure failure = Failure::none;
  std::string message;
};

Failure classify(const std::exception& e) {
  if (dynamic_cast<const invalid_argument*>(&e)) return Failure::invalid_argument;
  if (dynamic_cast<const invalid_state*>(&e)) return Failure::invalid_state;
  if (dynamic_cast<const out_of_memory*>(&e) || dynamic_cast<const std::bad_alloc*>(&e)) return Failure::out_of_memory;
  if (dynamic_cast<const timeout_error*>(&e)) return Failure::timeout;
  if (dynamic_cast<const unavailable*>(&e)) return Failure::unavailable;
  if (const auto* d = dynamic_cast<const driver_error*>(&e))
    return d->is_out_of_memory() ? Failure::out_of_memory : Failure::driver;
  return Failure::error;
}

[[noreturn]] void raise(Failure f, const std::string& text) {
  switch (f) {
    case Failure::invalid_argument: throw invalid_argument(text);
    case Failure::invalid_state: throw invalid_state(text);
    case Failure::out_of_memory: throw out_of_memory(text);
    case Failure::timeout: throw timeout_error(text);
    case Failure::unavailable: throw unavailable(text);
    case Failure::none:
    case Failure::error:
    case Failure::driver: throw error(text);
  }
  throw error(text);
}

std::vector<std::byte> to_bytes(std::string_view s) {
  auto b = std::as_bytes(std::span(s.data(), s.size()));
  return {b.begin(), b.end()};
}

std::string to_text(const std::vector<std::byte>& b) { return {reinterpret_cast<const char*>(b.data()), b.size()}; }

// A canonical text of a request: the same operation gives the same bytes on every rank.
std::string request_text(std::string_view op, int level, std::vector<std::string> tags) {
  std::sort(tags.begin(), tags.end());
  tags.erase(std::unique(tags.begin(), tags.end()), tags.end());
  std::string out = fmt::format("{} level {} tags [", op, level);
  for (std::size_t i = 0; i < tags.size(); ++i) out += fmt::format("{}{:?}", i ? ", " : "", tags[i]);
  return out + "]";
}

// Throws invalid_argument on every rank when the requests differ; nothing has happened yet.
void agree(Group& group, const std::string& op, const std::string& mine) {
  auto all = group.all_gather(to_bytes(mine));
  const std::string first = to_text(all[0]);
  std::vector<int> differ;
  std::string theirs;
  for (std::size_t r = 1; r < all.size(); ++r) {
    std::string t = to_text(all[r]);
    if (t == first) continue;
    differ.push_back(static_cast<int>(r));
    theirs += fmt::format("; rank {}: {}", r, t);
  }
  if (!differ.empty())
    throw invalid_argument(fmt::format("{} on group rank {} of {} ({}): rank(s) {} asked for another operation than "
                                       "rank 0 (rank 0: {}{}); no rank changed anything",
                                       op, group.rank(), group.size(), group.kind(), format_ranks(differ), first,
                                       theirs));
}

// Outcome wire form: one byte of Failure, then the message.
std::vector<Outcome> gather_outcomes(Group& group, const Outcome& mine) {
  std::string wire(1, static_cast<char>(mine.failure));
  wire += mine.message;
  auto all = group.all_gather(to_bytes(wire));
  std::vector<Outcome> out;
  out.reserve(all.size());
  for (const auto& b : all) {
    Outcome o;
    if (!b.empty()) {
      auto f = static_cast<std::uint8_t>(b[0]);
      o.failure = f <= static_cast<std::uint8_t>(Failure::driver) ? static_cast<Failure>(f) : Failure::error;
      o.message.assign(reinterpret_cast<const char*>(b.data()) + 1, b.size() - 1);
    } else {
      o.failure = Failure::error;
      o.message = "sent an empty outcome";
    }
    out.push_back(std::move(o));
  }
  return out;
}

template <typename F>
Outcome attempt(F&& f, TransitionReport& report) {
  try {
    report = f();
    return {};
  } catch (const std::exception& e) {
    return {classify(e), e.what()};
  }
}

// The failed ranks and their messages, and the error type to raise (the first failed rank's).
struct Failures {
  std::vector<int> ranks;
  std::string details;
  Failure first = Failure::none;
};

Failures failures_of(const std::vector<Outcome>& all) {
  Failures f;
  for (std::size_t r = 0; r < all.size(); ++r) {
    if (all[r].failure == Failure::none) continue;
    if (f.ranks.empty()) f.first = all[r].failure;
    f.ranks.push_back(static_cast<int>(r));
    f.details += fmt::format("; rank {}: {}", r, all[r].message);
  }
  return f;
}

std::vector<std::string> resolved(const Pool& pool, const std::vector<std::string>& tags) {
  return tags.empty() ? pool.tags() : tags;
}

}  // namespace

TransitionReport collective_sleep(Pool& pool, Group& group, int level, const std::vector<std::string>& tags) {
  agree(group, "collective_sleep", request_text("sleep", level, tags));

  std::vector<std::string> were_awake;  // what a rollback wakes: nothing that slept before the call
  TransitionReport report;
  // Inside attempt(): an unknown tag must reach the outcome exchange, not skip it.
  Outcome mine = attempt(
      [&] {
        for (const auto& t : resolved(pool, tags))
          if (!pool.asleep(t)) were_awake.push_back(t);
        return pool.sleep(level, tags);
      },
      report);
  Failures failed = failures_of(gather_outcomes(group, mine));
  if (failed.ranks.empty()) return report;

  std::string rollback = "every rank woke back up";
  if (!were_awake.empty()) {
    try {
      pool.wake_up(were_awake);
    } catch (const std::exception& e) {
      rollback = fmt::format("this rank (group rank {}) could NOT wake back up: {}", group.rank(), e.what());
      log::error("collective_sleep: rollback wake on group rank {} failed: {}", group.rank(), e.what());
    }
  }
  raise(failed.first,
        fmt::format("collective_sleep (level {}) on group rank {} of {} ({}): rank(s) {} failed to sleep{}; {}", level,
                    group.rank(), group.size(), group.kind(), format_ranks(failed.ranks), failed.details, rollback));
}

TransitionReport collective_wake_up(Pool& pool, Group& group, const std::vector<std::string>& tags) {
  agree(group, "collective_wake_up", request_text("wake_up", 0, tags));
  TransitionReport report;
  Outcome mine = attempt([&] { return pool.wake_up(tags); }, report);
  Failures failed = failures_of(gather_outcomes(group, mine));
  if (failed.ranks.empty()) return report;
  raise(failed.first,
        fmt::format("collective_wake_up on group rank {} of {} ({}): rank(s) {} are still asleep{}; the "
                    "ranks that woke stay awake: call collective_wake_up again on every rank once the "
                    "cause is gone",
                    group.rank(), group.size(), group.kind(), format_ranks(failed.ranks), failed.details));
}

}  // namespace torpor
