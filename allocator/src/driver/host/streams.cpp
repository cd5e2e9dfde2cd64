// HostDriver's streams, events and device work (copies, fills, host kernels).
//
// Synchronous mode: device work is done when the call returns, under mapping_mu_ shared, so the
// range it checked stays mapped while it is touched. Asynchronous mode: the work is queued on the
// stream's worker (async_engine.hpp) with the ranges it touches registered as in flight
// (in_flight.cpp); as with cuMemcpyAsync, a pageable source is taken when the copy is queued and
// a pageable destination holds the bytes when the call returns. Events, stream and device
// synchronisation are the engine's; every call first checks that its stream or event exists.
#include <cstring>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <vector>

#include "driver/host/async_engine.hpp"
#include "driver/host/state.hpp"

namespace torpor {

using host::fingerprint_of;
using host::misuse;

void HostDriver::require_stream(Stream s, const char* call) const {
  if (!streams_.count(s.value)) misuse(call, fmt::format("unknown stream {}", s.value));
}

Stream HostDriver::stream_create(int device) {
  check_device(device, "cuStreamCreate");
  std::uint64_t id;
  {
    std::lock_guard lock(mu_);
    id = next_id_++;
  }
  if (async_) async_->add_stream(id, device);
  std::lock_guard lock(mu_);
  streams_.insert(id);
  return Stream{id, device};
}

void HostDriver::stream_destroy(Stream s) {
  {
    std::lock_guard lock(mu_);
    require_stream(s, "cuStreamDestroy");
    streams_.erase(s.value);
  }
  if (async_) async_->remove_stream(s.value);  // its queued work completes first
}

void HostDriver::copy_async(void* dst, const void* src, std::size_t bytes, Stream s) {
  const char* call = "cuMemcpyAsync";
  std::shared_lock touching(mapping_mu_);
  bool src_pageable = false, dst_pageable = false;
  std::vector<InFlight> touched;
  {
    std::lock_guard lock(mu_);
    require_stream(s, call);
    check_accessible(src, bytes, call);
    check_accessible(dst, bytes, call);
    if (in_reservation(src) != in_reservation(dst)) {
      check_page_locked(src, bytes, call);
      check_page_locked(dst, bytes, call);
    }
    if (!async_) {
      // Synchronous mode: done below, outside the lock.
    } else {
      src_pageable = !in_reservation(src) && !in_pinned_block(src);
      dst_pageable = !in_reservation(dst) && !in_pinned_block(dst);
      auto add = [&](const void* p, bool pageable, bool writes) {
        auto lo = reinterpret_cast<std::uintptr_t>(p);
        if (!pageable && bytes > 0) touched.push_back(InFlight{lo, lo + bytes, s.value, call, writes});
      };
      add(src, src_pageable, false);
      add(dst, dst_pageable, true);
      // Fingerprint the page-locked host side, unless a queued operation writes it (then it may
      // change before this copy runs, legitimately on the same stream; flag_races covers others).
      for (InFlight& t : touched) {
        if (!in_pinned_block(reinterpret_cast<const void*>(t.lo))) continue;
        bool written_by_queued = false;
        for (const auto& [op, ranges] : in_flight_)
          for (const InFlight& r : ranges)
            if (r.writes && r.lo < t.hi && t.lo < r.hi) written_by_queued = true;
        if (written_by_queued) continue;
        t.watched = true;
        t.fingerprint = fingerprint_of(t.lo, t.hi);
      }
    }
  }
  if (!async_) {
    if (bytes > 0) std::memmove(dst, src, bytes);
    return;
  }
  // As cuMemcpyAsync: a pageable source is taken when the copy is queued; a pageable
  // destination holds the bytes when the call returns.
  std::shared_ptr<std::vector<std::byte>> staged;
  if (src_pageable && bytes > 0) {
    const auto* b = static_cast<const std::byte*>(src);
    staged = std::make_shared<std::vector<std::byte>>(b, b + bytes);
    src = staged->data();
  }
  std::uint64_t ticket = submit(
      s,
      [dst, src, bytes, staged] {
        if (bytes > 0) std::memmove(dst, src, bytes);
      },
      std::move(touched));
  if (dst_pageable) async_->wait(s.value, ticket);
}

void HostDriver::fill_async(device_ptr dst, std::uint8_t value, std::size_t bytes, Stream s) {
  const char* call = "cuMemsetD8Async";
  std::shared_lock touching(mapping_mu_);
  {
    std::lock_guard lock(mu_);
    require_stream(s, call);
    check_accessible(reinterpret_cast<void*>(dst), bytes, call);
  }
  auto* p = reinterpret_cast<void*>(dst);
  if (!async_) {
    if (bytes > 0) std::memset(p, value, bytes);
    return;
  }
  std::vector<InFlight> touched;
  if (bytes > 0) touched.push_back(InFlight{dst, dst + bytes, s.value, call, true});
  submit(
      s,
      [p, value, bytes] {
        if (bytes > 0) std::memset(p, value, bytes);
      },
      std::move(touched));
}

void HostDriver::launch(Stream s, std::function<void()> kernel) {
  {
    std::lock_guard lock(mu_);
    require_stream(s, "cuLaunchKernel");
  }
  if (!async_) {
    kernel();
    return;
  }
  submit(s, std::move(kernel), {});
}

void HostDriver::delay_stream(Stream s, std::chrono::microseconds pause) {
  {
    std::lock_guard lock(mu_);
    require_stream(s, "delay_stream");
  }
  if (pause < std::chrono::microseconds{0} || pause > std::chrono::seconds{10})
    throw invalid_argument(fmt::format("HostDriver::delay_stream: {} us is outside [0, 10000000] us", pause.count()));
  if (async_)
    async_->submit(
        s.value, [] {}, pause);
}

void HostDriver::stream_synchronize(Stream s) {
  {
    std::lock_guard lock(mu_);
    require_stream(s, "cuStreamSynchronize");
  }
  if (async_) async_->synchronize_stream(s.value);
}

void HostDriver::device_synchronize(int device) {
  check_device(device, "cuCtxSynchronize");
  if (async_) async_->synchronize_device(device);
}

Event HostDriver::event_create(int device) {
  check_device(device, "cuEventCreate");
  std::uint64_t id;
  {
    std::lock_guard lock(mu_);
    id = next_id_++;
    events_.insert(id);
  }
  if (async_) async_->add_event(id);
  return Event{id, device};
}

void HostDriver::event_destroy(Event e) {
  {
    std::lock_guard lock(mu_);
    if (!events_.erase(e.value)) misuse("cuEventDestroy", fmt::format("unknown event {}", e.value));
  }
  if (async_) async_->remove_event(e.value);
}

void HostDriver::event_record(Event e, Stream s) {
  {
    std::lock_guard lock(mu_);
    require_stream(s, "cuEventRecord");
    if (!events_.count(e.value)) misuse("cuEventRecord", fmt::format("unknown event {}", e.value));
  }
  if (async_) async_->record(e.value, s.value);
}

void HostDriver::stream_wait_event(Stream s, Event e) {
  {
    std::lock_guard lock(mu_);
    require_stream(s, "cuStreamWaitEvent");
    if (!events_.count(e.value)) misuse("cuStreamWaitEvent", fmt::format("unknown event {}", e.value));
  }
  if (async_) async_->stream_wait_event(s.value, e.value);
}

void HostDriver::event_synchronize(Event e) {
  {
    std::lock_guard lock(mu_);
    if (!events_.count(e.value)) misuse("cuEventSynchronize", fmt::format("unknown event {}", e.value));
  }
  if (async_) async_->synchronize_event(e.value);
}

}  // namespace torpor
