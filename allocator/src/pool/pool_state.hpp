// Internal bookkeeping of a Pool, shared by the allocation path (pool.cpp) and the sleep
// engine (sleep.cpp, wake.cpp and the plan and pipelines they run). Chunks, allocations and
// host copies are defined in chunk.hpp; the helpers here are in pool_state.cpp.
//
// Invariants, all under State::mu:
//   - every Allocation lies inside exactly one Chunk, at Allocation::offset, and its
//     segments cover [0, bytes) without gaps, adjacent segments differing in class or name;
//   - a Chunk belongs to one tag; an awake Chunk holds a handle mapped at [va, va + bytes)
//     with access set for memory.access_devices() and has no backups; an asleep Chunk holds no
//     handle (outside a wake in progress, and except a stranded one, see chunk.hpp: then its
//     memory is still mapped and counted as mapped), nothing is mapped at its VA, and its
//     backups cover exactly the allocated bytes that survived its level (sleep_policy.hpp) by
//     the classes they had when it fell asleep or was deepened (mark() while asleep applies to
//     the next sleep), each backup owning its own HostStore span;
//   - retained copies (skip_unchanged) exist only on awake chunks; each owns its span and
//     holds the content hash the bytes had when copied; a retained copy is only trusted
//     after hashing the device bytes again;
//   - TagState::asleep is true from the start of a sleep until every chunk of the tag woke;
//   - sleep and wake hold mu for their whole duration; their worker threads touch only the
//     chunks handed to them and ChunkMemory (whose deferred releases have a lock of their own).
#pragma once

#include <algorithm>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_set>
#include <vector>

#include "common/range_allocator.hpp"
#include "pool/chunk.hpp"
#include "pool/store/host_store.hpp"
#include "pool/store/staging_ring.hpp"
#include "pool/tag_hooks.hpp"
#include "torpor/driver.hpp"
#include "torpor/pool.hpp"

namespace torpor {

// Whether `tag` is one of `tags` (a resolved tag list: short, so a linear search).
inline bool has_tag(const std::vector<std::string>& tags, const std::string& tag) {
  return std::find(tags.begin(), tags.end(), tag) != tags.end();
}

struct TagState {
  bool asleep = false;
  SleepLevel level = SleepLevel::none;
};

struct Pool::State {
  State(Driver& d, const PoolOptions& o, std::size_t gran, device_ptr base)
      : driver(d),
        options(o),
        granularity(gran),
        va_base(base),
        memory(d, o.device, o.exportable),
        staging(d, o.device, o.staging_slots, o.staging_slot_bytes),
        va(o.va_bytes),
        host(d, host_store_options(o, d)) {}

  // The pool's options, and the machine as the driver and TORPOR_SYSFS_ROOT show it: the NUMA
  // node of the device, whether registration counts against RLIMIT_MEMLOCK (host_topology.hpp).
  static HostStoreOptions host_store_options(const PoolOptions& o, Driver& d);

  Driver& driver;
  const PoolOptions& options;
  std::size_t granularity;
  std::size_t device_bytes = 0;  // the device's memory (DeviceProperties::total_bytes)
  bool gpu_direct_rdma = false;  // the chunks are created GPUDirect RDMA capable (exportable, and the device can)
  device_ptr va_base;
  ChunkMemory memory;           // physical memory of the chunks, access list, deferred releases
  std::vector<Stream> streams;  // copy streams; streams[0] also serves copy() and hash()
  // skip_unchanged: the sleep's hashes, apart from the copy streams so that hashing the next
  // chunks does not wait behind the copies already queued (sleep_plan.hpp, step 3).
  std::optional<Stream> hash_stream;
  std::vector<Event> events;  // reused across sleeps, grown on demand
  StagingRing staging;        // pinned ring for pageable backups, allocated on first use

  mutable std::mutex mu;
  RangeAllocator va;  // offsets from va_base
  HostStore host;
  std::map<device_ptr, std::unique_ptr<Chunk>> chunks;            // by va
  std::map<device_ptr, std::unique_ptr<Allocation>> allocations;  // by base
  std::map<std::string, TagState, std::less<>> tags;
  std::vector<std::string> preserve;
  std::map<device_ptr, std::size_t> address_ranges;  // reserve_address_range spans
  std::vector<SleepObserver*> observers;
  TagHookRegistry tag_hooks;              // its own lock: hooks run outside mu (tag_hooks.hpp)
  std::deque<device_ptr> recently_freed;  // for "double free" messages
  std::unordered_set<device_ptr> recently_freed_set;

  // --- helpers shared by allocation and sleep -----------------------------------------------
  // A new awake chunk of `bytes` for (tag, cls): VA, create, map, set access; rolls back and
  // throws on failure (out_of_memory for device or VA exhaustion).
  Chunk& new_chunk(std::size_t bytes, const std::string& tag, MemoryClass cls, ChunkKind kind);
  // Retry deferred releases; failures stay pending (logged).
  void retry_pending_releases() noexcept { memory.retry_pending(); }
  // Retry the unmap of stranded chunks (asleep, still mapped after a failed rollback); failures
  // stay stranded (logged).
  void retry_stranded_mappings() noexcept;
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
  // For the tag hooks: whether some chunk of `tag` is mapped (a sleep of it unmaps), and
  // whether it is fully mapped (not asleep, no chunk asleep; an unknown tag is).
  bool has_mapped_chunk(const std::string& tag) const;
  bool fully_mapped(const std::string& tag) const;
  std::vector<std::string> resolve_tags(const std::vector<std::string>& requested, const char* operation) const;
  Event event(std::size_t i);  // the i-th reusable event, created on demand
};

}  // namespace torpor
