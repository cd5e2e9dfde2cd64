// HostStore: the persistent host backing store that offloaded bytes live in while a pool
// sleeps (and, with skip-unchanged, after it wakes, as retained copies).
//
// Two tiers. Page-locked blocks come from the driver (cuMemHostAlloc, far slower than the copies
// it backs, so it must never happen per cycle; bench/results/2026-11-30-sleep-h200.md): reserve(n)
// adds one block big enough for a whole sleep and later cycles of the same size reuse it. When
// `pinned_limit` is set, bytes beyond it live in ordinary pageable blocks (mmap) instead; the
// sleep engine moves those through a small pinned staging ring. Blocks are kept until release_unused() or destruction.
// Not thread-safe: the pool locks.
#pragma once

#include <cstddef>
#include <vector>

#include "pool/range_allocator.hpp"
#include "torpor/driver.hpp"

namespace torpor {

struct HostSpan {
  std::byte* ptr = nullptr;
  std::size_t bytes = 0;  // reserved (what free() takes back)
  bool pinned = false;
};

class HostStore {
 public:
  static constexpr std::size_t alignment = 256;
  static constexpr std::size_t block_rounding = std::size_t{2} << 20;

  // pinned_limit 0 = no limit.
  explicit HostStore(Driver& driver, std::size_t pinned_limit = 0) : driver_(driver), pinned_limit_(pinned_limit) {}
  ~HostStore();
  HostStore(const HostStore&) = delete;
  HostStore& operator=(const HostStore&) = delete;

  // What allocate(bytes) really takes.
  static constexpr std::size_t reserved_size(std::size_t bytes) noexcept { return align_up(bytes, alignment); }
  // Ensure `bytes` more (a sum of reserved_size values) fit: adds at most one block per tier.
  void reserve(std::size_t bytes);
  // Pinned space first; pageable beyond the limit. Throws out_of_memory.
  HostSpan allocate(std::size_t bytes);
  // Any allocated sub-range, exactly.
  void free(std::byte* p, std::size_t bytes);
  // Gives unused blocks back. Returns the bytes released.
  std::size_t release_unused();

  std::size_t capacity() const noexcept;
  std::size_t pinned_capacity() const noexcept;
  std::size_t used() const noexcept;
  std::size_t blocks() const noexcept { return blocks_.size(); }
  std::size_t growths() const noexcept { return growths_; }  // blocks ever added
  std::size_t pinned_limit() const noexcept { return pinned_limit_; }

 private:
  struct Block {
    std::byte* base;
    RangeAllocator space;
    bool pinned;
  };
  void add_block(std::size_t bytes, bool pinned);
  std::size_t pinned_room() const noexcept;
  void free_block(Block& b) noexcept;

  Driver& driver_;
  std::size_t pinned_limit_;
  std::vector<Block> blocks_;
  std::size_t growths_ = 0;
};

}  // namespace torpor
