// CudaDriver::Impl: libcuda as loaded at run time, shared by the files of driver/cuda/.
//
// It holds the entry points (one table of required ones, one of optional ones, each pinned to
// one ABI version with the matching PFN_cuX_vNNNN type from cudaTypedefs.h), the devices and
// their primary contexts (retained lazily), and the per-device state of the hash kernels and the
// cached probes. Every CUresult goes through check(), which throws driver_error naming the call
// and its arguments. Calls that need a context bind the device's primary context (shared with
// the CUDA runtime) for their duration and give the caller's own current context back after.
//
// Invariants: devices, contexts and hash_states have one entry per device from open() on;
// contexts, fabric_probes and rdma_vmm_by_device change only under mu; a HashState is used under
// its own mutex. Only the files of driver/cuda/ include this header (it includes cuda.h).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <fmt/core.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "driver/cuda_driver.hpp"
#include "torpor/error.hpp"

namespace torpor {

// Required entry points: CudaDriver::open fails when one is missing.
#define TORPOR_CUDA_REQUIRED(X)            \
  X(cuInit, 2000)                          \
  X(cuDriverGetVersion, 2020)              \
  X(cuGetErrorName, 6000)                  \
  X(cuGetErrorString, 6000)                \
  X(cuDeviceGetCount, 2000)                \
  X(cuDeviceGet, 2000)                     \
  X(cuDeviceGetName, 2000)                 \
  X(cuDeviceTotalMem, 3020)                \
  X(cuDeviceGetAttribute, 2000)            \
  X(cuDeviceCanAccessPeer, 4000)           \
  X(cuDevicePrimaryCtxRetain, 7000)        \
  X(cuDevicePrimaryCtxRelease, 11000)      \
  X(cuCtxSetCurrent, 4000)                 \
  X(cuCtxGetCurrent, 4000)                 \
  X(cuCtxSynchronize, 2000)                \
  X(cuMemGetInfo, 3020)                    \
  X(cuMemGetAllocationGranularity, 10020)  \
  X(cuMemAddressReserve, 10020)            \
  X(cuMemAddressFree, 10020)               \
  X(cuMemCreate, 10020)                    \
  X(cuMemRelease, 10020)                   \
  X(cuMemMap, 10020)                       \
  X(cuMemUnmap, 10020)                     \
  X(cuMemSetAccess, 10020)                 \
  X(cuMemExportToShareableHandle, 10020)   \
  X(cuMemImportFromShareableHandle, 10020) \
  X(cuMemHostAlloc, 2020)                  \
  X(cuMemFreeHost, 2000)                   \
  X(cuMemHostRegister, 6050)               \
  X(cuMemHostUnregister, 4000)             \
  X(cuStreamCreate, 2000)                  \
  X(cuStreamDestroy, 4000)                 \
  X(cuMemcpyAsync, 4000)                   \
  X(cuMemsetD8Async, 3020)                 \
  X(cuStreamSynchronize, 2000)             \
  X(cuEventCreate, 2000)                   \
  X(cuEventDestroy, 4000)                  \
  X(cuEventRecord, 2000)                   \
  X(cuStreamWaitEvent, 3020)               \
  X(cuEventSynchronize, 2000)              \
  X(cuMemAlloc, 3020)                      \
  X(cuMemFree, 3020)                       \
  X(cuMemcpyHtoDAsync, 3020)               \
  X(cuMemcpyDtoHAsync, 3020)               \
  X(cuModuleLoadData, 2000)                \
  X(cuModuleGetFunction, 2000)             \
  X(cuModuleUnload, 2000)                  \
  X(cuLaunchKernel, 4000)

// Optional: multicast needs a recent driver; absence only means "no multicast".
#define TORPOR_CUDA_OPTIONAL(X)           \
  X(cuMulticastCreate, 12010)             \
  X(cuMulticastAddDevice, 12010)          \
  X(cuMulticastBindMem, 12010)            \
  X(cuMulticastUnbind, 12010)             \
  X(cuMulticastGetGranularity, 12010)     \
  X(cuDeviceGetPCIBusId, 4010)            \
  X(cuGraphGetNodes, 10000)               \
  X(cuGraphNodeGetType, 10000)            \
  X(cuGraphChildGraphNodeGetGraph, 10000) \
  X(cuDeviceGetGraphMemAttribute, 11040)

namespace cuda {

// Per device: the loaded module and scratch buffers for hash() (hash.cpp). Guarded by its mutex.
struct HashState {
  std::mutex mu;
  CUmodule module = nullptr;
  CUfunction partial = nullptr;
  CUfunction finalize = nullptr;
  CUdeviceptr device_buffer = 0;  // jobs | sums | results
  void* host_buffer = nullptr;    // jobs | results (pinned)
  std::size_t capacity = 0;       // jobs
};

// The seam's opaque values as the driver's types.
inline CUstream cu(Stream s) { return reinterpret_cast<CUstream>(s.value); }
inline CUevent cu(Event e) { return reinterpret_cast<CUevent>(e.value); }
inline CUmemGenericAllocationHandle cu(PhysicalHandle h) { return static_cast<CUmemGenericAllocationHandle>(h.value); }
inline CUmemGenericAllocationHandle cu(MulticastHandle h) { return static_cast<CUmemGenericAllocationHandle>(h.value); }

// Throws driver_error (CUDA_ERROR_NOT_PERMITTED) naming `call` while a multicast kill switch is
// set: the seam never reaches a multicast entry point then (multicast.cpp).
void refuse_if_killed(const char* call);

}  // namespace cuda

struct CudaDriver::Impl {
  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  // Frees the hash kernels' buffers and modules, releases the retained primary contexts and
  // closes the library; never throws.
  ~Impl();

  void* lib = nullptr;
  int version = 0;
#define TORPOR_DECLARE(name, version) PFN_##name##_v##version name##_ = nullptr;
  TORPOR_CUDA_REQUIRED(TORPOR_DECLARE)
  TORPOR_CUDA_OPTIONAL(TORPOR_DECLARE)
#undef TORPOR_DECLARE
  std::mutex mu;
  std::vector<CUdevice> devices;
  std::vector<CUcontext> contexts;                            // primary contexts, retained lazily
  std::vector<std::unique_ptr<cuda::HashState>> hash_states;  // per device
  // probe_fabric's answers by device (filled once per device, under mu).
  std::map<int, FabricProbe> fabric_probes;
  // rdma_vmm's answers by device (filled once per device, under mu).
  std::map<int, bool> rdma_vmm_by_device;

  // "CUDA_ERROR_X (code): text" for a result.
  std::string describe(CUresult r) const;
  void check(CUresult r, const char* call, const std::string& args) const {
    if (r != CUDA_SUCCESS) throw_driver_error(static_cast<int>(r), call, fmt::format("{} [{}]", describe(r), args));
  }
  void check_device(int device, const char* call) const {
    if (device < 0 || static_cast<std::size_t>(device) >= devices.size())
      throw_driver_error(CUDA_ERROR_INVALID_DEVICE, call,
                         fmt::format("device {} does not exist ({} present)", device, devices.size()));
  }

  // While alive, the context a call needs is current on this thread; the caller's own
  // current context (a framework's current device) comes back at the end of the call.
  class ContextGuard {
   public:
    ContextGuard(const Impl* d, CUcontext previous, bool restore) : d_(d), previous_(previous), restore_(restore) {}
    ContextGuard(const ContextGuard&) = delete;
    ContextGuard& operator=(const ContextGuard&) = delete;
    ~ContextGuard();

   private:
    const Impl* d_;
    CUcontext previous_;
    bool restore_;
  };

  // `device`'s primary context, retained on first use.
  CUcontext primary(int device, const char* call);
  // Make the device's primary context current for the duration of a call.
  [[nodiscard]] ContextGuard bind(int device, const char* call);
  // VA operations need some context; keep the caller's if it has one.
  [[nodiscard]] ContextGuard ensure_context(const char* call) { return ensure_context_on(0, call); }
  // The caller's context if it has one, else `device`'s primary context (a worker thread that
  // never touched CUDA must not create device 0's context in a process that uses another device).
  [[nodiscard]] ContextGuard ensure_context_on(int device, const char* call);

  // One driver call in `device`'s primary context, its result checked: `call` names the entry
  // point in errors, `args` what it was given.
  template <class Fn, class... Args>
  void call_on(int device, const char* call, const std::string& args, Fn fn, Args... a) {
    auto context = bind(device, call);
    check(fn(a...), call, args);
  }

  // The same in the caller's context if it has one (VA and handle calls need only some context).
  template <class Fn, class... Args>
  void call_in_context(const char* call, const std::string& args, Fn fn, Args... a) {
    auto context = ensure_context(call);
    check(fn(a...), call, args);
  }

  // A stream or an event of `device` (`Handle` its seam type, `Cu` the driver's), made with `flags`.
  template <class Handle, class Cu, class Fn>
  Handle create_on(int device, const char* call, Fn fn, unsigned flags) {
    Cu h = nullptr;
    call_on(device, call, fmt::format("device {}", device), fn, &h, flags);
    return Handle{reinterpret_cast<std::uint64_t>(h), device};
  }

  // The POSIX descriptor of a memory or multicast handle; `call` names the export in errors
  // (sharing.cpp).
  int export_handle(CUmemGenericAllocationHandle h, const char* call);
  // The handle a descriptor from export_handle stands for (in this process).
  CUmemGenericAllocationHandle import_handle(int fd, const char* call);

  // The properties cuMemCreate gets (vmm.cpp). `fabric`: the fabric handle type is requested too;
  // `rdma`: created GPUDirect RDMA capable (only exportable memory is: create() decides).
  CUmemAllocationProp prop(int device, bool exportable, bool fabric = false, bool rdma = false) const;
  // Whether `device` takes allocFlags.gpuDirectRDMACapable on cuMemCreate (devices.cpp).
  bool rdma_vmm(int device);

  bool has_multicast() const {
    return cuMulticastCreate_ && cuMulticastAddDevice_ && cuMulticastBindMem_ && cuMulticastUnbind_ &&
           cuMulticastGetGranularity_;
  }
};

}  // namespace torpor
