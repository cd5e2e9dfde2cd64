// Reading a pool's host copies: the bytes a sleep kept for an allocation, for engines that show
// them to their users (torch_memory_saver's get_cpu_backup over torpor.tms).
//
// A chunk's host copies are its backups while it sleeps and its retained copies (skip_unchanged)
// while it is awake; either map holds disjoint ranges keyed by chunk offset. A read is all or
// nothing: the asked range must be covered by copies end to end, else nothing is copied (the
// bytes were discarded, or no copy was retained). A copy in host memory (the host store's pinned
// or pageable blocks) is read with a memcpy, one in the disk tier from the spill file (through an
// aligned bounce buffer: the file may be open for direct I/O); both under the pool's lock, so the
// copies cannot be freed or moved while the read runs.
#include <fmt/core.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "pool/pool_state.hpp"
#include "torpor/error.hpp"
#include "torpor/pool.hpp"

namespace torpor {

namespace {

struct Piece {
  const HostSpan* span;
  std::size_t from;  // offset in the span
  std::size_t bytes;
};

void read_from_spill(Pool::State& s, const HostSpan& span, std::size_t from, std::size_t bytes, std::byte* dst) {
  SpillStore& spill = s.host.spill_of(span.ptr);
  std::size_t room = align_up(bytes, SpillStore::alignment) + SpillStore::alignment;
  std::unique_ptr<std::byte, decltype(&std::free)> bounce(static_cast<std::byte*>(
                                                              std::aligned_alloc(SpillStore::alignment, room)),
                                                          &std::free);
  if (!bounce)
    throw out_of_memory(fmt::format("read_host_copy: no {} bytes of host memory to read the disk tier", room));
  spill.read(s.host.file_offset(span.ptr) + from, bounce.get(), bytes);
  std::memcpy(dst, bounce.get(), bytes);
}

// Whether copies cover chunk offsets [lo, hi) end to end; if so, copy them to dst.
bool copy_covered(Pool::State& s, const std::map<std::size_t, HostCopy>& copies, std::size_t lo, std::size_t hi,
                  std::byte* dst) {
  auto it = copies.upper_bound(lo);
  if (it == copies.begin()) return false;
  --it;
  std::vector<Piece> pieces;
  for (std::size_t at = lo; at < hi; ++it) {
    if (it == copies.end() || it->first > at || it->first + it->second.bytes <= at) return false;
    std::size_t end = std::min(hi, it->first + it->second.bytes);
    pieces.push_back(Piece{&it->second.span, at - it->first, end - at});
    at = end;
  }
  for (const Piece& p : pieces) {
    if (p.span->tier == HostTier::disk)
      read_from_spill(s, *p.span, p.from, p.bytes, dst);
    else
      std::memcpy(dst, p.span->ptr + p.from, p.bytes);
    dst += p.bytes;
  }
  return true;
}

}  // namespace

HostCopyRead Pool::read_host_copy(const void* ptr, std::size_t bytes, void* dst) const {
  if (bytes == 0) throw invalid_argument("read_host_copy: size 0");
  if (dst == nullptr) throw invalid_argument("read_host_copy: destination is null");
  State& s = *state_;
  auto p = reinterpret_cast<device_ptr>(ptr);
  std::lock_guard lock(s.mu);
  const Allocation* a = s.containing(p);
  if (a == nullptr)
    throw invalid_argument(fmt::format("read_host_copy: {:#x} is not inside an allocation of this pool", p));
  std::size_t inside = a->base + a->bytes - p;
  if (bytes > inside)
    throw invalid_argument(fmt::format("read_host_copy: [{:#x}, +{}) runs past the end of its allocation "
                                       "({:#x}, {} bytes): at most {} bytes from there",
                                       p, bytes, a->base, a->bytes, inside));
  const Chunk& c = *a->chunk;
  std::size_t lo = p - c.va;
  HostCopyRead out;
  out.asleep = !c.awake;
  out.copied = copy_covered(s, c.awake ? c.retained : c.backups, lo, lo + bytes, static_cast<std::byte*>(dst));
  return out;
}

}  // namespace torpor
