// StagingRing: moves bytes between device memory and host memory that is not page-locked, or a
// spill file, through a few pinned slots. Backups beyond PoolOptions::host_store_limit live in
// pageable memory (or, with a spill directory, in a file), which a device copy reads or writes
// slowly or not at all; allocating pinned memory per sleep is slower still.
//
// Invariants: the ring (slots of slot_stride() bytes of pinned memory, one event per slot) is
// allocated on first use and kept until release(); a slot is refilled only after the event
// recorded behind its previous copy completed; to_host returns with every byte handed to the
// sink, to_device returns with every slot it used read by the device (the next call may refill
// any slot); a throw from a sink or source (a full disk) leaves no copy in flight into a slot.
// Slots are page-aligned and slot_stride() leaves a page more than slot_bytes, so a direct-I/O
// read of an unaligned range can read the aligned window around it (spill_store.hpp).
// Not thread-safe: the thread that issues a sleep's or wake's copies alone uses it.
#pragma once

#include <cstddef>
#include <functional>
#include <vector>

#include "torpor/driver.hpp"

namespace torpor {

class StagingRing {
 public:
  // Receives bytes [offset, offset + bytes) of a to_host transfer, in order, in a slot whose
  // capacity is slot_stride().
  using Sink = std::function<void(std::size_t offset, const std::byte* slot, std::size_t bytes)>;
  // Fills a slot (capacity slot_stride()) with bytes [offset, offset + bytes) of a to_device transfer.
  using Source = std::function<void(std::size_t offset, std::byte* slot, std::size_t bytes)>;

  static constexpr std::size_t page = 4096;

  // slot_bytes is rounded up to a multiple of `page`: transfers are cut at slot_bytes, so spill
  // writes stay aligned.
  StagingRing(Driver& driver, int device, int slots, std::size_t slot_bytes);
  ~StagingRing() { release(); }
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;

  // Device -> host, on `stream`, in pieces of at most slot_bytes handed to `sink`.
  void to_host(device_ptr src, std::size_t bytes, Stream stream, const Sink& sink);
  // Host -> device, on `stream`, in pieces of at most slot_bytes taken from `source`; returns
  // when the copies are enqueued and the slots read.
  void to_device(device_ptr dst, std::size_t bytes, Stream stream, const Source& source);
  // Pageable memory: the two above with memcpy as sink and source.
  void to_host(std::byte* dst, device_ptr src, std::size_t bytes, Stream stream);
  void to_device(device_ptr dst, const std::byte* src, std::size_t bytes, Stream stream);
  // Gives the pinned memory and the events back (failures logged). Never throws.
  void release() noexcept;

  std::size_t slot_bytes() const noexcept { return slot_bytes_; }
  std::size_t slot_stride() const noexcept { return slot_bytes_ + page; }

 private:
  void ensure_allocated();
  void drain_after_failure(const std::vector<bool>& pending) noexcept;
  std::byte* slot(std::size_t i) const noexcept { return ring_ + i * slot_stride(); }

  Driver& driver_;
  int device_;
  std::size_t slots_;
  std::size_t slot_bytes_;
  std::byte* ring_ = nullptr;
  std::vector<Event> events_;  // one per slot
};

}  // namespace torpor
