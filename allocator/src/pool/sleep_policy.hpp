// The class x level policy: what a sleep at a level does to the bytes of each memory class.
// This is the one place that decides it; Pool::State::survives (used by the sleep plan and by
// deepening an asleep chunk) asks here, and pool.hpp's table documents it for users.
//
//   class       none          offload (1)   discard_parameters (2)
//   parameter   stays mapped  offload       discard, or offload when its name matches a preserve glob
//   state       stays mapped  offload       offload
//   cache       stays mapped  discard       discard
//
// Invariants (checked below at compile time): state always survives, cache never does once
// memory goes; a deeper level never keeps bytes a shallower one discards, so deepening an
// asleep chunk only drops backups and never needs bytes that are gone.
#pragma once

#include <cstdint>

#include "torpor/pool.hpp"

namespace torpor {

enum class SegmentFate : std::uint8_t {
  stays_mapped,          // level none: the memory is not touched
  offload,               // copied to the host store, restored on wake
  discard,               // released without a copy: undefined (or filled) on wake
  offload_if_preserved,  // offload when the segment's name matches a preserve glob, else discard
};

constexpr SegmentFate segment_fate(MemoryClass cls, SleepLevel level) noexcept {
  if (level == SleepLevel::none) return SegmentFate::stays_mapped;
  switch (cls) {
    case MemoryClass::parameter:
      return level == SleepLevel::offload ? SegmentFate::offload : SegmentFate::offload_if_preserved;
    case MemoryClass::state: return SegmentFate::offload;
    case MemoryClass::cache: return SegmentFate::discard;
  }
  return SegmentFate::offload;  // classes are validated on entry; keeping bytes is the safe side
}

// Whether bytes with this fate are still there after wake. `preserved` (a callable returning
// bool) is asked only for offload_if_preserved: matching globs costs an fnmatch per glob.
template <typename Preserved>
constexpr bool survives(SegmentFate fate, Preserved&& preserved) {
  switch (fate) {
    case SegmentFate::stays_mapped:
    case SegmentFate::offload: return true;
    case SegmentFate::discard: return false;
    case SegmentFate::offload_if_preserved: return preserved();
  }
  return true;
}

namespace sleep_policy_check {

constexpr bool deeper_levels_keep_no_more() {
  for (auto cls : {MemoryClass::parameter, MemoryClass::state, MemoryClass::cache})
    for (bool preserved : {false, true}) {
      auto p = [preserved] { return preserved; };
      bool at1 = survives(segment_fate(cls, SleepLevel::offload), p);
      bool at2 = survives(segment_fate(cls, SleepLevel::discard_parameters), p);
      if (at2 && !at1) return false;
    }
  return true;
}
static_assert(deeper_levels_keep_no_more(), "deepening a sleep must only drop backups");
static_assert(segment_fate(MemoryClass::state, SleepLevel::discard_parameters) == SegmentFate::offload);
static_assert(segment_fate(MemoryClass::cache, SleepLevel::offload) == SegmentFate::discard);

}  // namespace sleep_policy_check

}  // namespace torpor
