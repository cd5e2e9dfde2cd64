// StagingRing: moves bytes between device memory and pageable host memory through a few
// pinned slots. Backups beyond PoolOptions::host_store_limit live in pageable memory, which a
// device copy reads or writes slowly; allocating pinned memory per sleep is slower still.
//
// Invariants: the ring (slots x slot_bytes of pinned memory, one event per slot) is allocated
// on first use and kept until release(); a slot is refilled only after the event recorded
// behind its previous copy completed; to_host returns with the bytes in dst, to_device returns
// with every slot it used read by the device (the next call may refill any slot).
// Not thread-safe: the thread that issues a sleep's or wake's copies alone uses it.
#pragma once

#include <cstddef>
#include <vector>

#include "torpor/driver.hpp"

namespace torpor {

class StagingRing {
 public:
  StagingRing(Driver& driver, int device, int slots, std::size_t slot_bytes)
      : driver_(driver), device_(device), slots_(static_cast<std::size_t>(slots)), slot_bytes_(slot_bytes) {}
  ~StagingRing() { release(); }
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;

  // Device -> pageable host, on `stream`; returns when the bytes are in dst.
  void to_host(std::byte* dst, device_ptr src, std::size_t bytes, Stream stream);
  // Pageable host -> device, on `stream`; returns when the copies are enqueued and the slots
  // read.
  void to_device(device_ptr dst, const std::byte* src, std::size_t bytes, Stream stream);
  // Gives the pinned memory and the events back (failures logged). Never throws.
  void release() noexcept;

 private:
  void ensure_allocated();
  std::byte* slot(std::size_t i) const noexcept { return ring_ + i * slot_bytes_; }

  Driver& driver_;
  int device_;
  std::size_t slots_;
  std::size_t slot_bytes_;
  std::byte* ring_ = nullptr;
  std::vector<Event> events_;  // one per slot
};

}  // namespace torpor
