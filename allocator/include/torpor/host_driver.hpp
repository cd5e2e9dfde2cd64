// HostDriver: the CUDA VMM API emulated on the CPU with real bytes. CI's backend and the
// embedded default when no GPU is usable.
//
//   reserve      mmap(PROT_NONE, MAP_NORESERVE)
//   create       memfd_create + ftruncate (one memfd per physical handle)
//   map          mmap(MAP_SHARED | MAP_FIXED) of the memfd, PROT_NONE until set_access
//   set_access   mprotect(PROT_READ | PROT_WRITE)
//   unmap        the span goes back to PROT_NONE anonymous memory: the hole stays reserved,
//                and touching it faults, as touching a sleeping address does on a GPU
//   export       a dup of the memfd (passable to another process with SCM_RIGHTS); its size is
//                sealed at creation, and import takes nothing else
//   RDMA flag    HostDriverOptions::gpu_direct_rdma_vmm is what the emulated devices report for
//                CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED; exportable memory
//                created on such a device carries the GPUDirect RDMA mark, which
//                gpu_direct_rdma_capable(va) reads back as cuPointerGetAttribute does on a GPU (no
//                NIC is emulated: the mark is what a transport's registration would require)
//   fabric       64 bytes naming (exporting pid, its memfd's number, the memfd's inode, size,
//                emulated node); the importer takes the descriptor with pidfd_open + pidfd_getfd
//                (same user, ptrace permission) and checks the inode, so no descriptor travels
//                and any byte transport (TCP) carries it. HostDriverOptions::fabric injects the
//                IMEX failure modes with the error codes a real driver gives
//   multicast    an object with membership and bindings; a multicast store is fanned out in
//                software to every bound buffer (multicast_store)
//   host_register  bookkeeping of page-locked ranges (no page is really locked), with an optional
//                limit and delay, and overlap and unknown-pointer misuse detection
//
// It keeps exact accounting (live handles, live physical bytes per device, mapped bytes, host
// bytes) and raises driver_error on misuse: unmap of a span that is not exactly one mapping,
// release of an unknown handle, mapping over a mapping, copies touching unmapped memory,
// binding multicast memory before every device was added, and so on. Physical memory lives
// while a handle or a mapping refers to it, as on the GPU.
//
// Device work is synchronous by default: a copy is done when copy_async returns. In the
// asynchronous mode (HostDriverOptions::async) it behaves like a GPU's streams instead: copies,
// fills, hashes and host kernels (launch) are queued per stream and done later, in stream order,
// by one worker thread per stream, each after a random delay drawn from a seed; events and
// stream, event and device synchronisation really wait. As with CUDA, a copy from pageable host
// memory (neither host_alloc'ed nor device memory) takes its source bytes when it is queued and a
// copy into pageable memory returns once done; hash blocks until its results are out. Unmapping
// or host_free'ing memory that a queued operation still touches is refused with driver_error
// and counted (counters().async_conflicts), instead of faulting at random: the ordering bug a
// sleep engine can have (unmapping before its copies completed) fails at once on a CPU machine.
// In the synchronous mode a copy (fill, hash) holds the mapping lock shared from its check to its
// last byte and unmap holds it exclusively, so a range checked as mapped stays mapped while it is
// touched, whichever pool or thread unmaps.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "torpor/driver.hpp"

namespace torpor {

class HostAsyncEngine;  // the asynchronous mode's streams and events (src/driver/host/async_engine.hpp)

struct HostDriverOptions {
  int devices = 8;
  std::size_t device_bytes = std::size_t{16} << 30;  // emulated memory per device
  std::size_t granularity = std::size_t{2} << 20;
  bool multicast_attribute = true;  // what the emulated devices report
  bool peer_access = true;          // every device can access every other
  bool gpu_direct_rdma_vmm = true;  // exportable memory is created GPUDirect RDMA capable (see above)
  // The asynchronous mode (see above). Each queued operation waits 0 (half of them) or up to
  // async_max_delay before it runs, drawn per stream from async_seed: the same seed and the same
  // calls give the same delays. async_max_delay is at most one second.
  bool async = false;
  std::uint64_t async_seed = 1;
  std::chrono::microseconds async_max_delay{100};
  // host_register: page-locking more than this many bytes in all is refused with
  // CUDA_ERROR_OUT_OF_MEMORY, as a driver refuses past its locked-memory limit (0 = no limit);
  // every registration takes at least host_register_delay, as pinning real memory takes time.
  std::size_t host_register_limit = 0;
  std::chrono::microseconds host_register_delay{0};
  // A copy between device memory and host memory must use page-locked host memory (host_alloc'ed
  // or registered), else misuse. Pageable copies are legal in CUDA, so this is off by default; a
  // test turns it on to prove that nothing is copied into host memory whose pinning is not done.
  bool require_page_locked_copies = false;
  // The emulated devices' PCI bus ids, in order ("" or missing: none), and whether host_register
  // counts against RLIMIT_MEMLOCK (the capability): a fake topology for the host store's NUMA
  // placement and budget (TORPOR_HOST_PCI_BUS_IDS with TORPOR_SYSFS_ROOT).
  std::vector<std::string> pci_bus_ids;
  bool host_register_charged_to_memlock = false;
  // The emulated node this driver's process runs on (TORPOR_HOST_NODE): ranks of different nodes
  // cannot pass POSIX descriptors (node_name() differs) and must use fabric handles.
  int node = 0;
  // What the emulated fabric (IMEX) does (TORPOR_HOST_FABRIC): on (exports and imports work), off
  // (the devices report no fabric support), no_channel (no IMEX channel: the probe's export and
  // every fabric export and import fail with CUDA_ERROR_NOT_PERMITTED), import_refused (the probe
  // and exports work, imports fail with CUDA_ERROR_NOT_PERMITTED, as on a node whose channel
  // was not granted to the importer).
  enum class Fabric { on, off, no_channel, import_refused };
  Fabric fabric = Fabric::on;
};

// Exact accounting, for tests and `torpor probe`.
struct HostDriverCounters {
  std::size_t live_handles = 0;         // created or imported handles not yet released
  std::size_t live_physical_bytes = 0;  // memory created here and still alive (handle or mapping)
  std::size_t mapped_bytes = 0;         // bytes currently mapped, any handle
  std::size_t mappings = 0;
  std::size_t reservations = 0;
  std::size_t reserved_bytes = 0;
  std::size_t host_bytes = 0;        // host_alloc'ed and not freed
  std::size_t registered_bytes = 0;  // host_register'ed and not unregistered
  std::size_t registrations = 0;
  std::size_t streams = 0;
  std::size_t events = 0;
  std::size_t multicast_objects = 0;
  std::size_t async_pending = 0;      // queued operations not completed yet (asynchronous mode)
  std::size_t async_conflicts = 0;    // unmaps and host_frees refused: a queued operation touched the memory
  std::size_t async_races = 0;        // operations that ran while an earlier one queued on another stream and
                                      // not ordered before them still touched the same bytes (one of them writing)
  std::size_t async_host_writes = 0;  // queued copies whose page-locked host span the host changed between
                                      // queueing and running (a span reused while a copy still targets it)
};

// What multicast_at() reports about the multicast object mapped at an address.
struct HostMulticastInfo {
  std::size_t bytes = 0;
  std::vector<int> devices;                // named at creation
  std::vector<int> added;                  // added so far (multicast_add_device)
  std::map<int, std::size_t> bound_bytes;  // device -> bytes of its memory bound
  std::size_t handles = 0;                 // live handles to the object (creator's and imports)
};

class HostDriver final : public Driver {
 public:
  explicit HostDriver(const HostDriverOptions& options = {});
  ~HostDriver() override;
  HostDriver(const HostDriver&) = delete;
  HostDriver& operator=(const HostDriver&) = delete;

  std::string_view backend_name() const noexcept override { return "host"; }
  // CPU reference kernels over host memory; multicast emulated (multicast_store); exact
  // accounting (live_physical_bytes). No current device to make (make_current is not supported).
  DriverCapabilities capabilities() const noexcept override {
    return {.compute = DriverCapabilities::Compute::cpu_reference,
            .host_memory = true,
            .multicast = DriverCapabilities::Multicast::emulated,
            .make_current = false,
            .physical_accounting = true,
            .host_register_charged_to_memlock = options_.host_register_charged_to_memlock,
            .posix_fd_handles = true,
            .fabric_handles = true};
  }

  int device_count() override;
  DeviceProperties device_properties(int device) override;
  bool can_access_peer(int device, int peer) override;
  MemoryInfo memory_info(int device) override;
  bool multicast_entry_points() override { return true; }

  device_ptr reserve(std::size_t bytes, std::size_t alignment) override;
  void free_reservation(device_ptr va, std::size_t bytes) override;

  PhysicalHandle create(int device, std::size_t bytes, bool exportable) override;
  void release(PhysicalHandle handle) override;
  void map(device_ptr va, std::size_t bytes, PhysicalHandle handle, std::size_t handle_offset) override;
  void unmap(device_ptr va, std::size_t bytes) override;
  void set_access(device_ptr va, std::size_t bytes, std::span<const int> devices) override;

  int export_fd(PhysicalHandle handle) override;
  // Only physical memory a HostDriver created: a memfd named torpor-physical whose size is
  // sealed (an exporter can never shrink it under an importer's mapping); anything else is a
  // driver_error (invalid_value) naming what the descriptor is.
  PhysicalHandle import_fd(int fd) override;
  PhysicalHandle import_fd_of_size(int fd, std::size_t bytes) override;
  FabricHandle export_fabric(PhysicalHandle handle) override;
  // Takes the exporter's descriptor with pidfd_getfd; an exporter that is gone, a descriptor that
  // is no longer the memory named (its inode differs), or a refused pidfd_getfd is a driver_error
  // saying which.
  PhysicalHandle import_fabric(const FabricHandle& handle, std::size_t bytes) override;
  FabricProbe probe_fabric(int device) override;
  // The machine's node name with "/host-node-N" (options().node) appended.
  std::string node_name() override;

  std::size_t multicast_granularity(std::span<const int> devices, std::size_t bytes) override;
  MulticastHandle multicast_create(std::span<const int> devices, std::size_t bytes) override;
  void multicast_add_device(MulticastHandle mc, int device) override;
  void multicast_bind(MulticastHandle mc, std::size_t mc_offset, PhysicalHandle memory, std::size_t memory_offset,
                      std::size_t bytes) override;
  void multicast_unbind(MulticastHandle mc, int device, std::size_t mc_offset, std::size_t bytes) override;
  void multicast_release(MulticastHandle mc) override;
  PhysicalHandle as_physical(MulticastHandle mc) override;
  // Within this driver instance only (ranks that are threads): the fd names the object; an
  // import from another process is refused (not_supported), and
  // multicast_shares_across_processes() says so up front.
  int multicast_export_fd(MulticastHandle mc) override;
  MulticastHandle multicast_import_fd(int fd) override;
  bool multicast_shares_across_processes() override { return false; }
  // The software fan-out of a multicast store: `bytes` from `src` land at `mc_va + i` in every
  // buffer bound to the multicast object mapped at mc_va (what multimem.st does on a GPU).
  void multicast_store(device_ptr mc_va, const void* src, std::size_t bytes) override;
  std::size_t live_physical_bytes(int device) const override;

  void* host_alloc(std::size_t bytes) override;
  void host_free(void* p) override;
  void host_register(void* p, std::size_t bytes, int device) override;
  void host_unregister(void* p, int device) override;

  Stream stream_create(int device) override;
  void stream_destroy(Stream s) override;
  void copy_async(void* dst, const void* src, std::size_t bytes, Stream s) override;
  void fill_async(device_ptr dst, std::uint8_t value, std::size_t bytes, Stream s) override;
  void stream_synchronize(Stream s) override;
  void device_synchronize(int device) override;
  Event event_create(int device) override;
  void event_destroy(Event e) override;
  void event_record(Event e, Stream s) override;
  void stream_wait_event(Stream s, Event e) override;
  void event_synchronize(Event e) override;
  void hash(std::span<const HashRange> ranges, Hash128* out, Stream s) override;

  // --- emulation extras (not part of the seam) ---------------------------------------------
  HostDriverCounters counters() const;
  // Membership and bindings of the multicast object mapped at va (any address inside the
  // mapping); nothing when no multicast object is mapped there.
  std::optional<HostMulticastInfo> multicast_at(device_ptr va) const;
  const HostDriverOptions& options() const noexcept { return options_; }
  // Whether the memory mapped at va (any address inside a mapping) was created GPUDirect RDMA
  // capable, as cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE) answers on
  // a GPU; nothing when no physical memory is mapped there (memory imported from another process
  // reads false: the mark does not travel).
  std::optional<bool> gpu_direct_rdma_capable(device_ptr va) const;
  bool asynchronous() const noexcept { return async_ != nullptr; }
  // The live page-locked host memory (address, bytes): host_alloc blocks and host_register'ed
  // ranges, for tests that inspect or damage host copies.
  std::vector<std::pair<std::byte*, std::size_t>> host_blocks() const;
  // A host "kernel": `kernel` runs on the stream's worker after the work queued before it
  // (asynchronous mode), or now (synchronous mode). It may touch any memory; it must not throw.
  void launch(Stream s, std::function<void()> kernel);
  // Asynchronous mode: the stream's next operation starts no earlier than `pause` after the work
  // before it, so a test can make device work late on purpose. Does nothing in synchronous mode.
  void delay_stream(Stream s, std::chrono::microseconds pause);

 private:
  // Completed in src/driver/host/state.hpp, the internal header of the files of src/driver/host/
  // (one concern each: devices, VMM, sharing, fabric, multicast, host memory, streams, in-flight
  // ranges, hash).
  struct Memory;
  struct Multicast;
  struct HandleEntry {
    std::shared_ptr<Memory> memory;        // set for physical memory
    std::shared_ptr<Multicast> multicast;  // set for a multicast object
  };
  struct Mapping {
    std::size_t bytes = 0;
    std::shared_ptr<Memory> memory;
    std::shared_ptr<Multicast> multicast;
    std::size_t offset = 0;
    bool accessible = false;
  };
  struct Counters;

  void check_device(int device, const char* call) const;
  void check_aligned(std::size_t v, const char* what, const char* call) const;
  // Throws unless [p, p + n) is either entirely outside every reservation or entirely
  // covered by accessible mappings (and does not wrap around the address space). Caller holds
  // mu_, and mapping_mu_ shared until it is done touching the range.
  void check_accessible(const void* p, std::size_t n, const char* call) const;
  PhysicalHandle import_checked(int fd, std::optional<std::size_t> announced);
  // Throws unless host memory [p, p + n) lies in one host_alloc block or one registration, when
  // require_page_locked_copies asks for it. Caller holds mu_.
  void check_page_locked(const void* p, std::size_t n, const char* call) const;
  const HandleEntry& entry(PhysicalHandle h, const char* call) const;
  std::shared_ptr<Multicast> multicast_of(MulticastHandle mc, const char* call) const;
  void require_stream(Stream s, const char* call) const;
  // Asynchronous mode. The memory a queued operation touches is registered until it completed;
  // unmap and host_free of a range that overlaps one are refused (misuse, counted).
  struct InFlight {
    std::uintptr_t lo = 0, hi = 0;
    std::uint64_t stream = 0;
    const char* call = "";
    bool writes = false;
    // A page-locked host span of a copy, fingerprinted when the copy was queued (watched), when
    // no queued operation that writes it could change it before the copy runs legitimately.
    bool watched = false;
    std::size_t fingerprint = 0;
  };
  bool in_pinned_block(const void* p) const;                       // caller holds mu_
  bool in_reservation(const void* p) const;                        // caller holds mu_
  std::uint64_t register_in_flight(std::vector<InFlight> ranges);  // caller holds mu_
  void unregister_in_flight(std::uint64_t op) noexcept;
  void flag_races(std::uint64_t op) noexcept;
  void refuse_if_in_flight(std::uintptr_t lo, std::uintptr_t hi, const char* call);  // caller holds mu_
  std::uint64_t submit(Stream s, std::function<void()> work, std::vector<InFlight> ranges);

  HostDriverOptions options_;
  // Taken before mu_: shared by whatever touches mapped bytes outside mu_, exclusive by unmap.
  mutable std::shared_mutex mapping_mu_;
  mutable std::mutex mu_;
  std::shared_ptr<Counters> counters_;
  std::uint64_t next_id_ = 1;
  std::map<device_ptr, std::size_t> reservations_;  // base -> bytes
  std::map<device_ptr, Mapping> mappings_;          // va -> mapping
  std::unordered_map<std::uint64_t, HandleEntry> handles_;
  std::unordered_map<void*, std::size_t> host_blocks_;
  std::map<std::uintptr_t, std::size_t> registered_;  // host_register'ed: start -> bytes
  std::set<std::uint64_t> streams_;
  std::set<std::uint64_t> events_;
  std::map<std::uint64_t, std::vector<InFlight>> in_flight_;  // asynchronous mode: op -> ranges
  std::uint64_t next_op_ = 1;
  std::atomic<std::size_t> async_conflicts_{0};
  std::atomic<std::size_t> async_races_{0};
  std::atomic<std::size_t> async_host_writes_{0};
  std::unique_ptr<HostAsyncEngine> async_;  // set in the asynchronous mode
};

}  // namespace torpor
