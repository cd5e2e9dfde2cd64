#include "common/range_allocator.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <iterator>

#include "torpor/error.hpp"

namespace torpor {

RangeAllocator::RangeAllocator(std::size_t capacity) : capacity_(capacity), free_bytes_(capacity) {
  if (capacity > 0) free_[0] = capacity;
}

std::optional<std::size_t> RangeAllocator::allocate(std::size_t bytes, std::size_t alignment) {
  if (bytes == 0) return std::nullopt;
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    std::size_t start = it->first;
    std::size_t length = it->second;
    std::size_t aligned = align_up(start, alignment);
    if (aligned - start > length || length - (aligned - start) < bytes) continue;
    // Split [start, start+length) into prefix | allocation | suffix.
    std::size_t prefix = aligned - start;
    std::size_t suffix = length - prefix - bytes;
    free_.erase(it);
    if (prefix > 0) free_[start] = prefix;
    if (suffix > 0) free_[aligned + bytes] = suffix;
    free_bytes_ -= bytes;
    return aligned;
  }
  return std::nullopt;
}

void RangeAllocator::free(std::size_t offset, std::size_t bytes) {
  if (bytes == 0) return;
  if (offset + bytes > capacity_ || offset + bytes < offset)
    throw error(fmt::format("internal: free of [{}, +{}) beyond capacity {}", offset, bytes, capacity_));
  auto next = free_.lower_bound(offset);
  if (next != free_.end() && next->first < offset + bytes)
    throw error(fmt::format("internal: free of [{}, +{}) overlaps free space at {}", offset, bytes, next->first));
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second > offset)
      throw error(fmt::format("internal: free of [{}, +{}) overlaps free space at {}", offset, bytes, prev->first));
  }
  std::size_t start = offset;
  std::size_t length = bytes;
  if (next != free_.end() && next->first == offset + bytes) {
    length += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      start = prev->first;
      length += prev->second;
      free_.erase(prev);
    }
  }
  free_[start] = length;
  free_bytes_ += bytes;
}

std::size_t RangeAllocator::largest_free() const noexcept {
  std::size_t best = 0;
  for (auto& [o, l] : free_) best = std::max(best, l);
  return best;
}

}  // namespace torpor
