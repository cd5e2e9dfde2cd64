// StagingRing; the design note and invariants are in staging_ring.hpp.
#include "pool/store/staging_ring.hpp"

#include <algorithm>
#include <cstring>
#include <deque>
#include <exception>

#include "common/range_allocator.hpp"
#include "torpor/log.hpp"

namespace torpor {

StagingRing::StagingRing(Driver& driver, int device, int slots, std::size_t slot_bytes)
    : driver_(driver),
      device_(device),
      slots_(static_cast<std::size_t>(slots)),
      slot_bytes_(align_up(slot_bytes, page)) {}

void StagingRing::ensure_allocated() {
  if (ring_ == nullptr) ring_ = static_cast<std::byte*>(driver_.host_alloc(slots_ * slot_stride()));
  while (events_.size() < slots_) events_.push_back(driver_.event_create(device_));
}

void StagingRing::drain_after_failure(const std::vector<bool>& pending) noexcept {
  for (std::size_t i = 0; i < pending.size(); ++i) {
    if (!pending[i]) continue;
    try {
      driver_.event_synchronize(events_[i]);
    } catch (const std::exception& e) {
      log::error("pool: waiting for a staging copy after a failure failed: {}", e.what());
    }
  }
}

void StagingRing::to_host(device_ptr src, std::size_t bytes, Stream stream, const Sink& sink) {
  ensure_allocated();
  struct Pending {
    std::size_t slot, offset, bytes;
  };
  std::deque<Pending> pending;
  std::vector<bool> in_flight(slots_, false);
  auto drain_one = [&] {
    Pending p = pending.front();
    pending.pop_front();
    driver_.event_synchronize(events_[p.slot]);
    in_flight[p.slot] = false;
    sink(p.offset, slot(p.slot), p.bytes);
  };
  try {
    std::size_t next = 0;
    for (std::size_t off = 0; off < bytes; off += slot_bytes_) {
      if (pending.size() == slots_) drain_one();
      std::size_t n = std::min(slot_bytes_, bytes - off);
      std::size_t k = next++ % slots_;
      driver_.copy_async(slot(k), reinterpret_cast<const void*>(src + off), n, stream);
      in_flight[k] = true;
      driver_.event_record(events_[k], stream);
      pending.push_back({k, off, n});
    }
    while (!pending.empty()) drain_one();
  } catch (...) {
    drain_after_failure(in_flight);  // no copy may still land in a slot the next call refills
    throw;
  }
}

void StagingRing::to_device(device_ptr dst, std::size_t bytes, Stream stream, const Source& source) {
  ensure_allocated();
  std::size_t next = 0;
  std::vector<bool> used(slots_, false);
  try {
    for (std::size_t off = 0; off < bytes; off += slot_bytes_) {
      std::size_t n = std::min(slot_bytes_, bytes - off);
      std::size_t k = next++ % slots_;
      // The slot's previous copy to the device must have read it before it is refilled.
      if (used[k]) driver_.event_synchronize(events_[k]);
      source(off, slot(k), n);
      driver_.copy_async(reinterpret_cast<void*>(dst + off), slot(k), n, stream);
      driver_.event_record(events_[k], stream);
      used[k] = true;
    }
  } catch (...) {
    drain_after_failure(used);
    throw;
  }
  // The slots may be refilled by the next call as soon as these copies have read them.
  for (std::size_t i = 0; i < slots_; ++i)
    if (used[i]) driver_.event_synchronize(events_[i]);
}

void StagingRing::to_host(std::byte* dst, device_ptr src, std::size_t bytes, Stream stream) {
  to_host(src, bytes, stream,
          [dst](std::size_t off, const std::byte* slot, std::size_t n) { std::memcpy(dst + off, slot, n); });
}

void StagingRing::to_device(device_ptr dst, const std::byte* src, std::size_t bytes, Stream stream) {
  to_device(dst, bytes, stream,
            [src](std::size_t off, std::byte* slot, std::size_t n) { std::memcpy(slot, src + off, n); });
}

void StagingRing::release() noexcept {
  for (Event e : events_) {
    try {
      driver_.event_destroy(e);
    } catch (const std::exception& ex) {
      log::error("pool: destroying a staging event failed: {}", ex.what());
    }
  }
  events_.clear();
  if (ring_ != nullptr) {
    try {
      driver_.host_free(ring_);
    } catch (const std::exception& e) {
      log::error("pool: freeing the staging ring failed: {}", e.what());
    }
    ring_ = nullptr;
  }
}

}  // namespace torpor
