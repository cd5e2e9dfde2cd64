// The driver seam: every call torpor makes to the CUDA driver goes through `Driver`.
//
// Layers above (pool, sleep, symmetric) speak only this interface; they never include
// cuda.h and nothing here knows about tags or memory classes. Implementations:
//   - CudaDriver (cuda_driver.hpp): libcuda resolved at run time, so binaries start on a
//     machine without a GPU.
//   - HostDriver (host_driver.hpp): the VMM API emulated on the CPU with real bytes and
//     exact accounting; CI's backend.
//   - FaultInjectingDriver (fault_injecting_driver.hpp): fails the Nth call of a kind.
//
// The layers above choose what to do by the driver's capabilities() (which kernels run on its
// memory, how multicast stores travel, ...), never by backend_name(), which is for reports and
// logs, and never by casting to a concrete driver. A call that only some drivers support
// (make_current, multicast_store, live_physical_bytes) is a seam method whose default throws
// driver_error with CUDA_ERROR_NOT_SUPPORTED naming the backend; its capability says up front
// whether it works.
//
// Semantics follow the CUDA VMM API: a reservation is address space only; a physical handle
// is memory on one device; map places (part of) a handle at an address inside a reservation;
// set_access must be called before the mapping is touched; releasing a handle that is still
// mapped is allowed and the memory lives until its last mapping is unmapped. Every method
// reports failure by throwing driver_error (code = CUresult value).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "torpor/hash128.hpp"
#include "torpor/stream.hpp"

namespace torpor {

// A virtual address in the unified address space (device memory on the GPU; ordinary CPU
// addresses under HostDriver).
using device_ptr = std::uintptr_t;

// Opaque handles. Zero is never a valid value.
struct PhysicalHandle {
  std::uint64_t value = 0;
  explicit operator bool() const noexcept { return value != 0; }
  friend bool operator==(PhysicalHandle, PhysicalHandle) = default;
};

struct MulticastHandle {
  std::uint64_t value = 0;
  explicit operator bool() const noexcept { return value != 0; }
  friend bool operator==(MulticastHandle, MulticastHandle) = default;
};

struct Event {
  std::uint64_t value = 0;
  int device = 0;
  explicit operator bool() const noexcept { return value != 0; }
};

struct HashRange {
  const void* ptr = nullptr;
  std::size_t bytes = 0;
};

struct DeviceProperties {
  int ordinal = 0;
  std::string name;
  std::size_t total_bytes = 0;
  bool vmm_supported = false;
  bool posix_fd_handles_supported = false;
  bool fabric_handles_supported = false;  // CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED (multi-node NVLink)
  // CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED: exportable memory created on this
  // device is GPUDirect RDMA capable (allocFlags.gpuDirectRDMACapable), so a NIC can register it
  // (ibv_reg_mr, a KV transport's registration) and read or write it without a host bounce.
  bool gpu_direct_rdma_vmm = false;
  std::size_t granularity = 0;       // minimum granularity for create/map
  bool multicast_attribute = false;  // CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED
  std::string pci_bus_id;            // "0000:3b:00.0" (cuDeviceGetPCIBusId); "" when unknown
};

// The kinds of shareable handle the seam moves between processes. A POSIX file descriptor is
// node-local (it travels only over a Unix socket, SCM_RIGHTS); a fabric handle is 64 opaque bytes
// (CUmemFabricHandle) that travel over any transport and are imported on another node of the
// same NVLink domain through the IMEX service.
enum class HandleKind : std::uint8_t { posix_fd = 1, fabric = 2 };
std::string_view to_string(HandleKind k) noexcept;

inline constexpr std::size_t fabric_handle_bytes = 64;  // sizeof(CUmemFabricHandle)
struct FabricHandle {
  std::array<std::byte, fabric_handle_bytes> bytes{};
  friend bool operator==(const FabricHandle&, const FabricHandle&) = default;
};

// What a real fabric export on one device answered (probe_fabric). The device attribute alone is
// not trusted (vLLM found it saying yes while the export failed: vllm-project/vllm#35489, #43134),
// so the probe creates a small allocation with the fabric type requested and exports it.
struct FabricProbe {
  enum class Cause {
    supported,               // the export worked: this device can share memory over the fabric
    backend_without_fabric,  // the driver (backend) has no fabric handles at all
    driver_too_old,          // the driver library lacks the fabric handle type (CUDA < 12.3)
    device_without_fabric,   // the device says it has no fabric handle support (no multi-node NVLink)
    no_imex_channel,         // no /dev/nvidia-caps-imex-channels/channelN visible to this process
    not_permitted,           // the export (or import) was refused: IMEX daemon not running or channel not granted
    failed,                  // any other failure; `detail` has the driver's words
  };
  Cause cause = Cause::backend_without_fabric;
  int code = 0;        // the driver's result (CUresult value); 0 when the call was not reached or worked
  std::string call;    // the call that answered ("cuMemCreate", "cuMemExportToShareableHandle", ...)
  std::string detail;  // the driver's exact error text, or what was looked at
  bool supported() const noexcept { return cause == Cause::supported; }
  // One sentence: the cause in words, the exact result, and what to do about it.
  std::string describe() const;
};
std::string_view to_string(FabricProbe::Cause c) noexcept;

struct MemoryInfo {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
};

// What CUDA's own graph allocator holds on a device (memory nodes of every graph of the process):
// memory torpor does not own, which a sleep cannot give back.
struct GraphMemory {
  std::uint64_t used_bytes = 0;
  std::uint64_t reserved_bytes = 0;
};

// What a driver can do, as far as the layers above need to know. A decorator reports its inner
// driver's.
struct DriverCapabilities {
  // Where the math on pool memory runs: the device's kernels (CUDA), or the CPU reference
  // kernels on the calling thread (kernels/reference), which read pool memory at its addresses.
  enum class Compute { device_kernels, cpu_reference };
  Compute compute = Compute::cpu_reference;
  // Pool memory is the machine's host memory (HostDriver's emulated devices): the CPU reads and
  // writes it at its device address, and it takes from the same RAM as everything else.
  bool host_memory = false;
  // How a store through a mapped multicast address reaches every bound buffer: the device's
  // multimem instructions (hardware; the multicast entry points resolved), the driver's software
  // fan-out multicast_store() within this one driver instance (emulated), or not at all. Whether
  // multicast is used is still the group's collective decision (ranks/multicast.hpp).
  enum class Multicast { none, hardware, emulated };
  Multicast multicast = Multicast::none;
  // make_current() works: the driver can make a device current on the calling thread for the
  // CUDA runtime and libraries built on it (NCCL).
  bool make_current = false;
  // live_physical_bytes() works: the driver keeps an exact account of live physical memory.
  bool physical_accounting = false;
  // host_register() is charged to RLIMIT_MEMLOCK, so the host store's page-locked budget
  // counts that limit (host_topology.hpp).
  bool host_register_charged_to_memlock = false;
  // The shareable handle kinds the driver can export and import (export_fd / import_fd, and
  // export_fabric / import_fabric). Whether a given device can use fabric handles is a real
  // export's answer (probe_fabric), not this flag.
  bool posix_fd_handles = false;
  bool fabric_handles = false;
};

std::string_view to_string(DriverCapabilities::Compute c) noexcept;
std::string_view to_string(DriverCapabilities::Multicast m) noexcept;

// Kinds of driver call, used by fault injection and by the probe's reports.
enum class DriverCall : int {
  reserve,
  free_reservation,
  create,
  release,
  map,
  unmap,
  set_access,
  export_handle,
  import_handle,
  host_alloc,
  host_free,
  stream_create,
  stream_destroy,
  copy,
  fill,
  stream_synchronize,
  device_synchronize,
  event_create,
  event_destroy,
  event_record,
  stream_wait_event,
  event_synchronize,
  multicast_create,
  multicast_add_device,
  multicast_bind,
  multicast_unbind,
  multicast_release,
  hash,
  multicast_granularity,
  multicast_export,
  multicast_import,
  host_register,
  host_unregister,
  count_
};

std::string_view to_string(DriverCall c) noexcept;

class Driver {
 public:
  virtual ~Driver() = default;

  // "cuda" or "host" (a decorator reports its inner driver's name): for reports and logs only;
  // code that must choose asks capabilities().
  virtual std::string_view backend_name() const noexcept = 0;
  virtual DriverCapabilities capabilities() const noexcept = 0;

  // --- devices -------------------------------------------------------------------------
  virtual int device_count() = 0;
  virtual DeviceProperties device_properties(int device) = 0;
  virtual bool can_access_peer(int device, int peer) = 0;
  virtual MemoryInfo memory_info(int device) = 0;
  // True when every multicast entry point (create, add device, bind, unbind, granularity)
  // resolved in the driver library. Says nothing about the device or the kill switches.
  virtual bool multicast_entry_points() = 0;

  // --- virtual address space -----------------------------------------------------------
  // Reserve `bytes` (a multiple of the granularity) aligned to `alignment`.
  virtual device_ptr reserve(std::size_t bytes, std::size_t alignment) = 0;
  // Give back a whole reservation; nothing may be mapped inside it.
  virtual void free_reservation(device_ptr va, std::size_t bytes) = 0;

  // --- physical memory ------------------------------------------------------------------
  // `exportable`: the handle can later be exported as a POSIX file descriptor (and as a fabric
  // handle where probe_fabric(device) said yes), and, on a device whose properties say
  // gpu_direct_rdma_vmm, it is created GPUDirect RDMA capable. Memory that is not exportable is
  // neither.
  virtual PhysicalHandle create(int device, std::size_t bytes, bool exportable) = 0;
  virtual void release(PhysicalHandle handle) = 0;
  virtual void map(device_ptr va, std::size_t bytes, PhysicalHandle handle, std::size_t handle_offset) = 0;
  // Unmap exactly one earlier mapping [va, va + bytes).
  virtual void unmap(device_ptr va, std::size_t bytes) = 0;
  // Read/write access for every device in `devices`, over mapped memory [va, va + bytes)
  // (one call for a contiguous range of several mappings).
  virtual void set_access(device_ptr va, std::size_t bytes, std::span<const int> devices) = 0;

  // --- sharing between processes ---------------------------------------------------------
  // A new file descriptor owned by the caller.
  virtual int export_fd(PhysicalHandle handle) = 0;
  // A new handle referring to the exported memory; `fd` stays owned by the caller.
  virtual PhysicalHandle import_fd(int fd) = 0;
  // import_fd of memory its exporter announced as `bytes` long: driver_error (invalid_value)
  // where the backend can tell that it is not. The default checks what import_fd checks (the
  // CUDA driver cannot size an imported handle; mapping more than it holds fails there).
  virtual PhysicalHandle import_fd_of_size(int fd, std::size_t bytes);
  // Fabric handles (capabilities().fabric_handles): 64 bytes naming exportable memory, valid in
  // any process of the NVLink domain (another node included) while the exporter holds the handle.
  // Memory is exportable as a fabric handle when it was created exportable on a device whose
  // probe_fabric() said yes. import_fabric of memory its exporter announced as `bytes` long. The
  // defaults say "not supported"; a refused import (no IMEX channel, not permitted) is a
  // driver_error with the driver's code, whose text says the cause in words.
  virtual FabricHandle export_fabric(PhysicalHandle handle);
  virtual PhysicalHandle import_fabric(const FabricHandle& handle, std::size_t bytes);
  // A real small fabric allocation and export on `device` (cached per device after the first
  // call): whether this process can share that device's memory across nodes, and if not, why.
  // Never throws for a refusal; the default answers backend_without_fabric.
  virtual FabricProbe probe_fabric(int device);
  // The machine this process runs on, as far as node-local sharing goes: ranks with equal names
  // can pass POSIX descriptors to each other. The default is the host name and the boot id.
  virtual std::string node_name();

  // --- multicast (NVLS). Reach these only after the collective multicast decision. --------
  virtual std::size_t multicast_granularity(std::span<const int> devices, std::size_t bytes) = 0;
  virtual MulticastHandle multicast_create(std::span<const int> devices, std::size_t bytes) = 0;
  virtual void multicast_add_device(MulticastHandle mc, int device) = 0;
  virtual void multicast_bind(MulticastHandle mc, std::size_t mc_offset, PhysicalHandle memory,
                              std::size_t memory_offset, std::size_t bytes) = 0;
  virtual void multicast_unbind(MulticastHandle mc, int device, std::size_t mc_offset, std::size_t bytes) = 0;
  virtual void multicast_release(MulticastHandle mc) = 0;
  // A multicast object is mapped like physical memory: map(va, bytes, as_physical(mc), 0).
  virtual PhysicalHandle as_physical(MulticastHandle mc) = 0;
  // Sharing one multicast object between ranks: the creator exports it as a POSIX fd, every
  // other rank imports its own handle to the same object (then adds its device, binds, maps).
  // The defaults say "not supported" (driver_error, CUDA_ERROR_NOT_SUPPORTED).
  virtual int multicast_export_fd(MulticastHandle mc);
  virtual MulticastHandle multicast_import_fd(int fd);
  // The same over fabric handles (multi-node multicast); created with the fabric type only where
  // probe_fabric() said yes. The defaults say "not supported". Both honour the kill switches.
  virtual FabricHandle multicast_export_fabric(MulticastHandle mc);
  virtual MulticastHandle multicast_import_fabric(const FabricHandle& handle);
  // Whether an exported multicast object can be imported by another process (CUDA: yes;
  // HostDriver emulates multicast within one driver instance only). The symmetric layer folds
  // this into its collective decision, so processes never start a multicast setup that fails.
  virtual bool multicast_shares_across_processes() { return false; }
  // The software fan-out of a store through a multicast address (capabilities().multicast ==
  // emulated): `bytes` from `src` land at the same offset in every buffer bound to the multicast
  // object mapped at mc_va, as multimem.st does on a GPU. The CPU reference tail's multicast
  // variant stores through it. The default says "not supported".
  virtual void multicast_store(device_ptr mc_va, const void* src, std::size_t bytes);

  // --- the calling thread's current device (capabilities().make_current) ---------------------
  // Makes `device` current on the calling thread, persistently, for the CUDA runtime and the
  // libraries built on it (NCCL). The default says "not supported".
  virtual void make_current(int device);
  // The backend's own handle of a stream this driver created, for the libraries on the CUDA
  // runtime that take one (NCCL): on the cuda backend the CUstream, the same object as the
  // runtime's cudaStream_t. The default says "not supported".
  virtual void* native_stream(Stream s);

  // --- CUDA graphs the application captured (outside torpor's pools) -------------------------
  // Memory nodes (allocation and free nodes, child graphs included) of a captured graph, given as
  // the backend's graph handle (a CUgraph); a graph with such nodes keeps memory in CUDA's graph
  // allocator, out of torpor's reach. graph_memory: that allocator's current bytes on `device`.
  // The defaults say "not supported" (a backend without CUDA graphs).
  virtual std::size_t graph_memory_nodes(std::uintptr_t graph);
  virtual GraphMemory graph_memory(int device);

  // --- exact accounting (capabilities().physical_accounting) ---------------------------------
  // Bytes of physical memory created on `device` and still alive (a handle or a mapping refers to
  // it). The default says "not supported".
  virtual std::size_t live_physical_bytes(int device) const;

  // --- host memory ------------------------------------------------------------------------
  // Page-locked host memory usable as a copy source/target at full link speed.
  virtual void* host_alloc(std::size_t bytes) = 0;
  virtual void host_free(void* p) = 0;
  // Page-lock existing host memory [p, p + bytes) (cuMemHostRegister, portable: usable from every
  // device's context), so copies to and from it run at link speed. `device` names the context the
  // call runs in when the calling thread has none current. Throws driver_error when refused
  // (registration limits, overlapping an earlier registration, ...); nothing is registered then.
  // Registering memory that was first touched (by several threads) is much faster than host_alloc.
  virtual void host_register(void* p, std::size_t bytes, int device) = 0;
  // Undo host_register; `p` must be the start of a registered range (else driver_error).
  virtual void host_unregister(void* p, int device) = 0;

  // --- streams, copies, events --------------------------------------------------------------
  virtual Stream stream_create(int device) = 0;
  virtual void stream_destroy(Stream s) = 0;
  // Any direction: host and device pointers share one address space.
  virtual void copy_async(void* dst, const void* src, std::size_t bytes, Stream s) = 0;
  virtual void fill_async(device_ptr dst, std::uint8_t value, std::size_t bytes, Stream s) = 0;
  virtual void stream_synchronize(Stream s) = 0;
  // Waits for all work on the device, from any stream of this process.
  virtual void device_synchronize(int device) = 0;
  virtual Event event_create(int device) = 0;
  virtual void event_destroy(Event e) = 0;
  virtual void event_record(Event e, Stream s) = 0;
  virtual void stream_wait_event(Stream s, Event e) = 0;
  virtual void event_synchronize(Event e) = 0;

  // --- content hashes -------------------------------------------------------------------
  // content hash (the library's content_hash.hpp) of each range, computed where the bytes live (on the GPU
  // at HBM speed), ordered after earlier work on `s`. Blocks until `out` holds the results.
  virtual void hash(std::span<const HashRange> ranges, Hash128* out, Stream s) = 0;
};

}  // namespace torpor
