#include "torpor/host_store.hpp"

#include <fmt/format.h>

#include "torpor/error.hpp"
#include "torpor/log.hpp"

namespace torpor {

HostStore::~HostStore() {
  for (auto& b : blocks_) {
    try {
      driver_.host_free(b.base);
    } catch (const std::exception& e) {
      log::error("HostStore: freeing a {}-byte block failed: {}", b.space.capacity(), e.what());
    }
  }
}

HostStore::Block& HostStore::add_block(std::size_t bytes) {
  bytes = align_up(bytes, block_rounding);
  void* p;
  try {
    p = driver_.host_alloc(bytes);
  } catch (const driver_error& e) {
    throw out_of_memory(fmt::format("host backing store could not grow by {} bytes ({} held): {}", bytes, capacity(),
                                    e.what()));
  }
  blocks_.push_back(Block{static_cast<std::byte*>(p), RangeAllocator(bytes)});
  ++growths_;
  log::debug("HostStore: new block of {} bytes ({} blocks, {} bytes)", bytes, blocks_.size(), capacity());
  return blocks_.back();
}

void HostStore::reserve(std::size_t bytes) {
  if (bytes == 0) return;
  std::size_t free_total = 0;
  for (auto& b : blocks_) free_total += b.space.free_bytes();
  if (free_total >= bytes) return;
  add_block(bytes - free_total);
}

std::byte* HostStore::allocate(std::size_t bytes) {
  std::size_t rounded = reserved_size(bytes);
  for (auto& b : blocks_)
    if (auto off = b.space.allocate(rounded, alignment)) return b.base + *off;
  Block& b = add_block(rounded);
  return b.base + *b.space.allocate(rounded, alignment);
}

HostStore::Block* HostStore::block_of(const std::byte* p) {
  for (auto& b : blocks_)
    if (p >= b.base && p < b.base + b.space.capacity()) return &b;
  return nullptr;
}

void HostStore::free(std::byte* p, std::size_t bytes) {
  Block* b = block_of(p);
  if (b == nullptr) throw error(fmt::format("internal: {} is not in the host store", static_cast<void*>(p)));
  b->space.free(static_cast<std::size_t>(p - b->base), bytes);
}

std::size_t HostStore::release_unused() {
  std::size_t released = 0;
  for (auto it = blocks_.begin(); it != blocks_.end();) {
    if (it->space.unused()) {
      driver_.host_free(it->base);
      released += it->space.capacity();
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

std::size_t HostStore::used() const noexcept {
  std::size_t u = 0;
  for (auto& b : blocks_) u += b.space.used_bytes();
  return u;
}

}  // namespace torpor
