// Copies between device bytes and host spans; the design note is in host_copies.hpp.
#include "pool/host_copies.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <chrono>

#include "torpor/error.hpp"

namespace torpor {

namespace {

void add_phase_seconds(TransitionReport& r, const char* name, double seconds) {
  for (auto& p : r.phases)
    if (p.name == name) {
      p.seconds += seconds;
      return;
    }
  r.phases.push_back({name, seconds});
}

}  // namespace

void offload_to_span(Pool::State& s, HostSpan& span, device_ptr src, std::size_t bytes, Stream stream,
                     TransitionReport& r) {
  if (span.tier == HostTier::pinned) {
    // The phase counts waits for pinning only: a block already pinned costs a lock, whose time
    // on a loaded machine is no wait for the pinner.
    const bool pinning = s.host.being_pinned(span);
    auto t = std::chrono::steady_clock::now();
    span.tier = s.host.wait_ready(span);
    double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
    if (pinning) add_phase_seconds(r, "host_pinning_wait", waited);
  }
  switch (span.tier) {
    case HostTier::pinned: s.driver.copy_async(span.ptr, reinterpret_cast<const void*>(src), bytes, stream); break;
    case HostTier::pageable: s.staging.to_host(span.ptr, src, bytes, stream); break;
    case HostTier::disk: {
      SpillStore& spill = s.host.spill_of(span.ptr);
      std::uint64_t file_offset = s.host.file_offset(span.ptr);
      if (!s.host.writable(span, bytes))  // sleep_plan.cpp replaces such spans before any copy
        throw error(fmt::format("internal: spill span at file offset {} ({} bytes) cannot take a {}-byte write",
                                file_offset, span.bytes, bytes));
      s.staging.to_host(src, bytes, stream, [&](std::size_t off, const std::byte* slot, std::size_t n) {
        spill.write(file_offset + off, slot, align_up(n, SpillStore::alignment));  // the span covers the padding
      });
      r.bytes_spilled += bytes;
      break;
    }
  }
  if (span.tier != HostTier::pinned) r.bytes_staged += bytes;
}

void restore_from_span(Pool::State& s, device_ptr dst, const HostSpan& span, std::size_t bytes, Stream stream,
                       TransitionReport& r) {
  switch (span.tier) {
    case HostTier::pinned: s.driver.copy_async(reinterpret_cast<void*>(dst), span.ptr, bytes, stream); break;
    case HostTier::pageable: s.staging.to_device(dst, span.ptr, bytes, stream); break;
    case HostTier::disk: {
      SpillStore& spill = s.host.spill_of(span.ptr);
      std::uint64_t file_offset = s.host.file_offset(span.ptr);
      s.staging.to_device(dst, bytes, stream, [&](std::size_t off, std::byte* slot, std::size_t n) {
        spill.read(file_offset + off, slot, n);
      });
      r.bytes_spilled += bytes;
      break;
    }
  }
  if (span.tier != HostTier::pinned) r.bytes_staged += bytes;
}

}  // namespace torpor
