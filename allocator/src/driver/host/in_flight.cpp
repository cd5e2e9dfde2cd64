// The memory side of HostDriver's asynchronous mode: the ranges each queued operation touches,
// registered from its submission until its worker has done it.
//
// With them the ordering bugs of a sleep engine fail at once on a CPU machine: unmapping or
// freeing memory a queued operation still touches is refused (driver_error, counted in
// async_conflicts); two operations on different streams that touch the same bytes, one writing,
// with nothing ordering them, are a race (counted and logged when the later one runs); a
// page-locked host span changed by the host between a copy's queueing and its run is counted in
// async_host_writes. A worker cannot throw into the thread that queued the work, so the last two
// are counted, not thrown.
#include <mutex>
#include <utility>

#include "driver/host/async_engine.hpp"
#include "driver/host/state.hpp"
#include "torpor/log.hpp"

namespace torpor {

using host::fingerprint_of;
using host::misuse;

std::uint64_t HostDriver::register_in_flight(std::vector<InFlight> ranges) {
  std::uint64_t op = next_op_++;
  in_flight_[op] = std::move(ranges);
  return op;
}

void HostDriver::unregister_in_flight(std::uint64_t op) noexcept {
  std::lock_guard lock(mu_);
  in_flight_.erase(op);
}

// Run by an operation's worker just before the operation: an operation queued earlier on another
// stream that still touches the same bytes (one of the two writing) was not ordered before this
// one by an event or a synchronisation (it would have completed), so on a GPU the two race: a
// host span reused for a new copy while a queued copy still targets it, say. Counted and logged,
// not thrown: the worker cannot throw into the thread that queued the work.
void HostDriver::flag_races(std::uint64_t op) noexcept {
  std::lock_guard lock(mu_);
  auto mine = in_flight_.find(op);
  if (mine == in_flight_.end()) return;
  for (auto it = in_flight_.begin(); it != mine; ++it)
    for (const InFlight& a : it->second)
      for (const InFlight& b : mine->second) {
        if (a.stream == b.stream || !(a.writes || b.writes) || a.lo >= b.hi || b.lo >= a.hi) continue;
        ++async_races_;
        log::error("HostDriver: a {} on stream {} touches [{:#x}, {:#x}) while a {} queued earlier on stream {} "
                   "([{:#x}, {:#x})) is not done and nothing orders the two; record an event after the first and "
                   "wait for it on the second stream",
                   b.call, b.stream, b.lo, b.hi, a.call, a.stream, a.lo, a.hi);
      }
  // A watched host span whose bytes changed since the copy was queued: nothing queued could
  // write it (see copy_async in streams.cpp), so the host did, under a copy that still targets
  // it. On a GPU the copy would take the new bytes or overwrite them, depending on timing.
  for (const InFlight& r : mine->second) {
    if (!r.watched || fingerprint_of(r.lo, r.hi) == r.fingerprint) continue;
    ++async_host_writes_;
    log::error("HostDriver: the host changed [{:#x}, {:#x}) after a {} on stream {} that {} it was queued and "
               "before it ran; wait for the copy (an event or the stream) before reusing the span",
               r.lo, r.hi, r.call, r.stream, r.writes ? "writes" : "reads");
  }
}

void HostDriver::refuse_if_in_flight(std::uintptr_t lo, std::uintptr_t hi, const char* call) {
  for (auto& [op, ranges] : in_flight_) {
    for (const InFlight& r : ranges) {
      if (r.lo >= hi || lo >= r.hi) continue;
      ++async_conflicts_;
      misuse(call, fmt::format("[{:#x}, {:#x}) is still touched by a queued {} on stream {} ([{:#x}, {:#x})); "
                               "synchronize the stream or an event recorded after it first",
                               lo, hi, r.call, r.stream, r.lo, r.hi));
    }
  }
}

std::uint64_t HostDriver::submit(Stream s, std::function<void()> work, std::vector<InFlight> ranges) {
  std::uint64_t op;
  {
    std::lock_guard lock(mu_);
    op = register_in_flight(std::move(ranges));
  }
  try {
    return async_->submit(s.value, [this, op, work = std::move(work)] {
      flag_races(op);
      work();
      unregister_in_flight(op);
    });
  } catch (...) {
    unregister_in_flight(op);
    throw;
  }
}

}  // namespace torpor
