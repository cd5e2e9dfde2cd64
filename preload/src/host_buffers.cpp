// torpor.tms's zero-copy backups in hook_mode "torch" (preload.hpp): host buffers of the
// backend's kind, made and given back through this library.
#include <fmt/core.h>

#include <cstdint>
#include <mutex>

#include "preload.hpp"

using namespace torpor::preload;  // for the C entry points below, outside the namespace

extern "C" {

// torpor.tms's zero-copy backups in hook_mode "torch" (not a CUDA or TMS name): host memory of
// the backend's kind, page-locked ("pinned", cudaMallocHost through the loaded runtime; pageable
// when there is none or it refuses, with a message) or anonymous pageable ("mmap"), given back by
// torpor_preload_host_free. NULL (and a message) when no memory could be had.
__attribute__((visibility("default"))) void* torpor_preload_host_alloc(std::uint64_t bytes, const char* backend) {
  if (bytes == 0 || backend == nullptr) return nullptr;
  if (bytes > (std::uint64_t{1} << 50)) {
    say(fmt::format("torpor_preload_host_alloc: {} bytes is more than any host holds", bytes));
    return nullptr;
  }
  Slot slot;
  if (!make_slot(slot, static_cast<size_t>(bytes), backend)) return nullptr;
  State& s = state();
  std::lock_guard lock(s.mu);
  s.host_buffers[reinterpret_cast<std::uintptr_t>(slot.host)] = slot;
  return slot.host;
}

// Whether the buffer was one of torpor_preload_host_alloc's (and is now given back).
__attribute__((visibility("default"))) bool torpor_preload_host_free(void* host) {
  Slot slot;
  {
    State& s = state();
    std::lock_guard lock(s.mu);
    auto it = s.host_buffers.find(reinterpret_cast<std::uintptr_t>(host));
    if (it == s.host_buffers.end()) return false;
    slot = it->second;
    s.host_buffers.erase(it);
  }
  release_slot(slot);
  return true;
}

// Whether the buffer is page-locked (cudaMallocHost's) rather than pageable.
__attribute__((visibility("default"))) bool torpor_preload_host_pinned(const void* host) {
  State& s = state();
  std::lock_guard lock(s.mu);
  auto it = s.host_buffers.find(reinterpret_cast<std::uintptr_t>(host));
  return it != s.host_buffers.end() && it->second.pinned;
}

}  // extern "C"
