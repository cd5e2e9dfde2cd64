// HostDriver's virtual memory: reservations, physical handles, mappings and access, emulated on
// mmap (torpor/host_driver.hpp has the mapping of each call).
//
// A reservation is PROT_NONE anonymous memory, trimmed to its alignment; a physical handle is a
// memfd whose size is sealed at creation; a mapping is the memfd mapped MAP_FIXED over the
// reservation, PROT_NONE until set_access; an unmapped span goes back to PROT_NONE anonymous
// memory, so the hole stays reserved and touching it faults. Every misuse CUDA would refuse (a
// span that is not exactly one mapping, a mapping over a mapping, an unknown handle) is a
// driver_error here. check_accessible is what copies, fills and hashes ask before they touch
// bytes: inside a reservation, only accessible mappings of physical memory may be touched.
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <iterator>
#include <limits>
#include <mutex>
#include <shared_mutex>

#include "driver/host/state.hpp"

namespace torpor {

using host::errno_text;
using host::k_invalid;
using host::k_oom;
using host::memfd_name;
using host::misuse;
using host::size_seals;

namespace {

void* anon_none(void* at, std::size_t bytes) {
  int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | (at != nullptr ? MAP_FIXED : 0);
  return ::mmap(at, bytes, PROT_NONE, flags, -1, 0);
}

}  // namespace

void HostDriver::check_aligned(std::size_t v, const char* what, const char* call) const {
  if (v % options_.granularity != 0)
    misuse(call, fmt::format("{} {:#x} is not a multiple of the granularity {:#x}", what, v, options_.granularity));
}

device_ptr HostDriver::reserve(std::size_t bytes, std::size_t alignment) {
  const char* call = "cuMemAddressReserve";
  if (bytes == 0) misuse(call, "size 0");
  check_aligned(bytes, "size", call);
  alignment = std::max(alignment, options_.granularity);
  if ((alignment & (alignment - 1)) != 0) misuse(call, fmt::format("alignment {:#x} is not a power of two", alignment));
  void* raw = anon_none(nullptr, bytes + alignment);
  if (raw == MAP_FAILED) throw_driver_error(k_oom, call, errno_text("mmap of the reservation"));
  auto base = reinterpret_cast<std::uintptr_t>(raw);
  std::uintptr_t aligned = (base + alignment - 1) & ~(alignment - 1);
  // Trim the slack on both sides so the reservation is exactly [aligned, aligned + bytes).
  if (aligned > base) ::munmap(raw, aligned - base);
  std::size_t tail = (base + bytes + alignment) - (aligned + bytes);
  if (tail > 0) ::munmap(reinterpret_cast<void*>(aligned + bytes), tail);
  std::lock_guard lock(mu_);
  reservations_[aligned] = bytes;
  return aligned;
}

void HostDriver::free_reservation(device_ptr va, std::size_t bytes) {
  const char* call = "cuMemAddressFree";
  std::lock_guard lock(mu_);
  auto it = reservations_.find(va);
  if (it == reservations_.end() || it->second != bytes)
    misuse(call, fmt::format("[{:#x}, +{:#x}) is not a reservation", va, bytes));
  auto m = mappings_.lower_bound(va);
  if (m != mappings_.end() && m->first < va + bytes)
    misuse(call, fmt::format("reservation {:#x} still has a mapping at {:#x}; unmap first", va, m->first));
  ::munmap(reinterpret_cast<void*>(va), bytes);
  reservations_.erase(it);
}

PhysicalHandle HostDriver::create(int device, std::size_t bytes, bool exportable) {
  const char* call = "cuMemCreate";
  check_device(device, call);
  if (bytes == 0) misuse(call, "size 0");
  check_aligned(bytes, "size", call);
  auto& live = counters_->live[static_cast<std::size_t>(device)];
  // Reserve the bytes first so two threads cannot both pass the capacity check.
  std::size_t before = live.fetch_add(bytes);
  if (before + bytes > options_.device_bytes) {
    live -= bytes;
    throw_driver_error(k_oom, call,
                       fmt::format("device {} has {} of {} bytes free, {} requested", device,
                                   options_.device_bytes - std::min(before, options_.device_bytes),
                                   options_.device_bytes, bytes));
  }
  auto mem = std::make_shared<Memory>();
  mem->bytes = bytes;
  mem->exportable = exportable;
  mem->gpu_direct_rdma = exportable && options_.gpu_direct_rdma_vmm;  // as CudaDriver::create sets the flag
  mem->counters = counters_;
  mem->fd = ::memfd_create(std::string(memfd_name).c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (mem->fd < 0) {
    live -= bytes;
    mem->counters.reset();
    throw_driver_error(errno == EMFILE ? k_oom : k_invalid, call,
                       errno_text("memfd_create (raise `ulimit -n` if this says too many open files)"));
  }
  mem->device = device;  // from here the destructor gives the bytes back
  if (::ftruncate(mem->fd, static_cast<off_t>(bytes)) != 0) throw_driver_error(k_oom, call, errno_text("ftruncate"));
  if (::fcntl(mem->fd, F_ADD_SEALS, size_seals) != 0) throw_driver_error(k_invalid, call, errno_text("F_ADD_SEALS"));
  struct stat st {};
  ::fstat(mem->fd, &st);
  mem->st_dev = st.st_dev;
  mem->st_ino = st.st_ino;
  std::lock_guard lock(mu_);
  std::uint64_t id = next_id_++;
  handles_[id] = HandleEntry{mem, nullptr};
  return PhysicalHandle{id};
}

const HostDriver::HandleEntry& HostDriver::entry(PhysicalHandle h, const char* call) const {
  auto it = handles_.find(h.value);
  if (it == handles_.end()) misuse(call, fmt::format("unknown handle {} (released twice?)", h.value));
  return it->second;
}

void HostDriver::release(PhysicalHandle handle) {
  std::lock_guard lock(mu_);
  entry(handle, "cuMemRelease");
  // The memory itself lives on while a mapping refers to it.
  handles_.erase(handle.value);
}

void HostDriver::map(device_ptr va, std::size_t bytes, PhysicalHandle handle, std::size_t handle_offset) {
  const char* call = "cuMemMap";
  if (bytes == 0) misuse(call, "size 0");
  check_aligned(va, "address", call);
  check_aligned(bytes, "size", call);
  check_aligned(handle_offset, "offset", call);
  std::lock_guard lock(mu_);
  const HandleEntry& e = entry(handle, call);
  // The reservation that starts at or below va, if any, must hold the whole range.
  auto r = reservations_.upper_bound(va);
  const bool inside = r != reservations_.begin() && va + bytes <= std::prev(r)->first + std::prev(r)->second;
  if (!inside) misuse(call, fmt::format("[{:#x}, +{:#x}) is not inside one reservation", va, bytes));
  auto next = mappings_.lower_bound(va);
  if (next != mappings_.end() && next->first < va + bytes)
    misuse(call, fmt::format("[{:#x}, +{:#x}) overlaps the mapping at {:#x}", va, bytes, next->first));
  if (next != mappings_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second.bytes > va)
      misuse(call, fmt::format("[{:#x}, +{:#x}) overlaps the mapping at {:#x}", va, bytes, prev->first));
  }
  Mapping m;
  m.bytes = bytes;
  m.offset = handle_offset;
  if (e.memory) {
    if (handle_offset + bytes > e.memory->bytes)
      misuse(call, fmt::format("offset {:#x} + size {:#x} exceeds the handle's {:#x} bytes", handle_offset, bytes,
                               e.memory->bytes));
    void* p = ::mmap(reinterpret_cast<void*>(va), bytes, PROT_NONE, MAP_SHARED | MAP_FIXED, e.memory->fd,
                     static_cast<off_t>(handle_offset));
    if (p == MAP_FAILED) throw_driver_error(k_oom, call, errno_text("mmap of the memfd"));
    m.memory = e.memory;
  } else {
    if (e.multicast->added.size() != e.multicast->devices.size())
      misuse(call, "multicast object mapped before every device was added");
    if (handle_offset + bytes > e.multicast->bytes) misuse(call, "mapping exceeds the multicast object");
    // A multicast VA stays PROT_NONE: only multicast_store (multimem.st) may write through it.
    m.multicast = e.multicast;
  }
  mappings_[va] = std::move(m);
}

void HostDriver::unmap(device_ptr va, std::size_t bytes) {
  const char* call = "cuMemUnmap";
  std::unique_lock touching(mapping_mu_);  // waits for copies into the span to finish
  std::lock_guard lock(mu_);
  auto it = mappings_.find(va);
  if (it == mappings_.end() || it->second.bytes != bytes)
    misuse(call, fmt::format("[{:#x}, +{:#x}) is not exactly one mapping", va, bytes));
  refuse_if_in_flight(va, va + bytes, call);
  if (anon_none(reinterpret_cast<void*>(va), bytes) == MAP_FAILED)
    throw_driver_error(k_invalid, call, errno_text("mmap PROT_NONE over the mapping"));
  mappings_.erase(it);  // may free the memory if its handle was released already
}

void HostDriver::set_access(device_ptr va, std::size_t bytes, std::span<const int> devices) {
  const char* call = "cuMemSetAccess";
  if (devices.empty()) misuse(call, "no device named");
  for (int d : devices) check_device(d, call);
  std::lock_guard lock(mu_);
  // The range must be covered, without holes, by whole mappings.
  device_ptr at = va;
  auto it = mappings_.find(va);
  std::vector<std::map<device_ptr, Mapping>::iterator> covered;
  while (at < va + bytes) {
    if (it == mappings_.end() || it->first != at)
      misuse(call, fmt::format("[{:#x}, +{:#x}) is not fully mapped (hole at {:#x})", va, bytes, at));
    covered.push_back(it);
    at += it->second.bytes;
    ++it;
  }
  if (at != va + bytes) misuse(call, fmt::format("[{:#x}, +{:#x}) ends inside a mapping", va, bytes));
  for (auto& c : covered) {
    if (c->second.memory && ::mprotect(reinterpret_cast<void*>(c->first), c->second.bytes, PROT_READ | PROT_WRITE) != 0)
      throw_driver_error(k_invalid, call, errno_text("mprotect"));
    c->second.accessible = true;
  }
}

std::optional<bool> HostDriver::gpu_direct_rdma_capable(device_ptr va) const {
  std::lock_guard lock(mu_);
  auto it = mappings_.upper_bound(va);
  if (it == mappings_.begin()) return std::nullopt;
  --it;
  if (!it->second.memory || va >= it->first + it->second.bytes) return std::nullopt;
  return it->second.memory->gpu_direct_rdma;
}

void HostDriver::check_accessible(const void* p, std::size_t n, const char* call) const {
  auto lo = reinterpret_cast<device_ptr>(p);
  if (n > std::numeric_limits<device_ptr>::max() - lo)
    misuse(call, fmt::format("[{:#x}, +{}) wraps around the end of the address space", lo, n));
  device_ptr hi = lo + n;
  auto r = reservations_.upper_bound(lo);
  bool inside = false;
  if (r != reservations_.begin()) {
    auto prev = std::prev(r);
    inside = lo < prev->first + prev->second;
  }
  if (!inside) {
    if (r != reservations_.end() && r->first < hi)
      misuse(call, fmt::format("[{:#x}, +{}) runs from host memory into a reservation", lo, n));
    return;  // ordinary host memory
  }
  auto it = mappings_.upper_bound(lo);
  if (it == mappings_.begin()) misuse(call, fmt::format("{:#x} is not mapped (asleep or freed?)", lo));
  --it;
  device_ptr at = lo;
  while (at < hi) {
    if (it == mappings_.end() || it->first > at || it->first + it->second.bytes <= at)
      misuse(call, fmt::format("{:#x} is not mapped (asleep or freed?)", at));
    if (!it->second.accessible || !it->second.memory)
      misuse(call, fmt::format("{:#x} is mapped without access (or is a multicast address)", at));
    at = it->first + it->second.bytes;
    ++it;
  }
}

bool HostDriver::in_reservation(const void* p) const {
  auto lo = reinterpret_cast<device_ptr>(p);
  auto r = reservations_.upper_bound(lo);
  if (r == reservations_.begin()) return false;
  --r;
  return lo < r->first + r->second;
}

}  // namespace torpor
