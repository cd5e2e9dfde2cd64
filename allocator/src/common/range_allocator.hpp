// RangeAllocator: first-fit allocation of offsets in [0, capacity) with alignment. Freeing
// any sub-range of allocated space is allowed (the sleep engine frees part of a backup when
// one allocation of several in a backed-up run is freed); free neighbours coalesce.
// Used for the pool's VA arena, for sub-allocation inside slabs and for host store blocks.
// Not thread-safe: its owner locks.
#pragma once

#include <cstddef>
#include <map>
#include <optional>

namespace torpor {

class RangeAllocator {
 public:
  explicit RangeAllocator(std::size_t capacity = 0);

  std::optional<std::size_t> allocate(std::size_t bytes, std::size_t alignment);
  // [offset, offset + bytes) must be entirely allocated; throws torpor::error otherwise
  // (that would be a bookkeeping bug, never user input).
  void free(std::size_t offset, std::size_t bytes);

  std::size_t capacity() const noexcept { return capacity_; }
  std::size_t free_bytes() const noexcept { return free_bytes_; }
  std::size_t used_bytes() const noexcept { return capacity_ - free_bytes_; }
  bool unused() const noexcept { return free_bytes_ == capacity_; }
  std::size_t largest_free() const noexcept;

 private:
  std::size_t capacity_;
  std::size_t free_bytes_;
  std::map<std::size_t, std::size_t> free_;  // offset -> length, disjoint, non-adjacent
};

constexpr std::size_t align_up(std::size_t v, std::size_t a) noexcept { return (v + a - 1) / a * a; }

}  // namespace torpor
