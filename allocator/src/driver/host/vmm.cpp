// HostDriver: see host_driver.hpp for the mapping of VMM calls onto memfd/mmap.
//
// Invariants (all under mu_):
//   - every Mapping lies inside one reservation and no two mappings overlap;
//   - a Memory object is alive while a handle entry or a mapping holds it; its destructor
//     closes the memfd and takes its bytes off the owning device's live count;
//   - a reservation can only be freed when nothing is mapped inside it;
//   - a range checked accessible stays mapped until the copy (fill, hash) that checked it is
//     done: those hold mapping_mu_ shared across check and touch (synchronous mode) or
//     register the range as in flight until a worker did it (asynchronous mode); unmap holds
//     mapping_mu_ exclusively and refuses a range still in flight;
//   - every memfd it creates has its size sealed (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL),
//     and import takes only such memfds: a peer can never truncate memory another process maps.
#include "torpor/host_driver.hpp"

#include <fcntl.h>
#include <fmt/core.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <iterator>
#include <limits>
#include <string_view>
#include <thread>

#include "driver/host/async_engine.hpp"
#include "torpor/content_hash.hpp"
#include "torpor/error.hpp"
#include "torpor/log.hpp"

namespace torpor {

namespace {

constexpr int k_invalid = static_cast<int>(driver_status::invalid_value);
constexpr int k_oom = static_cast<int>(driver_status::out_of_memory);
constexpr int k_invalid_device = static_cast<int>(driver_status::invalid_device);

// The name every physical memfd gets; import checks it (with the seals) to know torpor's memory.
constexpr std::string_view memfd_name = "torpor-physical";
constexpr int size_seals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

[[noreturn]] void misuse(const char* call, const std::string& what) { throw_driver_error(k_invalid, call, what); }

std::string errno_text(const char* what) { return fmt::format("{}: {}", what, std::strerror(errno)); }

void* anon_none(void* at, std::size_t bytes) {
  int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | (at != nullptr ? MAP_FIXED : 0);
  return ::mmap(at, bytes, PROT_NONE, flags, -1, 0);
}

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

struct HostDriver::Counters {
  explicit Counters(int devices) : live(static_cast<std::size_t>(devices)) {}
  std::vector<std::atomic<std::size_t>> live;  // live physical bytes per device
};

struct HostDriver::Memory {
  int fd = -1;
  std::size_t bytes = 0;
  int device = -1;  // owning device in this driver; -1 when imported from another process
  bool exportable = false;
  bool gpu_direct_rdma = false;  // created exportable on a device with gpu_direct_rdma_vmm
  dev_t st_dev = 0;
  ino_t st_ino = 0;
  std::shared_ptr<Counters> counters;
  Memory() = default;
  Memory(const Memory&) = delete;
  Memory& operator=(const Memory&) = delete;
  ~Memory() {
    if (fd >= 0) ::close(fd);
    if (device >= 0 && counters) counters->live[static_cast<std::size_t>(device)] -= bytes;
  }
};

struct HostDriver::Multicast {
  Multicast() = default;
  Multicast(const Multicast&) = delete;
  Multicast& operator=(const Multicast&) = delete;
  ~Multicast() {
    if (token_fd >= 0) ::close(token_fd);
  }
  // The exported name of the object (a memfd whose inode identifies it), made on first export.
  int token_fd = -1;
  dev_t st_dev = 0;
  ino_t st_ino = 0;
  std::size_t bytes = 0;
  std::vector<int> devices;  // the devices named at creation
  std::set<int> added;
  struct Binding {
    std::shared_ptr<Memory> memory;
    std::size_t memory_offset = 0;
    std::size_t mc_offset = 0;
    std::size_t bytes = 0;
  };
  std::map<int, std::vector<Binding>> bindings;  // device -> bindings
};

std::string_view to_string(DriverCall c) noexcept {
  switch (c) {
    case DriverCall::reserve: return "reserve";
    case DriverCall::free_reservation: return "free_reservation";
    case DriverCall::create: return "create";
    case DriverCall::release: return "release";
    case DriverCall::map: return "map";
    case DriverCall::unmap: return "unmap";
    case DriverCall::set_access: return "set_access";
    case DriverCall::export_handle: return "export_handle";
    case DriverCall::import_handle: return "import_handle";
    case DriverCall::host_alloc: return "host_alloc";
    case DriverCall::host_free: return "host_free";
    case DriverCall::stream_create: return "stream_create";
    case DriverCall::stream_destroy: return "stream_destroy";
    case DriverCall::copy: return "copy";
    case DriverCall::fill: return "fill";
    case DriverCall::stream_synchronize: return "stream_synchronize";
    case DriverCall::device_synchronize: return "device_synchronize";
    case DriverCall::event_create: return "event_create";
    case DriverCall::event_destroy: return "event_destroy";
    case DriverCall::event_record: return "event_record";
    case DriverCall::stream_wait_event: return "stream_wait_event";
    case DriverCall::event_synchronize: return "event_synchronize";
    case DriverCall::multicast_create: return "multicast_create";
    case DriverCall::multicast_add_device: return "multicast_add_device";
    case DriverCall::multicast_bind: return "multicast_bind";
    case DriverCall::multicast_unbind: return "multicast_unbind";
    case DriverCall::multicast_release: return "multicast_release";
    case DriverCall::hash: return "hash";
    case DriverCall::multicast_granularity: return "multicast_granularity";
    case DriverCall::multicast_export: return "multicast_export";
    case DriverCall::multicast_import: return "multicast_import";
    case DriverCall::host_register: return "host_register";
    case DriverCall::host_unregister: return "host_unregister";
    case DriverCall::count_: break;
  }
  return "?";
}

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

void HostDriver::check_aligned(std::size_t v, const char* what, const char* call) const {
  if (v % options_.granularity != 0)
    misuse(call, fmt::format("{} {:#x} is not a multiple of the granularity {:#x}", what, v, options_.granularity));
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

int HostDriver::export_fd(PhysicalHandle handle) {
  const char* call = "cuMemExportToShareableHandle";
  std::lock_guard lock(mu_);
  const HandleEntry& e = entry(handle, call);
  if (!e.memory) misuse(call, "multicast objects are exported by the multicast layer, not as fds here");
  if (!e.memory->exportable) misuse(call, "handle was not created exportable");
  int fd = ::fcntl(e.memory->fd, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) throw_driver_error(k_oom, call, errno_text("dup"));
  return fd;
}

PhysicalHandle HostDriver::import_fd(int fd) { return import_checked(fd, std::nullopt); }

PhysicalHandle HostDriver::import_fd_of_size(int fd, std::size_t bytes) { return import_checked(fd, bytes); }

namespace {

// What /proc says the descriptor is ("/memfd:torpor-physical (deleted)", "pipe:[123]", a path).
std::string describe_fd(int fd) {
  char buf[256] = {};
  ssize_t n = ::readlink(fmt::format("/proc/self/fd/{}", fd).c_str(), buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string("?");
}

}  // namespace

PhysicalHandle HostDriver::import_checked(int fd, std::optional<std::size_t> announced) {
  const char* call = "cuMemImportFromShareableHandle";
  struct stat st {};
  if (fd < 0 || ::fstat(fd, &st) != 0) misuse(call, fmt::format("fd {} is not open", fd));
  const std::string what = describe_fd(fd);
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (!S_ISREG(st.st_mode) || !what.starts_with(fmt::format("/memfd:{}", memfd_name)) || seals < 0 ||
      (seals & size_seals) != size_seals)
    misuse(call, fmt::format("fd {} ({}) is not physical memory exported by torpor: only a size-sealed memfd named "
                             "{} is imported",
                             fd, what, memfd_name));
  if (st.st_size <= 0 || static_cast<std::size_t>(st.st_size) % options_.granularity != 0)
    misuse(call, fmt::format("fd {} is not exported physical memory (size {})", fd, st.st_size));
  if (announced && static_cast<std::size_t>(st.st_size) != *announced)
    misuse(call, fmt::format("fd {} holds {} bytes; its exporter announced {}", fd, st.st_size, *announced));
  std::lock_guard lock(mu_);
  // Memory exported by this same driver (ranks that are threads): share the object, so the
  // accounting sees one piece of memory kept alive by two handles.
  std::shared_ptr<Memory> mem;
  for (auto& [id, e] : handles_)
    if (e.memory && e.memory->st_dev == st.st_dev && e.memory->st_ino == st.st_ino) mem = e.memory;
  for (auto& [va, m] : mappings_)
    if (!mem && m.memory && m.memory->st_dev == st.st_dev && m.memory->st_ino == st.st_ino) mem = m.memory;
  if (!mem) {
    mem = std::make_shared<Memory>();
    mem->fd = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (mem->fd < 0) throw_driver_error(k_oom, call, errno_text("dup"));
    mem->bytes = static_cast<std::size_t>(st.st_size);
    mem->exportable = true;
    mem->st_dev = st.st_dev;
    mem->st_ino = st.st_ino;
  }
  std::uint64_t id = next_id_++;
  handles_[id] = HandleEntry{mem, nullptr};
  return PhysicalHandle{id};
}

namespace {

// The emulated CUmemFabricHandle. Native integers: both ends run on one machine.
constexpr std::array<char, 8> fabric_magic = {'T', 'R', 'P', 'F', 'A', 'B', '0', '1'};
struct FabricBlob {
  std::array<char, 8> magic;
  std::int32_t pid;
  std::int32_t fd;
  std::uint64_t st_dev;
  std::uint64_t st_ino;
  std::uint64_t bytes;
  std::int32_t node;
};
static_assert(sizeof(FabricBlob) <= fabric_handle_bytes);

constexpr int k_not_permitted = static_cast<int>(driver_status::not_permitted);

// A descriptor closed at scope exit (the driver layer does not use the group's UniqueFd).
struct ScopedFd {
  int fd = -1;
  explicit ScopedFd(int f) : fd(f) {}
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  ~ScopedFd() {
    if (fd >= 0) ::close(fd);
  }
};

const char* no_channel_words = "no IMEX channel (emulated by TORPOR_HOST_FABRIC=no-channel): "
                               "/dev/nvidia-caps-imex-channels/channel0 is missing on this node";

}  // namespace

FabricHandle HostDriver::export_fabric(PhysicalHandle handle) {
  const char* call = "cuMemExportToShareableHandle(fabric)";
  if (options_.fabric == HostDriverOptions::Fabric::off)
    throw_driver_error(static_cast<int>(driver_status::not_supported), call,
                       "the emulated devices have no fabric handle support (TORPOR_HOST_FABRIC=off)");
  if (options_.fabric == HostDriverOptions::Fabric::no_channel)
    throw_driver_error(k_not_permitted, call, no_channel_words);
  std::lock_guard lock(mu_);
  const HandleEntry& e = entry(handle, call);
  if (!e.memory) misuse(call, "multicast objects are not shared as fabric handles by the host backend");
  if (!e.memory->exportable) misuse(call, "handle was not created exportable");
  FabricBlob b{};
  b.magic = fabric_magic;
  b.pid = static_cast<std::int32_t>(::getpid());
  b.fd = e.memory->fd;  // open while the handle lives, as a fabric export is valid while its handle is
  b.st_dev = static_cast<std::uint64_t>(e.memory->st_dev);
  b.st_ino = static_cast<std::uint64_t>(e.memory->st_ino);
  b.bytes = e.memory->bytes;
  b.node = options_.node;
  FabricHandle out;
  std::memcpy(out.bytes.data(), &b, sizeof b);
  return out;
}

PhysicalHandle HostDriver::import_fabric(const FabricHandle& handle, std::size_t bytes) {
  const char* call = "cuMemImportFromShareableHandle(fabric)";
  if (options_.fabric == HostDriverOptions::Fabric::off)
    throw_driver_error(static_cast<int>(driver_status::not_supported), call,
                       "the emulated devices have no fabric handle support (TORPOR_HOST_FABRIC=off)");
  if (options_.fabric == HostDriverOptions::Fabric::no_channel)
    throw_driver_error(k_not_permitted, call, no_channel_words);
  if (options_.fabric == HostDriverOptions::Fabric::import_refused)
    throw_driver_error(k_not_permitted, call,
                       "the import was not permitted (emulated by TORPOR_HOST_FABRIC=import-refused): this "
                       "process has no access to the IMEX channel the exporter's memory belongs to");
  FabricBlob b{};
  std::memcpy(&b, handle.bytes.data(), sizeof b);
  if (b.magic != fabric_magic || b.pid <= 0 || b.fd < 0)
    misuse(call, "the 64 bytes are not a fabric handle exported by the host backend");
  ScopedFd taken(-1);
  if (b.pid == ::getpid()) {
    taken.fd = ::fcntl(b.fd, F_DUPFD_CLOEXEC, 0);
    if (taken.fd < 0)
      misuse(call, fmt::format("descriptor {} of this process is not open: the exporter released the memory the "
                               "handle names",
                               b.fd));
  } else {
    ScopedFd pidfd(static_cast<int>(::syscall(SYS_pidfd_open, b.pid, 0)));
    if (pidfd.fd < 0)
      throw_driver_error(k_invalid, call,
                         fmt::format("the exporting process {} (node {}) is gone: {}", b.pid, b.node,
                                     std::strerror(errno)));
    taken.fd = static_cast<int>(::syscall(SYS_pidfd_getfd, pidfd.fd, b.fd, 0));
    if (taken.fd < 0) {
      const int err = errno;
      if (err == EPERM)
        throw_driver_error(k_not_permitted, call,
                           fmt::format("pidfd_getfd of process {} was not permitted: the host backend's fabric "
                                       "emulation needs ptrace access to the exporter (same user; "
                                       "kernel.yama.ptrace_scope 0, or run the ranks under one parent)",
                                       b.pid));
      if (err == EBADF)
        throw_driver_error(k_invalid, call,
                           fmt::format("descriptor {} of process {} is not open: the exporter released the memory "
                                       "the handle names",
                                       b.fd, b.pid));
      throw_driver_error(k_invalid, call,
                         fmt::format("pidfd_getfd of descriptor {} of process {} failed: {}", b.fd, b.pid,
                                     std::strerror(err)));
    }
  }
  struct stat st {};
  if (::fstat(taken.fd, &st) != 0 || static_cast<std::uint64_t>(st.st_dev) != b.st_dev ||
      static_cast<std::uint64_t>(st.st_ino) != b.st_ino)
    throw_driver_error(k_invalid, call,
                       fmt::format("descriptor {} of process {} is no longer the memory the handle names (the "
                                   "exporter released it)",
                                   b.fd, b.pid));
  if (b.bytes != bytes)
    misuse(call, fmt::format("the fabric handle names {} bytes; its exporter announced {}", b.bytes, bytes));
  return import_checked(taken.fd, bytes);
}

FabricProbe HostDriver::probe_fabric(int device) {
  check_device(device, "probe_fabric");
  FabricProbe p;
  switch (options_.fabric) {
    case HostDriverOptions::Fabric::on:
    case HostDriverOptions::Fabric::import_refused:
      p.cause = FabricProbe::Cause::supported;
      p.call = "cuMemExportToShareableHandle";
      p.detail = fmt::format("the host backend's emulated fabric on node {}", options_.node);
      break;
    case HostDriverOptions::Fabric::off:
      p.cause = FabricProbe::Cause::device_without_fabric;
      p.call = "cuDeviceGetAttribute";
      p.detail = "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED is 0 (TORPOR_HOST_FABRIC=off)";
      break;
    case HostDriverOptions::Fabric::no_channel:
      p.cause = FabricProbe::Cause::no_imex_channel;
      p.code = k_not_permitted;
      p.call = "cuMemExportToShareableHandle";
      p.detail = fmt::format("CUDA_ERROR_NOT_PERMITTED ({}): {}", k_not_permitted, no_channel_words);
      break;
  }
  return p;
}

std::string HostDriver::node_name() { return fmt::format("{}/host-node-{}", Driver::node_name(), options_.node); }

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

std::optional<bool> HostDriver::gpu_direct_rdma_capable(device_ptr va) const {
  std::lock_guard lock(mu_);
  auto it = mappings_.upper_bound(va);
  if (it == mappings_.begin()) return std::nullopt;
  --it;
  if (!it->second.memory || va >= it->first + it->second.bytes) return std::nullopt;
  return it->second.memory->gpu_direct_rdma;
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

void HostDriver::require_stream(Stream s, const char* call) const {
  if (!streams_.count(s.value)) misuse(call, fmt::format("unknown stream {}", s.value));
}

Stream HostDriver::stream_create(int device) {
  check_device(device, "cuStreamCreate");
  std::uint64_t id;
  {
    std::lock_guard lock(mu_);
    id = next_id_++;
  }
  if (async_) async_->add_stream(id, device);
  std::lock_guard lock(mu_);
  streams_.insert(id);
  return Stream{id, device};
}

void HostDriver::stream_destroy(Stream s) {
  {
    std::lock_guard lock(mu_);
    require_stream(s, "cuStreamDestroy");
    streams_.erase(s.value);
  }
  if (async_) async_->remove_stream(s.value);  // its queued work completes first
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

std::uint64_t HostDriver::register_in_flight(std::vector<InFlight> ranges) {
  std::uint64_t op = next_op_++;
  in_flight_[op] = std::move(ranges);
  return op;
}

void HostDriver::unregister_in_flight(std::uint64_t op) noexcept {
  std::lock_guard lock(mu_);
  in_flight_.erase(op);
}

namespace {
std::size_t fingerprint_of(std::uintptr_t lo, std::uintptr_t hi) {
  return std::hash<std::string_view>{}(std::string_view(reinterpret_cast<const char*>(lo), hi - lo));
}
}  // namespace

// Run by an operation's worker just before the operation: an operation queued earlier on another
// stream that still touches the same bytes (one of the two writing) was not ordered before this
// one by an event or a synchronisation (it would have completed), so on a GPU the two race: a
// host span reused for a new copy while a queued copy still targets it, say. Counted and logged,
// not thrown: the worker cannot throw into the thread that queued the work.
void HostDriver::flag_races(std::uint64_t op) noexcept {
  std::lock_guard lock(mu_);
  auto mine = in_flight_.find(op);
  if (mine == in_flight_.end()) return;
  for (auto it = in_flight_.begin(); it != mine; ++it)
    for (const InFlight& a : it->second)
      for (const InFlight& b : mine->second) {
        if (a.stream == b.stream || !(a.writes || b.writes) || a.lo >= b.hi || b.lo >= a.hi) continue;
        ++async_races_;
        log::error("HostDriver: a {} on stream {} touches [{:#x}, {:#x}) while a {} queued earlier on stream {} "
                   "([{:#x}, {:#x})) is not done and nothing orders the two; record an event after the first and "
                   "wait for it on the second stream",
                   b.call, b.stream, b.lo, b.hi, a.call, a.stream, a.lo, a.hi);
      }
  // A watched host span whose bytes changed since the copy was queued: nothing queued could
  // write it (see copy_async), so the host did, under a copy that still targets it. On a GPU the
  // copy would take the new bytes or overwrite them, depending on timing.
  for (const InFlight& r : mine->second) {
    if (!r.watched || fingerprint_of(r.lo, r.hi) == r.fingerprint) continue;
    ++async_host_writes_;
    log::error("HostDriver: the host changed [{:#x}, {:#x}) after a {} on stream {} that {} it was queued and "
               "before it ran; wait for the copy (an event or the stream) before reusing the span",
               r.lo, r.hi, r.call, r.stream, r.writes ? "writes" : "reads");
  }
}

void HostDriver::refuse_if_in_flight(std::uintptr_t lo, std::uintptr_t hi, const char* call) {
  for (auto& [op, ranges] : in_flight_) {
    for (const InFlight& r : ranges) {
      if (r.lo >= hi || lo >= r.hi) continue;
      ++async_conflicts_;
      misuse(call, fmt::format("[{:#x}, {:#x}) is still touched by a queued {} on stream {} ([{:#x}, {:#x})); "
                               "synchronize the stream or an event recorded after it first",
                               lo, hi, r.call, r.stream, r.lo, r.hi));
    }
  }
}

std::uint64_t HostDriver::submit(Stream s, std::function<void()> work, std::vector<InFlight> ranges) {
  std::uint64_t op;
  {
    std::lock_guard lock(mu_);
    op = register_in_flight(std::move(ranges));
  }
  try {
    return async_->submit(s.value, [this, op, work = std::move(work)] {
      flag_races(op);
      work();
      unregister_in_flight(op);
    });
  } catch (...) {
    unregister_in_flight(op);
    throw;
  }
}

void HostDriver::copy_async(void* dst, const void* src, std::size_t bytes, Stream s) {
  const char* call = "cuMemcpyAsync";
  std::shared_lock touching(mapping_mu_);
  bool src_pageable = false, dst_pageable = false;
  std::vector<InFlight> touched;
  {
    std::lock_guard lock(mu_);
    require_stream(s, call);
    check_accessible(src, bytes, call);
    check_accessible(dst, bytes, call);
    if (in_reservation(src) != in_reservation(dst)) {
      check_page_locked(src, bytes, call);
      check_page_locked(dst, bytes, call);
    }
    if (!async_) {
      // Synchronous mode: done below, outside the lock.
    } else {
      src_pageable = !in_reservation(src) && !in_pinned_block(src);
      dst_pageable = !in_reservation(dst) && !in_pinned_block(dst);
      auto add = [&](const void* p, bool pageable, bool writes) {
        auto lo = reinterpret_cast<std::uintptr_t>(p);
        if (!pageable && bytes > 0) touched.push_back(InFlight{lo, lo + bytes, s.value, call, writes});
      };
      add(src, src_pageable, false);
      add(dst, dst_pageable, true);
      // Fingerprint the page-locked host side, unless a queued operation writes it (then it may
      // change before this copy runs, legitimately on the same stream; flag_races covers others).
      for (InFlight& t : touched) {
        if (!in_pinned_block(reinterpret_cast<const void*>(t.lo))) continue;
        bool written_by_queued = false;
        for (const auto& [op, ranges] : in_flight_)
          for (const InFlight& r : ranges)
            if (r.writes && r.lo < t.hi && t.lo < r.hi) written_by_queued = true;
        if (written_by_queued) continue;
        t.watched = true;
        t.fingerprint = fingerprint_of(t.lo, t.hi);
      }
    }
  }
  if (!async_) {
    if (bytes > 0) std::memmove(dst, src, bytes);
    return;
  }
  // As cuMemcpyAsync: a pageable source is taken when the copy is queued; a pageable
  // destination holds the bytes when the call returns.
  std::shared_ptr<std::vector<std::byte>> staged;
  if (src_pageable && bytes > 0) {
    const auto* b = static_cast<const std::byte*>(src);
    staged = std::make_shared<std::vector<std::byte>>(b, b + bytes);
    src = staged->data();
  }
  std::uint64_t ticket = submit(
      s,
      [dst, src, bytes, staged] {
        if (bytes > 0) std::memmove(dst, src, bytes);
      },
      std::move(touched));
  if (dst_pageable) async_->wait(s.value, ticket);
}

void HostDriver::fill_async(device_ptr dst, std::uint8_t value, std::size_t bytes, Stream s) {
  const char* call = "cuMemsetD8Async";
  std::shared_lock touching(mapping_mu_);
  {
    std::lock_guard lock(mu_);
    require_stream(s, call);
    check_accessible(reinterpret_cast<void*>(dst), bytes, call);
  }
  auto* p = reinterpret_cast<void*>(dst);
  if (!async_) {
    if (bytes > 0) std::memset(p, value, bytes);
    return;
  }
  std::vector<InFlight> touched;
  if (bytes > 0) touched.push_back(InFlight{dst, dst + bytes, s.value, call, true});
  submit(
      s,
      [p, value, bytes] {
        if (bytes > 0) std::memset(p, value, bytes);
      },
      std::move(touched));
}

void HostDriver::launch(Stream s, std::function<void()> kernel) {
  {
    std::lock_guard lock(mu_);
    require_stream(s, "cuLaunchKernel");
  }
  if (!async_) {
    kernel();
    return;
  }
  submit(s, std::move(kernel), {});
}

void HostDriver::delay_stream(Stream s, std::chrono::microseconds pause) {
  {
    std::lock_guard lock(mu_);
    require_stream(s, "delay_stream");
  }
  if (pause < std::chrono::microseconds{0} || pause > std::chrono::seconds{10})
    throw invalid_argument(fmt::format("HostDriver::delay_stream: {} us is outside [0, 10000000] us", pause.count()));
  if (async_)
    async_->submit(
        s.value, [] {}, pause);
}

void HostDriver::stream_synchronize(Stream s) {
  {
    std::lock_guard lock(mu_);
    require_stream(s, "cuStreamSynchronize");
  }
  if (async_) async_->synchronize_stream(s.value);
}

void HostDriver::device_synchronize(int device) {
  check_device(device, "cuCtxSynchronize");
  if (async_) async_->synchronize_device(device);
}

Event HostDriver::event_create(int device) {
  check_device(device, "cuEventCreate");
  std::uint64_t id;
  {
    std::lock_guard lock(mu_);
    id = next_id_++;
    events_.insert(id);
  }
  if (async_) async_->add_event(id);
  return Event{id, device};
}

void HostDriver::event_destroy(Event e) {
  {
    std::lock_guard lock(mu_);
    if (!events_.erase(e.value)) misuse("cuEventDestroy", fmt::format("unknown event {}", e.value));
  }
  if (async_) async_->remove_event(e.value);
}

void HostDriver::event_record(Event e, Stream s) {
  {
    std::lock_guard lock(mu_);
    require_stream(s, "cuEventRecord");
    if (!events_.count(e.value)) misuse("cuEventRecord", fmt::format("unknown event {}", e.value));
  }
  if (async_) async_->record(e.value, s.value);
}

void HostDriver::stream_wait_event(Stream s, Event e) {
  {
    std::lock_guard lock(mu_);
    require_stream(s, "cuStreamWaitEvent");
    if (!events_.count(e.value)) misuse("cuStreamWaitEvent", fmt::format("unknown event {}", e.value));
  }
  if (async_) async_->stream_wait_event(s.value, e.value);
}

void HostDriver::event_synchronize(Event e) {
  {
    std::lock_guard lock(mu_);
    if (!events_.count(e.value)) misuse("cuEventSynchronize", fmt::format("unknown event {}", e.value));
  }
  if (async_) async_->synchronize_event(e.value);
}

void HostDriver::hash(std::span<const HashRange> ranges, Hash128* out, Stream s) {
  const char* call = "hash";
  std::shared_lock touching(mapping_mu_);
  std::vector<InFlight> touched;
  {
    std::lock_guard lock(mu_);
    require_stream(s, call);
    for (const HashRange& r : ranges) {
      check_accessible(r.ptr, r.bytes, call);
      auto lo = reinterpret_cast<std::uintptr_t>(r.ptr);
      if (async_ && r.bytes > 0) touched.push_back(InFlight{lo, lo + r.bytes, s.value, call});
    }
  }
  if (!async_) {
    for (std::size_t i = 0; i < ranges.size(); ++i) out[i] = content_hash::compute(ranges[i].ptr, ranges[i].bytes);
    return;
  }
  // Ordered after the stream's earlier work, like the device's hash kernel; blocks for the results.
  std::vector<HashRange> copy(ranges.begin(), ranges.end());
  auto results = std::make_shared<std::vector<Hash128>>(copy.size());
  std::uint64_t ticket = submit(
      s,
      [copy, results] {
        for (std::size_t i = 0; i < copy.size(); ++i) (*results)[i] = content_hash::compute(copy[i].ptr, copy[i].bytes);
      },
      std::move(touched));
  async_->wait(s.value, ticket);
  std::copy(results->begin(), results->end(), out);
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

std::vector<std::pair<std::byte*, std::size_t>> HostDriver::host_blocks() const {
  std::lock_guard lock(mu_);
  std::vector<std::pair<std::byte*, std::size_t>> out;
  out.reserve(host_blocks_.size() + registered_.size());
  for (auto& [p, bytes] : host_blocks_) out.emplace_back(static_cast<std::byte*>(p), bytes);
  for (auto& [p, bytes] : registered_) out.emplace_back(reinterpret_cast<std::byte*>(p), bytes);
  return out;
}

std::size_t HostDriver::live_physical_bytes(int device) const {
  check_device(device, "live_physical_bytes");
  return counters_->live[static_cast<std::size_t>(device)].load();
}

}  // namespace torpor
