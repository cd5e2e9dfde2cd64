// Reading a pool's host copies: the bytes a sleep kept for an allocation, for engines that show
// them to their users (torch_memory_saver's get_cpu_backup over torpor.tms).
//
// A chunk's host copies are its backups while it sleeps and its retained copies (skip_unchanged)
// while it is awake; either map holds disjoint ranges keyed by chunk offset. A read is all or
// nothing: the asked range must be covered by copies end to end, else nothing is copied (the
// bytes were discarded, or no copy was retained). Copies live in host memory (the host store's
// pinned or pageable blocks), so a read is a memcpy under the pool's lock: the copies cannot be
// freed or moved while it runs.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <utility>
#include <vector>

#include "pool/pool_state.hpp"
#include "torpor/error.hpp"
#include "torpor/pool.hpp"

namespace torpor {

namespace {

// Whether copies cover chunk offsets [lo, hi) end to end; if so, copy them to dst.
bool copy_covered(const std::map<std::size_t, HostCopy>& copies, std::size_t lo, std::size_t hi, std::byte* dst) {
  auto it = copies.upper_bound(lo);
  if (it == copies.begin()) return false;
  --it;
  std::vector<std::pair<const std::byte*, std::size_t>> pieces;
  for (std::size_t at = lo; at < hi; ++it) {
    if (it == copies.end() || it->first > at || it->first + it->second.bytes <= at) return false;
    std::size_t end = std::min(hi, it->first + it->second.bytes);
    pieces.emplace_back(it->second.span.ptr + (at - it->first), end - at);
    at = end;
  }
  for (auto& [src, n] : pieces) {
    std::memcpy(dst, src, n);
    dst += n;
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
  out.copied = copy_covered(c.awake ? c.retained : c.backups, lo, lo + bytes, static_cast<std::byte*>(dst));
  return out;
}

}  // namespace torpor
