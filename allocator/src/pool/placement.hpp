// Where an allocation goes: the handle-size policy (PoolOptions) and the slab policy.
//
// Size classes: small allocations are carved from granularity-sized slabs, medium ones from
// slabs that grow with the (tag, class) up to medium_slab_max, large ones get a chunk each. Few
// large handles keep the VMM calls of sleep and wake few: a VMM call's cost grows far more slowly
// than the handle's size, so per byte large handles are much cheaper
// (bench/results/2026-11-30-vmm-costs-h200.md).
//
// The fast path (a slab of the right (tag, class) with room) touches only the slab's
// RangeAllocator and the chunk map: no driver call. Freed empty small slabs are kept, one per
// (tag, class), so alloc/free churn stays on the fast path (dispose_if_spare); trim() and sleep
// release them. Empty medium slabs are released at once (they are large).
#pragma once

#include <cstddef>

#include "pool/pool_state.hpp"

namespace torpor {

struct Placement {
  Chunk* chunk = nullptr;
  std::size_t offset = 0;
  std::size_t footprint = 0;
};

// A place for `bytes` of `options`: carved from a slab with room, or in a new chunk. Under mu.
Placement place(Pool::State& s, std::size_t bytes, const AllocationOptions& options);

// `c` has just become empty: an awake small slab is kept for the fast path, one per (tag, class);
// a second goes (a failure to release it is logged and the slab kept).
void dispose_if_spare(Pool::State& s, Chunk& c);

}  // namespace torpor
