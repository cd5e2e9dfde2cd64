// HostDriver's emulated devices: construction and teardown, what each device is
// (HostDriverOptions: count, memory, granularity, attributes, PCI bus ids), peer access, free
// memory, and the exact accounting tests and `torpor probe` read (counters, live_physical_bytes).
//
// A device's free memory is its emulated size less the live physical bytes created on it
// (Counters, which every Memory holds, so it gives its bytes back when the last handle or mapping
// lets go of it). Teardown lets queued device work finish before it gives the mappings back, and
// reports what the pool leaked instead of hiding it.
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <mutex>

#include "driver/host/async_engine.hpp"
#include "driver/host/state.hpp"
#include "torpor/log.hpp"

namespace torpor {

namespace {

constexpr int k_invalid_device = static_cast<int>(driver_status::invalid_device);

// 2048 handles need 2048 memfds; the default soft limit (1024) is too low for the scenarios
// the benches run, so raise it to the hard limit once.
void raise_fd_limit_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    rlimit rl{};
    if (::getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
      rl.rlim_cur = rl.rlim_max;
      if (::setrlimit(RLIMIT_NOFILE, &rl) != 0) log::debug("HostDriver: could not raise RLIMIT_NOFILE");
    }
  });
}

}  // namespace

HostDriver::HostDriver(const HostDriverOptions& options)
    : options_(options), counters_(std::make_shared<Counters>(std::max(options.devices, 0))) {
  if (options_.devices < 1) throw invalid_argument("HostDriver needs at least one device");
  if (options_.granularity == 0 || (options_.granularity & (options_.granularity - 1)) != 0 ||
      options_.granularity % static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)) != 0)
    throw invalid_argument(
        fmt::format("HostDriver granularity {} must be a power of two and a multiple of the page size",
                    options_.granularity));
  if (options_.async_max_delay < std::chrono::microseconds{0} || options_.async_max_delay > std::chrono::seconds{1})
    throw invalid_argument(
        fmt::format("HostDriver async_max_delay {} us is outside [0, 1000000] us", options_.async_max_delay.count()));
  raise_fd_limit_once();
  if (options_.async) async_ = std::make_unique<HostAsyncEngine>(options_.async_seed, options_.async_max_delay);
}

HostDriver::~HostDriver() {
  // Queued work finishes first (it may touch the mappings given back below).
  async_.reset();
  // Leaks are the pool's bug, not ours to hide: report them, then give the memory back.
  std::lock_guard lock(mu_);
  if (!mappings_.empty() || !handles_.empty() || !reservations_.empty())
    log::debug("HostDriver destroyed with {} mappings, {} handles, {} reservations live", mappings_.size(),
               handles_.size(), reservations_.size());
  mappings_.clear();
  handles_.clear();
  for (auto& [base, bytes] : reservations_) ::munmap(reinterpret_cast<void*>(base), bytes);
  for (auto& [p, bytes] : host_blocks_) ::munmap(p, bytes);
}

void HostDriver::check_device(int device, const char* call) const {
  if (device < 0 || device >= options_.devices)
    throw_driver_error(k_invalid_device, call,
                       fmt::format("device {} does not exist (HostDriver emulates {})", device, options_.devices));
}

int HostDriver::device_count() { return options_.devices; }

DeviceProperties HostDriver::device_properties(int device) {
  check_device(device, "cuDeviceGetAttribute");
  DeviceProperties p;
  p.ordinal = device;
  p.name = fmt::format("HostDriver emulated device {}", device);
  p.total_bytes = options_.device_bytes;
  p.vmm_supported = true;
  p.posix_fd_handles_supported = true;
  p.fabric_handles_supported = options_.fabric != HostDriverOptions::Fabric::off;
  p.gpu_direct_rdma_vmm = options_.gpu_direct_rdma_vmm;
  p.granularity = options_.granularity;
  p.multicast_attribute = options_.multicast_attribute;
  if (static_cast<std::size_t>(device) < options_.pci_bus_ids.size())
    p.pci_bus_id = options_.pci_bus_ids[static_cast<std::size_t>(device)];
  return p;
}

bool HostDriver::can_access_peer(int device, int peer) {
  check_device(device, "cuDeviceCanAccessPeer");
  check_device(peer, "cuDeviceCanAccessPeer");
  return device != peer && options_.peer_access;
}

MemoryInfo HostDriver::memory_info(int device) {
  check_device(device, "cuMemGetInfo");
  std::size_t live = counters_->live[static_cast<std::size_t>(device)].load();
  return {options_.device_bytes - std::min(live, options_.device_bytes), options_.device_bytes};
}

HostDriverCounters HostDriver::counters() const {
  std::lock_guard lock(mu_);
  HostDriverCounters c;
  for (auto& [id, e] : handles_) {
    if (e.memory)
      ++c.live_handles;
    else
      ++c.multicast_objects;
  }
  for (auto& l : counters_->live) c.live_physical_bytes += l.load();
  for (auto& [va, m] : mappings_) {
    c.mapped_bytes += m.bytes;
    ++c.mappings;
  }
  c.reservations = reservations_.size();
  for (auto& [b, n] : reservations_) c.reserved_bytes += n;
  for (auto& [p, n] : host_blocks_) c.host_bytes += n;
  for (auto& [p, n] : registered_) c.registered_bytes += n;
  c.registrations = registered_.size();
  c.streams = streams_.size();
  c.events = events_.size();
  c.async_pending = async_ ? async_->pending() : 0;
  c.async_conflicts = async_conflicts_.load();
  c.async_races = async_races_.load();
  c.async_host_writes = async_host_writes_.load();
  return c;
}

std::size_t HostDriver::live_physical_bytes(int device) const {
  check_device(device, "live_physical_bytes");
  return counters_->live[static_cast<std::size_t>(device)].load();
}

}  // namespace torpor
