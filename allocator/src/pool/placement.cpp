// The handle-size and slab policies. See placement.hpp.
#include "pool/placement.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <optional>

#include "common/range_allocator.hpp"
#include "torpor/error.hpp"
#include "torpor/log.hpp"

namespace torpor {

namespace {

constexpr std::size_t sub_alignment = 256;
// A new medium slab never makes a (tag, class) hold more than this share of what it allocated
// (at least medium_slab_min, at most medium_slab_max) mapped but unallocated.
constexpr std::size_t medium_slack_divisor = 8;
// Nor the whole pool's medium slabs hold more than this share of its VA reservation (or of the
// device's memory, when smaller) mapped but unallocated: the per-pair minimum would otherwise let
// every tag's first medium allocation take a minimum-size slab, and a pool of many tags in a small
// reservation (or on a small device) would run out of addresses (or memory) with little allocated.
constexpr std::size_t pool_slack_va_divisor = 16;

ChunkKind kind_for(std::size_t bytes, bool dedicated, const PoolOptions& o) {
  if (dedicated) return ChunkKind::dedicated;
  if (bytes <= o.small_limit) return ChunkKind::small_slab;
  if (o.medium_limit != 0 && bytes <= o.medium_limit) return ChunkKind::medium_slab;
  return ChunkKind::dedicated;
}

// The awake slabs of one kind and (tag, class): bytes mapped, and bytes of them not carved; and
// the bytes not carved in every medium slab of the pool (counted only when no slab had room).
struct PairSpace {
  std::size_t mapped = 0;
  std::size_t free = 0;
  std::size_t pool_medium_free = 0;
};

// The fast path: room in a mapped slab of this kind and (tag, class). No driver call. Sums the
// pair's slabs into `pair` (the medium slab policy sizes a new slab by them).
std::optional<Placement> carve_from_slab(Pool::State& s, ChunkKind kind, std::size_t footprint,
                                         const AllocationOptions& options, PairSpace& pair) {
  for (auto& [va, c] : s.chunks) {
    if (c->kind == ChunkKind::medium_slab) pair.pool_medium_free += c->space.free_bytes();
    if (c->kind != kind || c->tag != options.tag || c->cls != options.memory_class || !c->awake) continue;
    if (auto off = c->space.allocate(footprint, sub_alignment)) return Placement{c.get(), *off, footprint};
    pair.mapped += c->bytes;
    pair.free += c->space.free_bytes();
  }
  return std::nullopt;
}

// A new medium slab for `footprint` bytes: as large as the slack budget allows (PoolOptions: the
// pair's mapped-but-unallocated bytes stay within clamp(allocated / 8, medium_slab_min,
// medium_slab_max)), at most medium_slab_max, at least the allocation itself.
// The slab holds a whole number of footprints: a model allocates runs of same-size tensors, and
// a slab tail too short for the next one would count as slack for good, so every later slab
// would be made smaller, leaving another tail: the slabs (and the VMM calls of each sleep) would
// multiply instead of growing.
std::size_t medium_slab_bytes(const PoolOptions& o, std::size_t gran, std::size_t device_bytes, const PairSpace& pair,
                              std::size_t footprint) {
  const std::size_t need = align_up(footprint, gran);
  const std::size_t allocated = pair.mapped - pair.free + footprint;
  const std::size_t budget = std::clamp(allocated / medium_slack_divisor, o.medium_slab_min, o.medium_slab_max);
  if (budget + footprint <= pair.free) return need;  // frees left more than the budget: no slack added
  const std::size_t pool_budget = std::min(o.va_bytes, device_bytes) / pool_slack_va_divisor;
  if (pair.pool_medium_free >= pool_budget) return need;  // the pool's slack is spent: no slack added
  const std::size_t pool_limit = (need + pool_budget - pair.pool_medium_free) / gran * gran;
  const std::size_t limit =
      std::min({(budget + footprint - pair.free) / gran * gran, o.medium_slab_max, std::max(need, pool_limit)});
  const std::size_t whole = limit / footprint * footprint;  // both granule multiples: align_up stays <= limit
  return std::max(need, align_up(whole, gran));
}

bool out_of_memory_error(const std::exception& e) {
  if (dynamic_cast<const out_of_memory*>(&e) != nullptr) return true;
  const auto* d = dynamic_cast<const driver_error*>(&e);
  return d != nullptr && d->is_out_of_memory();
}

// A slab of `preferred` bytes, or, when the device (or the VA reservation) cannot hold one, a
// slab of just `need` bytes: a slab is a convenience, and an allocation that fits must not fail
// for it (nor strand, in a half-size slab, memory the next allocation needs).
Chunk& new_slab(Pool::State& s, std::size_t preferred, std::size_t need, const AllocationOptions& options,
                ChunkKind kind) {
  try {
    return s.new_chunk(preferred, options.tag, options.memory_class, kind);
  } catch (const std::exception& e) {
    if (preferred <= need || !out_of_memory_error(e)) throw;
    log::debug("pool: no room for a {}-byte slab in tag '{}' ({}); taking {} bytes", preferred, options.tag, e.what(),
               need);
  }
  return s.new_chunk(need, options.tag, options.memory_class, kind);
}

}  // namespace

Placement place(Pool::State& s, std::size_t bytes, const AllocationOptions& options) {
  const PoolOptions& o = s.options;
  ChunkKind kind = kind_for(bytes, options.dedicated, o);
  if (kind == ChunkKind::dedicated) {
    std::size_t footprint = align_up(bytes, s.granularity);
    return Placement{&s.new_chunk(footprint, options.tag, options.memory_class, kind), 0, footprint};
  }
  std::size_t footprint = align_up(bytes, sub_alignment);
  PairSpace pair;
  if (auto p = carve_from_slab(s, kind, footprint, options, pair)) return *p;
  const std::size_t need = align_up(footprint, s.granularity);
  std::size_t slab = std::max(o.slab_bytes, need);
  if (kind == ChunkKind::medium_slab) slab = medium_slab_bytes(o, s.granularity, s.device_bytes, pair, footprint);
  Chunk& c = new_slab(s, slab, need, options, kind);
  // A new slab of at least `need` bytes holds the footprint; the check only guards that.
  auto offset = c.space.allocate(footprint, sub_alignment);
  if (!offset)
    throw invalid_state(
        fmt::format("pool: a new {}-byte slab in tag '{}' cannot hold {} bytes", c.bytes, options.tag, footprint));
  return Placement{&c, *offset, footprint};
}

void dispose_if_spare(Pool::State& s, Chunk& c) {
  bool another_empty = false;
  for (auto& [va, o] : s.chunks)
    if (o.get() != &c && o->kind == c.kind && o->awake && o->allocations.empty() && o->tag == c.tag && o->cls == c.cls)
      another_empty = true;
  if (!another_empty) return;
  try {
    s.dispose_chunk(c);
  } catch (const std::exception& e) {
    log::warn("pool: releasing a spare slab failed, keeping it: {}", e.what());
  }
}

}  // namespace torpor
