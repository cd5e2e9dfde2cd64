// Chunks: one physical handle each, mapped at a fixed VA span of the pool's reservation, and
// the allocations carved out of them.
//
// A Chunk owns its physical lifetime, as PyTorch's ExpandableSegment owns its handles:
// remap() creates new memory and maps it at the chunk's VA (the wake sets access once per
// VA-contiguous group), map_new() also sets access (a new chunk on the allocation path),
// unmap_and_release() gives the memory back, drop_mapping() does the same for rollbacks
// without throwing (and says whether it could). ChunkMemory is the driver side shared by a pool's chunks: creation with
// a typed out-of-memory error, the access list, and the deferred-release rule.
//
// Invariants:
//   - a chunk holds a handle exactly while memory is mapped at [va, va + bytes); an awake
//     chunk holds one with access set for ChunkMemory::access_devices(). During a wake an
//     asleep chunk may hold the handle the map thread just mapped; the wake makes the chunk
//     awake or drops the mapping before it returns. Only when that unmap fails and the chunk
//     cannot be woken either does an asleep chunk keep its handle after the wake ("stranded":
//     still mapped, its bytes in its backups); the next wake reuses the mapping, the next sleep
//     or trim retries the unmap;
//   - a failed unmap throws with nothing changed (the chunk keeps its handle);
//   - a handle whose release failed is never lost: it waits in ChunkMemory's pending list
//     (thread-safe: the sleep's release workers defer concurrently) and is retried by the next
//     sleep, wake, trim and at destruction.
#pragma once

#include <algorithm>
#include <cstddef>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "common/range_allocator.hpp"
#include "pool/store/host_store.hpp"
#include "torpor/driver.hpp"
#include "torpor/pool.hpp"

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
//
// Verification of retained copies, which live across many cycles. Before a sleep trusts one
// (skips copying bytes whose device hash still matches), it re-reads a sample of the host bytes
// (sample_of: at most 512 bytes in 8 windows spread over the copy, so the check costs
// microseconds whatever the size) against the sample taken when the copy landed: a copy
// overwritten in bulk is caught there and copied afresh while the device still holds the bytes.
// A backup that came from a trusted copy (trusted) is checked completely once restored: the device
// hashes the restored bytes (at HBM speed on a GPU, a small fraction of the restore's time) against
// `hash`; a mismatch (a few bytes changed outside the sample) is not handed back (wake fills the
// range with the poison pattern and throws naming the allocation).
struct HostCopy {
  std::size_t bytes = 0;
  HostSpan span;  // span.bytes >= bytes
  Hash128 hash;   // of the bytes when copied (valid when hashed)
  bool hashed = false;
  Hash128 sample;  // sample_of the host bytes once they landed (valid when sampled)
  bool sampled = false;
  bool trusted = false;  // a backup whose bytes were not copied at its sleep (an unchanged retained copy)
};

// The sample of a host copy (see HostCopy): the content hash of at most eight 64-byte windows
// spread evenly over [p, p + bytes), first and last included; all of it when 512 bytes or fewer.
Hash128 sample_of(const std::byte* p, std::size_t bytes) noexcept;

// The driver side of chunks' physical memory, one per pool.
class ChunkMemory {
 public:
  ChunkMemory(Driver& driver, int device, bool exportable)
      : driver_(driver), device_(device), exportable_(exportable) {}

  Driver& driver() const noexcept { return driver_; }
  const std::vector<int>& access_devices() const noexcept { return access_devices_; }
  void set_access_devices(std::vector<int> devices) { access_devices_ = std::move(devices); }

  // New physical memory; device exhaustion becomes out_of_memory naming the tag and the
  // device's free memory.
  PhysicalHandle create(std::size_t bytes, const std::string& tag);
  // Access to [va, va + bytes) for every access device: one call for a whole VA-contiguous run.
  void set_access(device_ptr va, std::size_t bytes);
  // Release now, or keep the handle for a retry when the release fails (logged). Thread-safe.
  void release_or_defer(PhysicalHandle h, device_ptr va) noexcept;
  // Retry deferred releases; failures stay pending (logged).
  void retry_pending() noexcept;
  std::size_t pending() const;

 private:
  Driver& driver_;
  int device_;
  bool exportable_;
  std::vector<int> access_devices_;
  mutable std::mutex pending_mu_;
  std::vector<PhysicalHandle> pending_;
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
  SleepLevel level = SleepLevel::none;             // when asleep
  std::map<std::size_t, HostCopy> backups;         // chunk offset -> copy (asleep only)
  std::map<std::size_t, HostCopy> retained;        // chunk offset -> copy (awake only)
  RangeAllocator space;                            // slabs only
  std::map<std::size_t, Allocation*> allocations;  // chunk offset -> allocation

  bool slab() const noexcept { return kind != ChunkKind::dedicated; }

  // Create physical memory and map it at [va, va + bytes); access is the caller's. A stranded
  // chunk's mapping is reused as it is. On failure nothing changed (a created handle is released
  // or deferred).
  void remap(ChunkMemory& m);
  // remap() and set access for this chunk alone: a new chunk on the allocation path. On
  // failure nothing changed.
  void map_new(ChunkMemory& m);
  // Unmap, then release (a failed release is deferred). A failed unmap throws with nothing
  // changed.
  void unmap_and_release(ChunkMemory& m);
  // For rollbacks: unmap, then release or defer; true when the memory is unmapped. When the
  // unmap fails (logged) the chunk keeps its handle, still mapped. Never throws.
  bool drop_mapping(ChunkMemory& m) noexcept;
  // Asleep but still holding its mapping (see the invariants above).
  bool stranded() const noexcept { return !awake && handle; }

  // Bytes of chunk offsets [lo, hi) that backups cover.
  std::size_t backed_bytes(std::size_t lo, std::size_t hi) const noexcept;
  // Calls f(lo, hi) for every range of allocated bytes that no backup covers: what a sleep
  // discarded.
  template <typename F>
  void for_each_discarded(F&& f) const;
};

template <typename F>
void Chunk::for_each_discarded(F&& f) const {
  for (auto& [aoff, a] : allocations) {
    std::size_t at = a->offset, end = a->offset + a->bytes;
    auto b = backups.upper_bound(at);
    if (b != backups.begin()) --b;
    for (; b != backups.end() && b->first < end && at < end; ++b) {
      std::size_t blo = b->first, bhi = b->first + b->second.bytes;
      if (bhi <= at) continue;
      if (blo > at) f(at, std::min(blo, end));
      at = std::max(at, bhi);
    }
    if (at < end) f(at, end);
  }
}

}  // namespace torpor
