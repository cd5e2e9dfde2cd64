// HostDriver's page-locked host memory: host_alloc blocks (anonymous mappings) and
// host_register'ed ranges (bookkeeping only: no page is really locked), with the emulated
// limit and delay of HostDriverOptions, and the misuse CUDA reports (an overlap with memory
// already page-locked, device memory, an unknown pointer).
//
// A block or range that a queued copy still touches cannot be freed or unregistered
// (asynchronous mode, in_flight.cpp). check_page_locked is the optional check that every copy
// between device and host memory uses page-locked memory (require_page_locked_copies).
#include <sys/mman.h>

#include <cstdint>
#include <iterator>
#include <mutex>
#include <thread>

#include "driver/host/state.hpp"

namespace torpor {

using host::errno_text;
using host::k_invalid;
using host::k_oom;
using host::misuse;

void* HostDriver::host_alloc(std::size_t bytes) {
  const char* call = "cuMemHostAlloc";
  if (bytes == 0) misuse(call, "size 0");
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) throw_driver_error(k_oom, call, errno_text("mmap"));
  std::lock_guard lock(mu_);
  host_blocks_[p] = bytes;
  return p;
}

void HostDriver::host_free(void* p) {
  std::lock_guard lock(mu_);
  auto it = host_blocks_.find(p);
  if (it == host_blocks_.end()) misuse("cuMemFreeHost", fmt::format("{} was not returned by host_alloc", p));
  refuse_if_in_flight(reinterpret_cast<std::uintptr_t>(p), reinterpret_cast<std::uintptr_t>(p) + it->second,
                      "cuMemFreeHost");
  ::munmap(p, it->second);
  host_blocks_.erase(it);
}

void HostDriver::host_register(void* p, std::size_t bytes, int device) {
  const char* call = "cuMemHostRegister";
  check_device(device, call);
  if (p == nullptr || bytes == 0) misuse(call, fmt::format("{} bytes at {}: nothing to register", bytes, p));
  auto lo = reinterpret_cast<std::uintptr_t>(p);
  if (bytes > UINTPTR_MAX - lo) misuse(call, fmt::format("[{}, +{}) wraps around the address space", p, bytes));
  {
    std::lock_guard lock(mu_);
    if (in_reservation(p)) misuse(call, fmt::format("{} is device memory (inside a reservation)", p));
    auto next = registered_.lower_bound(lo);
    bool overlaps = (next != registered_.end() && next->first < lo + bytes) ||
                    (next != registered_.begin() && std::prev(next)->first + std::prev(next)->second > lo);
    for (auto& [b, n] : host_blocks_) {
      auto blo = reinterpret_cast<std::uintptr_t>(b);
      if (blo < lo + bytes && lo < blo + n) overlaps = true;
    }
    if (overlaps)
      throw_driver_error(k_invalid, call,
                         fmt::format("[{}, +{}) overlaps memory that is already page-locked "
                                     "(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)",
                                     p, bytes));
    std::size_t held = 0;
    for (auto& [b, n] : registered_) held += n;
    if (options_.host_register_limit != 0 && held + bytes > options_.host_register_limit)
      throw_driver_error(k_oom, call,
                         fmt::format("page-locking {} more bytes would pass the emulated limit of {} ({} held)", bytes,
                                     options_.host_register_limit, held));
    registered_[lo] = bytes;
  }
  if (options_.host_register_delay.count() > 0) std::this_thread::sleep_for(options_.host_register_delay);
}

void HostDriver::host_unregister(void* p, int device) {
  const char* call = "cuMemHostUnregister";
  check_device(device, call);
  std::lock_guard lock(mu_);
  auto it = registered_.find(reinterpret_cast<std::uintptr_t>(p));
  if (it == registered_.end())
    misuse(call, fmt::format("{} is not the start of a registered range (CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED)", p));
  refuse_if_in_flight(it->first, it->first + it->second, call);
  registered_.erase(it);
}

void HostDriver::check_page_locked(const void* p, std::size_t n, const char* call) const {
  if (!options_.require_page_locked_copies || n == 0 || in_reservation(p)) return;
  auto lo = reinterpret_cast<std::uintptr_t>(p);
  auto r = registered_.upper_bound(lo);
  if (r != registered_.begin() && lo + n <= std::prev(r)->first + std::prev(r)->second) return;
  for (auto& [b, bytes] : host_blocks_) {
    auto blo = reinterpret_cast<std::uintptr_t>(b);
    if (lo >= blo && lo + n <= blo + bytes) return;
  }
  misuse(call, fmt::format("host memory [{}, +{}) is not page-locked (require_page_locked_copies)", p, n));
}

bool HostDriver::in_pinned_block(const void* p) const {
  auto at = reinterpret_cast<std::uintptr_t>(p);
  auto r = registered_.upper_bound(at);
  if (r != registered_.begin() && at < std::prev(r)->first + std::prev(r)->second) return true;
  auto* b = static_cast<const std::byte*>(p);
  for (auto& [base, bytes] : host_blocks_) {
    const auto* lo = static_cast<const std::byte*>(base);
    if (b >= lo && b < lo + bytes) return true;
  }
  return false;
}

std::vector<std::pair<std::byte*, std::size_t>> HostDriver::host_blocks() const {
  std::lock_guard lock(mu_);
  std::vector<std::pair<std::byte*, std::size_t>> out;
  out.reserve(host_blocks_.size() + registered_.size());
  for (auto& [p, bytes] : host_blocks_) out.emplace_back(static_cast<std::byte*>(p), bytes);
  for (auto& [p, bytes] : registered_) out.emplace_back(reinterpret_cast<std::byte*>(p), bytes);
  return out;
}

}  // namespace torpor
