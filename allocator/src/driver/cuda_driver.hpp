// CudaDriver: the Driver seam over the CUDA driver API. libcuda.so.1 is opened with dlopen
// and every entry point is resolved through cuGetProcAddress at run time, so a torpor binary
// starts on a machine without a GPU and says why it cannot use one (see backend.hpp).
// This header does not include cuda.h; only the files of driver/cuda/ do, one concern each
// (devices, VMM, sharing and fabric, multicast, host memory, streams, hash) over the loaded
// library, Impl (driver/cuda/library.hpp).
#pragma once

#include <memory>
#include <string>

#include "torpor/driver.hpp"

namespace torpor {

class CudaDriver final : public Driver {
 public:
  // nullptr and `why_not` filled when libcuda is missing, cuInit fails or no device exists.
  static std::unique_ptr<CudaDriver> open(std::string* why_not);
  ~CudaDriver() override;
  CudaDriver(const CudaDriver&) = delete;
  CudaDriver& operator=(const CudaDriver&) = delete;

  std::string_view backend_name() const noexcept override { return "cuda"; }
  // Device kernels; hardware multicast where the driver library has the entry points; can make a
  // device current (make_current).
  DriverCapabilities capabilities() const noexcept override;
  int driver_version() const noexcept;  // e.g. 13000

  int device_count() override;
  DeviceProperties device_properties(int device) override;
  bool can_access_peer(int device, int peer) override;
  MemoryInfo memory_info(int device) override;
  bool multicast_entry_points() override;

  device_ptr reserve(std::size_t bytes, std::size_t alignment) override;
  void free_reservation(device_ptr va, std::size_t bytes) override;
  PhysicalHandle create(int device, std::size_t bytes, bool exportable) override;
  void release(PhysicalHandle handle) override;
  void map(device_ptr va, std::size_t bytes, PhysicalHandle handle, std::size_t handle_offset) override;
  void unmap(device_ptr va, std::size_t bytes) override;
  void set_access(device_ptr va, std::size_t bytes, std::span<const int> devices) override;
  int export_fd(PhysicalHandle handle) override;
  PhysicalHandle import_fd(int fd) override;

  std::size_t multicast_granularity(std::span<const int> devices, std::size_t bytes) override;
  MulticastHandle multicast_create(std::span<const int> devices, std::size_t bytes) override;
  void multicast_add_device(MulticastHandle mc, int device) override;
  void multicast_bind(MulticastHandle mc, std::size_t mc_offset, PhysicalHandle memory, std::size_t memory_offset,
                      std::size_t bytes) override;
  void multicast_unbind(MulticastHandle mc, int device, std::size_t mc_offset, std::size_t bytes) override;
  void multicast_release(MulticastHandle mc) override;
  PhysicalHandle as_physical(MulticastHandle mc) override { return PhysicalHandle{mc.value}; }
  int multicast_export_fd(MulticastHandle mc) override;
  MulticastHandle multicast_import_fd(int fd) override;
  // Fabric handles (CU_MEM_HANDLE_TYPE_FABRIC, CUDA 12.3+). Exportable memory requests the fabric
  // type too on a device whose probe said yes; the probe is one real granularity-sized
  // cuMemCreate + export per device, cached, so a device whose attribute says yes while the IMEX
  // channel is missing is found out before any pool depends on it.
  FabricHandle export_fabric(PhysicalHandle handle) override;
  PhysicalHandle import_fabric(const FabricHandle& handle, std::size_t bytes) override;
  FabricProbe probe_fabric(int device) override;
  FabricHandle multicast_export_fabric(MulticastHandle mc) override;
  MulticastHandle multicast_import_fabric(const FabricHandle& handle) override;
  bool multicast_shares_across_processes() override { return multicast_entry_points(); }

  // Makes `device`'s primary context current on the calling thread: what the CUDA runtime, and
  // libraries built on it such as NCCL, read as the current device.
  void make_current(int device) override;
  void* native_stream(Stream s) override;
  std::size_t graph_memory_nodes(std::uintptr_t graph) override;
  GraphMemory graph_memory(int device) override;

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

  struct Impl;  // the loaded library: driver/cuda/library.hpp

 private:
  explicit CudaDriver(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace torpor
