// HostStore: the persistent host backing store that offloaded bytes live in while a pool
// sleeps. Page-locked blocks come from the driver (cuMemHostAlloc on a GPU, which costs about
// 2.2 GB/s on the test H200s, so it must never happen per cycle): reserve(n) adds one block
// big enough for a whole sleep, later cycles of the same size reuse it. Blocks are kept until
// release_unused() or destruction. Not thread-safe: the pool locks.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "torpor/driver.hpp"
#include "torpor/range_allocator.hpp"

namespace torpor {

class HostStore {
 public:
  static constexpr std::size_t alignment = 256;
  static constexpr std::size_t block_rounding = std::size_t{2} << 20;

  explicit HostStore(Driver& driver) : driver_(driver) {}
  ~HostStore();
  HostStore(const HostStore&) = delete;
  HostStore& operator=(const HostStore&) = delete;

  // What allocate(bytes) really takes: callers keep this length to free it exactly.
  static constexpr std::size_t reserved_size(std::size_t bytes) noexcept { return align_up(bytes, alignment); }
  // Ensure `bytes` more (a sum of reserved_size values) fit: adds at most one block.
  void reserve(std::size_t bytes);
  // reserved_size(bytes) bytes; throws out_of_memory when the driver cannot provide a block.
  std::byte* allocate(std::size_t bytes);
  // Any allocated sub-range, exactly.
  void free(std::byte* p, std::size_t bytes);
  // Gives unused blocks back to the driver. Returns the bytes released.
  std::size_t release_unused();

  std::size_t capacity() const noexcept;
  std::size_t used() const noexcept;
  std::size_t blocks() const noexcept { return blocks_.size(); }
  std::size_t growths() const noexcept { return growths_; }  // host_alloc calls made so far

 private:
  struct Block {
    std::byte* base;
    RangeAllocator space;
  };
  Block& add_block(std::size_t bytes);
  Block* block_of(const std::byte* p);

  Driver& driver_;
  std::vector<Block> blocks_;
  std::size_t growths_ = 0;
};

}  // namespace torpor
