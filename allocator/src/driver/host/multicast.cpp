// HostDriver's multicast objects (NVLS), emulated: an object records the devices named at
// creation, those added so far and, per device, the memory bound at each multicast offset. A
// store through a mapped multicast address (multicast_store, what multimem.st does on a GPU) is
// fanned out in software with pwrite to every bound buffer; the multicast VA itself stays
// PROT_NONE.
//
// The order CUDA requires is enforced: memory is bound and the object mapped only once every
// named device was added. An exported object is named by a memfd token whose inode identifies
// it; it can be imported only by the same driver instance (ranks that are threads), which
// multicast_shares_across_processes() says up front.
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <iterator>
#include <mutex>

#include "driver/host/state.hpp"

namespace torpor {

using host::errno_text;
using host::k_invalid;
using host::k_oom;
using host::misuse;

std::shared_ptr<HostDriver::Multicast> HostDriver::multicast_of(MulticastHandle mc, const char* call) const {
  auto it = handles_.find(mc.value);
  if (it == handles_.end() || !it->second.multicast) misuse(call, fmt::format("unknown multicast handle {}", mc.value));
  return it->second.multicast;
}

std::size_t HostDriver::multicast_granularity(std::span<const int> devices, std::size_t) {
  for (int d : devices) check_device(d, "cuMulticastGetGranularity");
  return options_.granularity;
}

MulticastHandle HostDriver::multicast_create(std::span<const int> devices, std::size_t bytes) {
  const char* call = "cuMulticastCreate";
  if (!options_.multicast_attribute)
    throw_driver_error(static_cast<int>(driver_status::not_supported), call,
                       "the emulated devices report no multicast support");
  if (devices.empty()) misuse(call, "no devices");
  for (int d : devices) check_device(d, call);
  if (bytes == 0) misuse(call, "size 0");
  check_aligned(bytes, "size", call);
  auto mc = std::make_shared<Multicast>();
  mc->bytes = bytes;
  mc->devices.assign(devices.begin(), devices.end());
  std::lock_guard lock(mu_);
  std::uint64_t id = next_id_++;
  handles_[id] = HandleEntry{nullptr, mc};
  return MulticastHandle{id};
}

void HostDriver::multicast_add_device(MulticastHandle mc, int device) {
  const char* call = "cuMulticastAddDevice";
  check_device(device, call);
  std::lock_guard lock(mu_);
  auto m = multicast_of(mc, call);
  if (std::find(m->devices.begin(), m->devices.end(), device) == m->devices.end())
    misuse(call, fmt::format("device {} was not named when the multicast object was created", device));
  if (!m->added.insert(device).second) misuse(call, fmt::format("device {} added twice", device));
}

void HostDriver::multicast_bind(MulticastHandle mc, std::size_t mc_offset, PhysicalHandle memory,
                                std::size_t memory_offset, std::size_t bytes) {
  const char* call = "cuMulticastBindMem";
  check_aligned(mc_offset, "multicast offset", call);
  check_aligned(memory_offset, "memory offset", call);
  check_aligned(bytes, "size", call);
  std::lock_guard lock(mu_);
  auto m = multicast_of(mc, call);
  // As on the GPU: memory can be bound only once every participating device was added.
  if (m->added.size() != m->devices.size())
    misuse(call,
           fmt::format("bind before every device was added ({} of {} added)", m->added.size(), m->devices.size()));
  const HandleEntry& e = entry(memory, call);
  if (!e.memory) misuse(call, "memory handle is a multicast object");
  int device = e.memory->device;
  if (device < 0) misuse(call, "memory imported from another process cannot be bound here");
  if (!m->added.count(device)) misuse(call, fmt::format("memory lives on device {}, not a member", device));
  if (mc_offset + bytes > m->bytes || memory_offset + bytes > e.memory->bytes) misuse(call, "range out of bounds");
  auto& list = m->bindings[device];
  for (auto& b : list)
    if (mc_offset < b.mc_offset + b.bytes && b.mc_offset < mc_offset + bytes)
      misuse(call, fmt::format("device {} already has memory bound at multicast offset {:#x}", device, b.mc_offset));
  list.push_back({e.memory, memory_offset, mc_offset, bytes});
}

void HostDriver::multicast_unbind(MulticastHandle mc, int device, std::size_t mc_offset, std::size_t bytes) {
  const char* call = "cuMulticastUnbind";
  std::lock_guard lock(mu_);
  auto m = multicast_of(mc, call);
  auto& list = m->bindings[device];
  auto it = std::find_if(list.begin(), list.end(),
                         [&](const Multicast::Binding& b) { return b.mc_offset == mc_offset && b.bytes == bytes; });
  if (it == list.end())
    misuse(call, fmt::format("no binding of device {} at multicast offset {:#x} size {:#x}", device, mc_offset, bytes));
  list.erase(it);
}

void HostDriver::multicast_release(MulticastHandle mc) {
  std::lock_guard lock(mu_);
  multicast_of(mc, "cuMemRelease(multicast)");
  handles_.erase(mc.value);
}

PhysicalHandle HostDriver::as_physical(MulticastHandle mc) { return PhysicalHandle{mc.value}; }

int HostDriver::multicast_export_fd(MulticastHandle mc) {
  const char* call = "cuMemExportToShareableHandle(multicast)";
  std::lock_guard lock(mu_);
  auto m = multicast_of(mc, call);
  if (m->token_fd < 0) {
    int fd = ::memfd_create("torpor-multicast", MFD_CLOEXEC);
    if (fd < 0) throw_driver_error(k_oom, call, errno_text("memfd_create"));
    struct stat st {};
    ::fstat(fd, &st);
    m->token_fd = fd;
    m->st_dev = st.st_dev;
    m->st_ino = st.st_ino;
  }
  int fd = ::fcntl(m->token_fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) throw_driver_error(k_oom, call, errno_text("dup"));
  return fd;
}

MulticastHandle HostDriver::multicast_import_fd(int fd) {
  const char* call = "cuMemImportFromShareableHandle(multicast)";
  struct stat st {};
  if (fd < 0 || ::fstat(fd, &st) != 0) misuse(call, fmt::format("fd {} is not open", fd));
  std::lock_guard lock(mu_);
  std::shared_ptr<Multicast> found;
  auto same = [&](const std::shared_ptr<Multicast>& m) {
    return m && m->token_fd >= 0 && m->st_dev == st.st_dev && m->st_ino == st.st_ino;
  };
  for (auto& [id, e] : handles_)
    if (same(e.multicast)) found = e.multicast;
  for (auto& [va, m] : mappings_)
    if (!found && same(m.multicast)) found = m.multicast;
  if (!found)
    throw_driver_error(static_cast<int>(driver_status::not_supported), call,
                       fmt::format("fd {} is not a multicast object exported by this HostDriver; the emulation shares "
                                   "multicast objects only between ranks that are threads of one driver",
                                   fd));
  std::uint64_t id = next_id_++;
  handles_[id] = HandleEntry{nullptr, found};
  return MulticastHandle{id};
}

std::optional<HostMulticastInfo> HostDriver::multicast_at(device_ptr va) const {
  std::lock_guard lock(mu_);
  auto it = mappings_.upper_bound(va);
  if (it == mappings_.begin()) return std::nullopt;
  --it;
  if (!it->second.multicast || va >= it->first + it->second.bytes) return std::nullopt;
  const Multicast& m = *it->second.multicast;
  HostMulticastInfo info;
  info.bytes = m.bytes;
  info.devices = m.devices;
  info.added.assign(m.added.begin(), m.added.end());
  for (auto& [device, list] : m.bindings)
    for (auto& b : list) info.bound_bytes[device] += b.bytes;
  for (auto& [id, e] : handles_)
    if (e.multicast.get() == &m) ++info.handles;
  return info;
}

void HostDriver::multicast_store(device_ptr mc_va, const void* src, std::size_t bytes) {
  const char* call = "multimem.st";
  std::lock_guard lock(mu_);
  auto it = mappings_.upper_bound(mc_va);
  if (it == mappings_.begin()) misuse(call, fmt::format("{:#x} is not a multicast address", mc_va));
  --it;
  const Mapping& m = it->second;
  if (!m.multicast || mc_va + bytes > it->first + m.bytes)
    misuse(call, fmt::format("[{:#x}, +{}) is not inside one multicast mapping", mc_va, bytes));
  if (!m.accessible) misuse(call, "multicast mapping has no access set");
  std::size_t off = m.offset + (mc_va - it->first);
  for (auto& [device, list] : m.multicast->bindings) {
    for (auto& b : list) {
      if (off < b.mc_offset || off + bytes > b.mc_offset + b.bytes) continue;
      auto pos = static_cast<off_t>(b.memory_offset + (off - b.mc_offset));
      if (::pwrite(b.memory->fd, src, bytes, pos) != static_cast<ssize_t>(bytes))
        throw_driver_error(k_invalid, call, errno_text("pwrite fan-out"));
    }
  }
}

}  // namespace torpor
