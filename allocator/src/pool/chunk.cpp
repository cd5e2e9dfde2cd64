// Chunk's physical lifetime and ChunkMemory; the design note and invariants are in chunk.hpp.
#include "pool/chunk.hpp"

#include <fmt/core.h>

#include <array>
#include <cstring>
#include <exception>

#include "torpor/content_hash.hpp"
#include "torpor/error.hpp"
#include "torpor/log.hpp"

namespace torpor {

// ---------------------------------------------------------------------------------------------
// ChunkMemory

PhysicalHandle ChunkMemory::create(std::size_t bytes, const std::string& tag) {
  try {
    return driver_.create(device_, bytes, exportable_);
  } catch (const driver_error& e) {
    if (!e.is_out_of_memory()) throw;
    MemoryInfo mi{};
    try {
      mi = driver_.memory_info(device_);
    } catch (...) {  // NOLINT(bugprone-empty-catch): the message then says 0 bytes free; the error is the OOM
    }
    throw out_of_memory(fmt::format("device {} out of memory: {} bytes for tag '{}' ({} of {} bytes free): {}", device_,
                                    bytes, tag, mi.free_bytes, mi.total_bytes, e.what()));
  }
}

void ChunkMemory::set_access(device_ptr va, std::size_t bytes) { driver_.set_access(va, bytes, access_devices_); }

void ChunkMemory::release_or_defer(PhysicalHandle h, device_ptr va) noexcept {
  try {
    driver_.release(h);
  } catch (const std::exception& e) {
    log::warn("pool: releasing the memory of chunk {:#x} failed, will retry: {}", va, e.what());
    std::lock_guard lock(pending_mu_);
    pending_.push_back(h);
  }
}

void ChunkMemory::retry_pending() noexcept {
  std::lock_guard lock(pending_mu_);
  std::vector<PhysicalHandle> still;
  for (PhysicalHandle h : pending_) {
    try {
      driver_.release(h);
    } catch (const std::exception& e) {
      log::warn("pool: retrying a deferred release failed again: {}", e.what());
      still.push_back(h);
    }
  }
  pending_ = std::move(still);
}

std::size_t ChunkMemory::pending() const {
  std::lock_guard lock(pending_mu_);
  return pending_.size();
}

// ---------------------------------------------------------------------------------------------
// Chunk

void Chunk::remap(ChunkMemory& m) {
  if (handle) return;  // stranded: still mapped
  PhysicalHandle h = m.create(bytes, tag);
  try {
    m.driver().map(va, bytes, h, 0);
  } catch (...) {
    m.release_or_defer(h, va);
    throw;
  }
  handle = h;
}

void Chunk::map_new(ChunkMemory& m) {
  remap(m);
  try {
    m.set_access(va, bytes);
  } catch (...) {
    drop_mapping(m);
    throw;
  }
}

void Chunk::unmap_and_release(ChunkMemory& m) {
  m.driver().unmap(va, bytes);  // throws with nothing changed
  PhysicalHandle h = handle;
  handle = {};
  m.release_or_defer(h, va);
}

bool Chunk::drop_mapping(ChunkMemory& m) noexcept {
  try {
    m.driver().unmap(va, bytes);
  } catch (const std::exception& e) {
    // Releasing the handle now would hide memory that is still mapped: keep it.
    log::error("pool: unmapping chunk {:#x} in a rollback failed; it keeps its mapping: {}", va, e.what());
    return false;
  }
  PhysicalHandle h = handle;
  handle = {};
  m.release_or_defer(h, va);
  return true;
}

Hash128 sample_of(const std::byte* p, std::size_t bytes) noexcept {
  constexpr std::size_t window = 64, windows = 8;
  if (bytes <= window * windows) return content_hash::compute(p, bytes);
  std::array<std::byte, window * windows> buf{};
  for (std::size_t i = 0; i < windows; ++i)
    std::memcpy(buf.data() + i * window, p + i * (bytes - window) / (windows - 1), window);
  return content_hash::compute(buf.data(), buf.size());
}

std::size_t Chunk::backed_bytes(std::size_t lo, std::size_t hi) const noexcept {
  std::size_t kept = 0;
  auto b = backups.upper_bound(lo);
  if (b != backups.begin()) --b;
  for (; b != backups.end() && b->first < hi; ++b) {
    std::size_t blo = std::max(lo, b->first), bhi = std::min(hi, b->first + b->second.bytes);
    if (bhi > blo) kept += bhi - blo;
  }
  return kept;
}

}  // namespace torpor
