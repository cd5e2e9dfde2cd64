// Copies between a chunk's device bytes and a host span of any tier (host_store.hpp): the one
// place the sleep's offload pipeline and the wake's restores turn a span into copies.
//
//   pinned    one async copy on the stream; for offload, first wait until the span's block is
//             page-locked (the store pins blocks in the background), timed as the phase
//             "host_pinning_wait";
//   pageable  through the staging ring, memcpy to or from the span;
//   disk      through the staging ring, written to or read from the spill file (counted in
//             bytes_spilled too).
// Called only by the thread that issues the copies (the report's counters are its own).
#pragma once

#include <cstddef>

#include "pool/pool_state.hpp"

namespace torpor {

// Device [src, src + bytes) -> span. Sets span.tier to the tier the bytes went to (a block
// whose page-locking was refused holds pageable memory). Throws on failure (a full disk:
// out_of_memory) with every copy that was issued into a staging slot complete.
void offload_to_span(Pool::State& s, HostSpan& span, device_ptr src, std::size_t bytes, Stream stream,
                     TransitionReport& r);
// span -> device [dst, dst + bytes); `span` may start anywhere inside a span offload_to_span
// wrote (a backup split by drop_copies).
void restore_from_span(Pool::State& s, device_ptr dst, const HostSpan& span, std::size_t bytes, Stream stream,
                       TransitionReport& r);

}  // namespace torpor
