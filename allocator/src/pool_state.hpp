// Internal bookkeeping of a Pool, shared by pool.cpp (allocation) and sleep.cpp (sleep/wake).
//
// Invariants, all under State::mu:
//   - every Allocation lies inside exactly one Chunk, at Allocation::offset, and its
//     segments cover [0, bytes) without gaps, adjacent segments differing in class or name;
//   - a Chunk belongs to one tag; an awake Chunk holds a handle mapped at [va, va + bytes)
//     with access set for State::access_devices and has no backups; an asleep Chunk holds no
//     handle, nothing is mapped at its VA, and its backups cover exactly the allocated bytes
//     that must survive, each backup pointing at its own HostStore range;
//   - TagState::asleep is true from the start of a sleep until every chunk of the tag woke.
#pragma once

#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_set>
#include <vector>

#include "torpor/driver.hpp"
#include "torpor/host_store.hpp"
#include "torpor/pool.hpp"
#include "torpor/range_allocator.hpp"

namespace torpor {

struct Segment {
  std::size_t end = 0;  // exclusive, in allocation offsets
  MemoryClass cls = MemoryClass::state;
  std::string name;
};

struct Chunk;

struct Allocation {
  device_ptr base = 0;
  std::size_t bytes = 0;      // as requested
  std::size_t footprint = 0;  // bytes taken in the chunk (rounded)
  std::size_t offset = 0;     // inside the chunk
  Chunk* chunk = nullptr;
  std::map<std::size_t, Segment> segments;  // start -> segment
};

struct Backup {
  std::size_t bytes = 0;       // device bytes kept
  std::byte* host = nullptr;   // where they are
  std::size_t host_bytes = 0;  // host store bytes owned (>= bytes: the store rounds up)
};

struct Chunk {
  device_ptr va = 0;
  std::size_t bytes = 0;
  std::string tag;
  MemoryClass cls = MemoryClass::state;  // the (tag, class) pair a slab serves
  bool slab = false;
  PhysicalHandle handle;
  bool awake = true;
  int level = 0;                        // when asleep
  std::map<std::size_t, Backup> backups;  // chunk offset -> backup (asleep only)
  RangeAllocator space;                 // slab only
  std::map<std::size_t, Allocation*> allocations;  // chunk offset -> allocation
};

struct TagState {
  bool asleep = false;
  int level = 0;
};

struct Pool::State {
  State(Driver& d, const PoolOptions& o, std::size_t gran, device_ptr base)
      : driver(d), options(o), granularity(gran), va_base(base), va(o.va_bytes), host(d) {}

  Driver& driver;
  const PoolOptions& options;
  std::size_t granularity;
  device_ptr va_base;
  std::vector<int> access_devices;
  Stream stream;

  mutable std::mutex mu;
  RangeAllocator va;  // offsets from va_base
  HostStore host;
  std::map<device_ptr, std::unique_ptr<Chunk>> chunks;             // by va
  std::map<device_ptr, std::unique_ptr<Allocation>> allocations;  // by base
  std::map<std::string, TagState, std::less<>> tags;
  std::vector<std::string> preserve;
  std::vector<PhysicalHandle> pending_release;
  std::map<device_ptr, std::size_t> address_ranges;  // reserve_address_range spans
  std::vector<SleepObserver*> observers;
  std::deque<device_ptr> recently_freed;  // for "double free" messages
  std::unordered_set<device_ptr> recently_freed_set;

  // --- helpers shared by allocation and sleep -----------------------------------------------
  // A new awake chunk of `bytes` for (tag, cls): VA, create, map, set access; rolls back and
  // throws on failure (out_of_memory for device or VA exhaustion).
  Chunk& new_chunk(std::size_t bytes, const std::string& tag, MemoryClass cls, bool slab);
  // Create + map + set access for an existing VA span; returns the handle. Rolls back on failure.
  PhysicalHandle map_new_memory(device_ptr va, std::size_t bytes, const std::string& tag);
  // Unmap and release an awake chunk's memory. unmap failure throws with nothing changed; a
  // release failure is kept in pending_release and logged (the chunk is unmapped either way).
  void unmap_and_release(Chunk& c);
  void release_or_defer(PhysicalHandle h) noexcept;
  // Retry deferred releases; failures stay pending (logged).
  void retry_pending_releases() noexcept;
  // Drop a chunk with no allocations: unmaps if awake, frees backups and VA.
  void dispose_chunk(Chunk& c);
  // Free the backup bytes of chunk offsets [lo, hi), splitting backups that straddle.
  void drop_backups(Chunk& c, std::size_t lo, std::size_t hi);
  void drop_all_backups(Chunk& c) noexcept;
  bool preserved(const Segment& s) const;
  // Whether the bytes of a segment survive a sleep at `level`.
  bool survives(const Segment& s, int level) const;
  std::vector<std::string> resolve_tags(const std::vector<std::string>& requested, const char* operation) const;
};

}  // namespace torpor
