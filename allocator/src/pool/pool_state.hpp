// Internal bookkeeping of a Pool, shared by pool.cpp (allocation) and sleep.cpp (sleep/wake).
//
// Invariants, all under State::mu:
//   - every Allocation lies inside exactly one Chunk, at Allocation::offset, and its
//     segments cover [0, bytes) without gaps, adjacent segments differing in class or name;
//   - a Chunk belongs to one tag; an awake Chunk holds a handle mapped at [va, va + bytes)
//     with access set for State::access_devices and has no backups; an asleep Chunk holds no
//     handle, nothing is mapped at its VA, and its backups cover exactly the allocated bytes
//     that survive its level (sleep_policy.hpp), each backup owning its own HostStore span;
//   - retained copies (skip_unchanged) exist only on awake chunks; each owns its span and
//     holds the content hash the bytes had when copied; a retained copy is only trusted
//     after hashing the device bytes again;
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
#include "pool/host_store.hpp"
#include "torpor/pool.hpp"
#include "pool/range_allocator.hpp"

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

// A host copy of chunk bytes [offset, offset + bytes): a backup while asleep, a retained
// copy while awake.
struct HostCopy {
  std::size_t bytes = 0;
  HostSpan span;  // span.bytes >= bytes
  Hash128 hash;   // of the bytes when copied (valid when hashed)
  bool hashed = false;
};

enum class ChunkKind : std::uint8_t { dedicated, small_slab, medium_slab };

struct Chunk {
  device_ptr va = 0;
  std::size_t bytes = 0;
  std::string tag;
  MemoryClass cls = MemoryClass::state;  // the (tag, class) pair a slab serves
  ChunkKind kind = ChunkKind::dedicated;
  PhysicalHandle handle;
  bool awake = true;
  SleepLevel level = SleepLevel::none;         // when asleep
  std::map<std::size_t, HostCopy> backups;     // chunk offset -> copy (asleep only)
  std::map<std::size_t, HostCopy> retained;    // chunk offset -> copy (awake only)
  RangeAllocator space;                        // slabs only
  std::map<std::size_t, Allocation*> allocations;  // chunk offset -> allocation

  bool slab() const noexcept { return kind != ChunkKind::dedicated; }
};

struct TagState {
  bool asleep = false;
  SleepLevel level = SleepLevel::none;
};

struct Pool::State {
  State(Driver& d, const PoolOptions& o, std::size_t gran, device_ptr base)
      : driver(d), options(o), granularity(gran), va_base(base), va(o.va_bytes), host(d, o.host_store_limit) {}

  Driver& driver;
  const PoolOptions& options;
  std::size_t granularity;
  device_ptr va_base;
  std::vector<int> access_devices;
  std::vector<Stream> streams;  // copy streams; streams[0] also serves copy() and hash()
  std::vector<Event> events;    // reused across sleeps, grown on demand
  std::byte* staging = nullptr; // pinned ring for pageable backups, allocated on first use
  std::vector<Event> staging_events;

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
  Chunk& new_chunk(std::size_t bytes, const std::string& tag, MemoryClass cls, ChunkKind kind);
  // Create + map + set access for an existing VA span; returns the handle. Rolls back on failure.
  PhysicalHandle map_new_memory(device_ptr va, std::size_t bytes, const std::string& tag);
  PhysicalHandle create_memory(std::size_t bytes, const std::string& tag);
  // Unmap and release an awake chunk's memory. unmap failure throws with nothing changed; a
  // release failure is kept in pending_release and logged (the chunk is unmapped either way).
  void unmap_and_release(Chunk& c);
  void release_or_defer(PhysicalHandle h) noexcept;
  // Retry deferred releases; failures stay pending (logged).
  void retry_pending_releases() noexcept;
  // Drop a chunk with no allocations: unmaps if awake, frees host copies and VA.
  void dispose_chunk(Chunk& c);
  // Free the host copies of chunk offsets [lo, hi) in `copies`, splitting those that straddle.
  void drop_copies(std::map<std::size_t, HostCopy>& copies, std::size_t lo, std::size_t hi);
  void drop_all_copies(std::map<std::size_t, HostCopy>& copies) noexcept;
  void free_span(const HostSpan& span) noexcept;
  bool preserved(const Segment& s) const;
  // Whether the bytes of a segment survive a sleep at `level` (sleep_policy.hpp decides).
  bool survives(const Segment& s, SleepLevel level) const;
  // The allocation containing p (interior pointers too), or nullptr.
  Allocation* containing(device_ptr p) const;
  std::vector<std::string> resolve_tags(const std::vector<std::string>& requested, const char* operation) const;
  Event event(std::size_t i);  // the i-th reusable event, created on demand
  // Copies between device memory and pageable host memory through the pinned staging ring,
  // on `stream`. Returns when the bytes are in `dst` (to host) or enqueued (to device).
  void staged_to_host(std::byte* dst, device_ptr src, std::size_t bytes, Stream stream);
  void staged_to_device(device_ptr dst, const std::byte* src, std::size_t bytes, Stream stream);
};

}  // namespace torpor
