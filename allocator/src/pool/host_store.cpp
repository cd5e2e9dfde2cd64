#include "pool/host_store.hpp"

#include <fmt/format.h>
#include <sys/mman.h>

#include <algorithm>
#include <limits>

#include "torpor/error.hpp"
#include "torpor/log.hpp"

namespace torpor {

HostStore::~HostStore() {
  for (auto& b : blocks_) free_block(b);
}

void HostStore::free_block(Block& b) noexcept {
  try {
    if (b.pinned)
      driver_.host_free(b.base);
    else
      ::munmap(b.base, b.space.capacity());
  } catch (const std::exception& e) {
    log::error("HostStore: freeing a {}-byte block failed: {}", b.space.capacity(), e.what());
  }
}

std::size_t HostStore::pinned_room() const noexcept {
  if (pinned_limit_ == 0) return std::numeric_limits<std::size_t>::max();
  std::size_t have = pinned_capacity();
  return have >= pinned_limit_ ? 0 : pinned_limit_ - have;
}

void HostStore::add_block(std::size_t bytes, bool pinned) {
  bytes = align_up(bytes, block_rounding);
  void* p = nullptr;
  if (pinned) {
    try {
      p = driver_.host_alloc(bytes);
    } catch (const driver_error& e) {
      throw out_of_memory(fmt::format("host backing store could not grow by {} pinned bytes ({} held): {}", bytes,
                                      capacity(), e.what()));
    }
  } else {
    p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
      throw out_of_memory(
          fmt::format("host backing store could not grow by {} pageable bytes ({} held)", bytes, capacity()));
  }
  blocks_.push_back(Block{static_cast<std::byte*>(p), RangeAllocator(bytes), pinned});
  ++growths_;
  log::debug("HostStore: new {} block of {} bytes ({} blocks, {} bytes)", pinned ? "pinned" : "pageable", bytes,
             blocks_.size(), capacity());
}

void HostStore::reserve(std::size_t bytes) {
  if (bytes == 0) return;
  std::size_t free_total = 0;
  for (auto& b : blocks_) free_total += b.space.free_bytes();
  if (free_total >= bytes) return;
  std::size_t need = bytes - free_total;
  // Pinned up to the limit; what is left beyond it goes to one pageable block.
  std::size_t room = pinned_room();
  std::size_t pinned = room >= align_up(need, block_rounding) ? need : (room / block_rounding) * block_rounding;
  if (pinned > 0) add_block(pinned, true);
  if (need > pinned) add_block(need - pinned, false);
}

HostSpan HostStore::allocate(std::size_t bytes) {
  std::size_t rounded = reserved_size(bytes);
  // Pinned blocks first: they copy at link speed.
  for (int pass = 0; pass < 2; ++pass) {
    bool want_pinned = pass == 0;
    for (auto& b : blocks_) {
      if (b.pinned != want_pinned) continue;
      if (auto off = b.space.allocate(rounded, alignment)) return HostSpan{b.base + *off, rounded, b.pinned};
    }
  }
  bool pinned = pinned_room() >= align_up(rounded, block_rounding);
  add_block(rounded, pinned);
  Block& b = blocks_.back();
  return HostSpan{b.base + *b.space.allocate(rounded, alignment), rounded, b.pinned};
}

void HostStore::free(std::byte* p, std::size_t bytes) {
  for (auto& b : blocks_) {
    if (p >= b.base && p < b.base + b.space.capacity()) {
      b.space.free(static_cast<std::size_t>(p - b.base), bytes);
      return;
    }
  }
  throw error(fmt::format("internal: {} is not in the host store", static_cast<void*>(p)));
}

std::size_t HostStore::release_unused() {
  std::size_t released = 0;
  for (auto it = blocks_.begin(); it != blocks_.end();) {
    if (it->space.unused()) {
      released += it->space.capacity();
      free_block(*it);
      it = blocks_.erase(it);
    } else {
      ++it;
    }
  }
  return released;
}

std::size_t HostStore::capacity() const noexcept {
  std::size_t c = 0;
  for (auto& b : blocks_) c += b.space.capacity();
  return c;
}

std::size_t HostStore::pinned_capacity() const noexcept {
  std::size_t c = 0;
  for (auto& b : blocks_)
    if (b.pinned) c += b.space.capacity();
  return c;
}

std::size_t HostStore::used() const noexcept {
  std::size_t u = 0;
  for (auto& b : blocks_) u += b.space.used_bytes();
  return u;
}

}  // namespace torpor
