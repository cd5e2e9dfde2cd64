// CudaDriver: the seam over libcuda, resolved at run time.
//
// dlopen("libcuda.so.1") then cuGetProcAddress for every entry point, each pinned to one
// explicit ABI version with the matching PFN_cuX_vNNNN type from cudaTypedefs.h. Asking for
// "the newest" is wrong: CUDA 13 answers "cuCtxSynchronize" with a variant that takes a
// context argument. Calls that need a context bind the device's primary context (shared with
// the CUDA runtime, so memory from a torpor pool is usable by cudart kernels). Every CUresult
// is checked and turned into driver_error naming the call and its arguments.
#include "torpor/cuda_driver.hpp"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <dlfcn.h>
#include <fmt/format.h>

#include <mutex>
#include <vector>

#include "torpor/error.hpp"
#include "torpor/log.hpp"
#include "torpor/multicast_policy.hpp"

namespace torpor {

// Required entry points: CudaDriver::open fails when one is missing.
#define TORPOR_CUDA_REQUIRED(X)        \
  X(cuInit, 2000)                            \
  X(cuDriverGetVersion, 2020)                \
  X(cuGetErrorName, 6000)                    \
  X(cuGetErrorString, 6000)                  \
  X(cuDeviceGetCount, 2000)                  \
  X(cuDeviceGet, 2000)                       \
  X(cuDeviceGetName, 2000)                   \
  X(cuDeviceTotalMem, 3020)                  \
  X(cuDeviceGetAttribute, 2000)              \
  X(cuDeviceCanAccessPeer, 4000)             \
  X(cuDevicePrimaryCtxRetain, 7000)          \
  X(cuDevicePrimaryCtxRelease, 11000)         \
  X(cuCtxSetCurrent, 4000)                   \
  X(cuCtxGetCurrent, 4000)                   \
  X(cuCtxSynchronize, 2000)                  \
  X(cuMemGetInfo, 3020)                      \
  X(cuMemGetAllocationGranularity, 10020)     \
  X(cuMemAddressReserve, 10020)               \
  X(cuMemAddressFree, 10020)                  \
  X(cuMemCreate, 10020)                       \
  X(cuMemRelease, 10020)                      \
  X(cuMemMap, 10020)                          \
  X(cuMemUnmap, 10020)                        \
  X(cuMemSetAccess, 10020)                    \
  X(cuMemExportToShareableHandle, 10020)      \
  X(cuMemImportFromShareableHandle, 10020)    \
  X(cuMemHostAlloc, 2020)                    \
  X(cuMemFreeHost, 2000)                     \
  X(cuStreamCreate, 2000)                    \
  X(cuStreamDestroy, 4000)                   \
  X(cuMemcpyAsync, 4000)                     \
  X(cuMemsetD8Async, 3020)                   \
  X(cuStreamSynchronize, 2000)               \
  X(cuEventCreate, 2000)                     \
  X(cuEventDestroy, 4000)                    \
  X(cuEventRecord, 2000)                     \
  X(cuStreamWaitEvent, 3020)                 \
  X(cuEventSynchronize, 2000)

// Optional: multicast needs a recent driver; absence only means "no multicast".
#define TORPOR_CUDA_OPTIONAL(X) \
  X(cuMulticastCreate, 12010)          \
  X(cuMulticastAddDevice, 12010)       \
  X(cuMulticastBindMem, 12010)         \
  X(cuMulticastUnbind, 12010)          \
  X(cuMulticastGetGranularity, 12010)

struct CudaDriver::Impl {
  void* lib = nullptr;
  int version = 0;
#define TORPOR_DECLARE(name, version) PFN_##name##_v##version name##_ = nullptr;
  TORPOR_CUDA_REQUIRED(TORPOR_DECLARE)
  TORPOR_CUDA_OPTIONAL(TORPOR_DECLARE)
#undef TORPOR_DECLARE
  std::mutex mu;
  std::vector<CUdevice> devices;
  std::vector<CUcontext> contexts;  // primary contexts, retained lazily

  ~Impl() {
    for (std::size_t i = 0; i < contexts.size(); ++i)
      if (contexts[i] != nullptr && cuDevicePrimaryCtxRelease_ != nullptr) cuDevicePrimaryCtxRelease_(devices[i]);
    if (lib != nullptr) ::dlclose(lib);
  }

  std::string describe(CUresult r) const {
    const char* name = nullptr;
    const char* text = nullptr;
    if (cuGetErrorName_ == nullptr || cuGetErrorName_(r, &name) != CUDA_SUCCESS) name = "CUDA_ERROR_?";
    if (cuGetErrorString_ == nullptr || cuGetErrorString_(r, &text) != CUDA_SUCCESS) text = "";
    return fmt::format("{} ({}): {}", name, static_cast<int>(r), text);
  }

  void check(CUresult r, const char* call, const std::string& args) const {
    if (r != CUDA_SUCCESS) throw_driver_error(static_cast<int>(r), call, fmt::format("{} [{}]", describe(r), args));
  }

  void check_device(int device, const char* call) const {
    if (device < 0 || static_cast<std::size_t>(device) >= devices.size())
      throw_driver_error(CUDA_ERROR_INVALID_DEVICE, call,
                         fmt::format("device {} does not exist ({} present)", device, devices.size()));
  }

  // Make the device's primary context current on this thread.
  void bind(int device, const char* call) {
    check_device(device, call);
    CUcontext ctx;
    {
      std::lock_guard lock(mu);
      auto i = static_cast<std::size_t>(device);
      if (contexts[i] == nullptr) check(cuDevicePrimaryCtxRetain_(&contexts[i], devices[i]), "cuDevicePrimaryCtxRetain",
                                        fmt::format("device {}", device));
      ctx = contexts[i];
    }
    check(cuCtxSetCurrent_(ctx), "cuCtxSetCurrent", fmt::format("device {}", device));
  }

  // VA operations need some context; keep the caller's if it has one.
  void ensure_context(const char* call) {
    CUcontext cur = nullptr;
    if (cuCtxGetCurrent_(&cur) == CUDA_SUCCESS && cur != nullptr) return;
    bind(0, call);
  }

  CUmemAllocationProp prop(int device, bool exportable) const {
    CUmemAllocationProp p{};
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = devices[static_cast<std::size_t>(device)];
    p.requestedHandleTypes = exportable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
    return p;
  }

  bool has_multicast() const {
    return cuMulticastCreate_ && cuMulticastAddDevice_ && cuMulticastBindMem_ && cuMulticastUnbind_ &&
           cuMulticastGetGranularity_;
  }
};

std::unique_ptr<CudaDriver> CudaDriver::open(std::string* why_not) {
  auto fail = [&](std::string reason) -> std::unique_ptr<CudaDriver> {
    if (why_not) *why_not = std::move(reason);
    return nullptr;
  };
  auto impl = std::make_unique<Impl>();
  impl->lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (impl->lib == nullptr) {
    const char* e = ::dlerror();
    return fail(fmt::format("libcuda.so.1 could not be loaded ({}): no NVIDIA driver on this machine",
                            e ? e : "unknown"));
  }
  using get_proc_t = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);
  auto get_proc = reinterpret_cast<get_proc_t>(::dlsym(impl->lib, "cuGetProcAddress_v2"));
  if (get_proc == nullptr)
    return fail("libcuda.so.1 has no cuGetProcAddress_v2: the NVIDIA driver is older than CUDA 12; update the driver");
  std::string missing;
  auto resolve = [&](const char* name, int version, void** slot, bool required) {
    CUdriverProcAddressQueryResult status{};
    CUresult r = get_proc(name, slot, version, CU_GET_PROC_ADDRESS_DEFAULT, &status);
    if (r != CUDA_SUCCESS || status != CU_GET_PROC_ADDRESS_SUCCESS) {
      *slot = nullptr;
      if (required) missing += fmt::format("{}{}", missing.empty() ? "" : ", ", name);
    }
  };
#define TORPOR_RESOLVE_REQUIRED(name, version) resolve(#name, version, reinterpret_cast<void**>(&impl->name##_), true);
#define TORPOR_RESOLVE_OPTIONAL(name, version) resolve(#name, version, reinterpret_cast<void**>(&impl->name##_), false);
  TORPOR_CUDA_REQUIRED(TORPOR_RESOLVE_REQUIRED)
  TORPOR_CUDA_OPTIONAL(TORPOR_RESOLVE_OPTIONAL)
#undef TORPOR_RESOLVE_REQUIRED
#undef TORPOR_RESOLVE_OPTIONAL
  if (!missing.empty()) return fail(fmt::format("libcuda.so.1 lacks required entry points: {}", missing));
  CUresult r = impl->cuInit_(0);
  if (r != CUDA_SUCCESS) return fail(fmt::format("cuInit failed: {}", impl->describe(r)));
  impl->cuDriverGetVersion_(&impl->version);
  int count = 0;
  r = impl->cuDeviceGetCount_(&count);
  if (r != CUDA_SUCCESS) return fail(fmt::format("cuDeviceGetCount failed: {}", impl->describe(r)));
  if (count == 0) return fail("the NVIDIA driver sees no CUDA device");
  for (int i = 0; i < count; ++i) {
    CUdevice d;
    r = impl->cuDeviceGet_(&d, i);
    if (r != CUDA_SUCCESS) return fail(fmt::format("cuDeviceGet({}) failed: {}", i, impl->describe(r)));
    impl->devices.push_back(d);
  }
  impl->contexts.assign(impl->devices.size(), nullptr);
  return std::unique_ptr<CudaDriver>(new CudaDriver(std::move(impl)));
}

CudaDriver::CudaDriver(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaDriver::~CudaDriver() = default;

int CudaDriver::driver_version() const noexcept { return impl_->version; }

int CudaDriver::device_count() { return static_cast<int>(impl_->devices.size()); }

DeviceProperties CudaDriver::device_properties(int device) {
  Impl& d = *impl_;
  d.check_device(device, "cuDeviceGetAttribute");
  CUdevice dev = d.devices[static_cast<std::size_t>(device)];
  DeviceProperties p;
  p.ordinal = device;
  char name[256] = {};
  d.check(d.cuDeviceGetName_(name, sizeof name, dev), "cuDeviceGetName", fmt::format("device {}", device));
  p.name = name;
  d.check(d.cuDeviceTotalMem_(&p.total_bytes, dev), "cuDeviceTotalMem", fmt::format("device {}", device));
  auto attribute = [&](CUdevice_attribute a) {
    int v = 0;
    // An attribute unknown to an older driver reads as "not supported".
    return d.cuDeviceGetAttribute_(&v, a, dev) == CUDA_SUCCESS && v != 0;
  };
  p.vmm_supported = attribute(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED);
  p.posix_fd_handles_supported = attribute(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED);
  p.multicast_attribute = attribute(CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED);
  if (p.vmm_supported) {
    d.bind(device, "cuMemGetAllocationGranularity");
    CUmemAllocationProp prop = d.prop(device, false);
    d.check(d.cuMemGetAllocationGranularity_(&p.granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
            "cuMemGetAllocationGranularity", fmt::format("device {}", device));
  }
  return p;
}

bool CudaDriver::can_access_peer(int device, int peer) {
  Impl& d = *impl_;
  d.check_device(device, "cuDeviceCanAccessPeer");
  d.check_device(peer, "cuDeviceCanAccessPeer");
  if (device == peer) return false;
  int v = 0;
  d.check(d.cuDeviceCanAccessPeer_(&v, d.devices[static_cast<std::size_t>(device)],
                                   d.devices[static_cast<std::size_t>(peer)]),
          "cuDeviceCanAccessPeer", fmt::format("device {} peer {}", device, peer));
  return v != 0;
}

MemoryInfo CudaDriver::memory_info(int device) {
  Impl& d = *impl_;
  d.bind(device, "cuMemGetInfo");
  MemoryInfo m;
  d.check(d.cuMemGetInfo_(&m.free_bytes, &m.total_bytes), "cuMemGetInfo", fmt::format("device {}", device));
  return m;
}

bool CudaDriver::multicast_entry_points() { return impl_->has_multicast(); }

device_ptr CudaDriver::reserve(std::size_t bytes, std::size_t alignment) {
  Impl& d = *impl_;
  d.ensure_context("cuMemAddressReserve");
  CUdeviceptr p = 0;
  d.check(d.cuMemAddressReserve_(&p, bytes, alignment, 0, 0), "cuMemAddressReserve",
          fmt::format("size {:#x} alignment {:#x}", bytes, alignment));
  return static_cast<device_ptr>(p);
}

void CudaDriver::free_reservation(device_ptr va, std::size_t bytes) {
  Impl& d = *impl_;
  d.ensure_context("cuMemAddressFree");
  d.check(d.cuMemAddressFree_(static_cast<CUdeviceptr>(va), bytes), "cuMemAddressFree",
          fmt::format("va {:#x} size {:#x}", va, bytes));
}

PhysicalHandle CudaDriver::create(int device, std::size_t bytes, bool exportable) {
  Impl& d = *impl_;
  d.bind(device, "cuMemCreate");
  CUmemAllocationProp prop = d.prop(device, exportable);
  CUmemGenericAllocationHandle h = 0;
  d.check(d.cuMemCreate_(&h, bytes, &prop, 0), "cuMemCreate",
          fmt::format("device {} size {:#x}{}", device, bytes, exportable ? " exportable" : ""));
  return PhysicalHandle{static_cast<std::uint64_t>(h)};
}

void CudaDriver::release(PhysicalHandle handle) {
  Impl& d = *impl_;
  d.ensure_context("cuMemRelease");
  d.check(d.cuMemRelease_(static_cast<CUmemGenericAllocationHandle>(handle.value)), "cuMemRelease",
          fmt::format("handle {:#x}", handle.value));
}

void CudaDriver::map(device_ptr va, std::size_t bytes, PhysicalHandle handle, std::size_t handle_offset) {
  Impl& d = *impl_;
  d.ensure_context("cuMemMap");
  d.check(d.cuMemMap_(static_cast<CUdeviceptr>(va), bytes, handle_offset,
                      static_cast<CUmemGenericAllocationHandle>(handle.value), 0),
          "cuMemMap", fmt::format("va {:#x} size {:#x} handle {:#x} offset {:#x}", va, bytes, handle.value, handle_offset));
}

void CudaDriver::unmap(device_ptr va, std::size_t bytes) {
  Impl& d = *impl_;
  d.ensure_context("cuMemUnmap");
  d.check(d.cuMemUnmap_(static_cast<CUdeviceptr>(va), bytes), "cuMemUnmap", fmt::format("va {:#x} size {:#x}", va, bytes));
}

void CudaDriver::set_access(device_ptr va, std::size_t bytes, std::span<const int> devices) {
  Impl& d = *impl_;
  d.ensure_context("cuMemSetAccess");
  std::vector<CUmemAccessDesc> desc;
  for (int dev : devices) {
    d.check_device(dev, "cuMemSetAccess");
    CUmemAccessDesc a{};
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = d.devices[static_cast<std::size_t>(dev)];
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    desc.push_back(a);
  }
  d.check(d.cuMemSetAccess_(static_cast<CUdeviceptr>(va), bytes, desc.data(), desc.size()), "cuMemSetAccess",
          fmt::format("va {:#x} size {:#x} devices {}", va, bytes, devices.size()));
}

int CudaDriver::export_fd(PhysicalHandle handle) {
  Impl& d = *impl_;
  d.ensure_context("cuMemExportToShareableHandle");
  int fd = -1;
  d.check(d.cuMemExportToShareableHandle_(&fd, static_cast<CUmemGenericAllocationHandle>(handle.value),
                                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
          "cuMemExportToShareableHandle", fmt::format("handle {:#x}", handle.value));
  return fd;
}

PhysicalHandle CudaDriver::import_fd(int fd) {
  Impl& d = *impl_;
  d.ensure_context("cuMemImportFromShareableHandle");
  CUmemGenericAllocationHandle h = 0;
  // The POSIX fd is passed by value, cast through a pointer-sized integer as the API requires.
  d.check(d.cuMemImportFromShareableHandle_(&h, reinterpret_cast<void*>(static_cast<std::uintptr_t>(fd)),
                                            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
          "cuMemImportFromShareableHandle", fmt::format("fd {}", fd));
  return PhysicalHandle{static_cast<std::uint64_t>(h)};
}

namespace {
void refuse_if_killed(const char* call) {
  if (auto k = multicast_kill_switch())
    throw_driver_error(CUDA_ERROR_NOT_PERMITTED, call,
                       fmt::format("refused: multicast is disabled by {}; torpor never calls it then", *k));
}
}  // namespace

std::size_t CudaDriver::multicast_granularity(std::span<const int> devices, std::size_t bytes) {
  Impl& d = *impl_;
  refuse_if_killed("cuMulticastGetGranularity");
  if (!d.has_multicast()) throw_driver_error(CUDA_ERROR_NOT_SUPPORTED, "cuMulticastGetGranularity", "not in this driver");
  CUmulticastObjectProp prop{};
  prop.numDevices = static_cast<unsigned>(devices.size());
  prop.size = bytes;
  prop.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  std::size_t g = 0;
  d.ensure_context("cuMulticastGetGranularity");
  d.check(d.cuMulticastGetGranularity_(&g, &prop, CU_MULTICAST_GRANULARITY_RECOMMENDED), "cuMulticastGetGranularity",
          fmt::format("devices {} size {:#x}", devices.size(), bytes));
  return g;
}

MulticastHandle CudaDriver::multicast_create(std::span<const int> devices, std::size_t bytes) {
  Impl& d = *impl_;
  // Defence in depth: the symmetric layer only gets here after a collective "yes", but the
  // seam itself never creates a multicast object while a kill switch is set.
  refuse_if_killed("cuMulticastCreate");
  if (!d.has_multicast()) throw_driver_error(CUDA_ERROR_NOT_SUPPORTED, "cuMulticastCreate", "not in this driver");
  CUmulticastObjectProp prop{};
  prop.numDevices = static_cast<unsigned>(devices.size());
  prop.size = bytes;
  prop.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  CUmemGenericAllocationHandle h = 0;
  d.ensure_context("cuMulticastCreate");
  d.check(d.cuMulticastCreate_(&h, &prop), "cuMulticastCreate", fmt::format("devices {} size {:#x}", devices.size(), bytes));
  return MulticastHandle{static_cast<std::uint64_t>(h)};
}

int CudaDriver::multicast_export_fd(MulticastHandle mc) {
  Impl& d = *impl_;
  refuse_if_killed("cuMemExportToShareableHandle(multicast)");
  d.ensure_context("cuMemExportToShareableHandle");
  int fd = -1;
  d.check(d.cuMemExportToShareableHandle_(&fd, static_cast<CUmemGenericAllocationHandle>(mc.value),
                                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
          "cuMemExportToShareableHandle(multicast)", fmt::format("handle {:#x}", mc.value));
  return fd;
}

MulticastHandle CudaDriver::multicast_import_fd(int fd) {
  Impl& d = *impl_;
  refuse_if_killed("cuMemImportFromShareableHandle(multicast)");
  d.ensure_context("cuMemImportFromShareableHandle");
  CUmemGenericAllocationHandle h = 0;
  d.check(d.cuMemImportFromShareableHandle_(&h, reinterpret_cast<void*>(static_cast<std::uintptr_t>(fd)),
                                            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
          "cuMemImportFromShareableHandle(multicast)", fmt::format("fd {}", fd));
  return MulticastHandle{static_cast<std::uint64_t>(h)};
}

void CudaDriver::make_current(int device) { impl_->bind(device, "cuCtxSetCurrent"); }

void CudaDriver::multicast_add_device(MulticastHandle mc, int device) {
  Impl& d = *impl_;
  refuse_if_killed("cuMulticastAddDevice");
  d.check_device(device, "cuMulticastAddDevice");
  d.ensure_context("cuMulticastAddDevice");
  d.check(d.cuMulticastAddDevice_(static_cast<CUmemGenericAllocationHandle>(mc.value),
                                  d.devices[static_cast<std::size_t>(device)]),
          "cuMulticastAddDevice", fmt::format("device {}", device));
}

void CudaDriver::multicast_bind(MulticastHandle mc, std::size_t mc_offset, PhysicalHandle memory,
                                std::size_t memory_offset, std::size_t bytes) {
  Impl& d = *impl_;
  refuse_if_killed("cuMulticastBindMem");
  d.ensure_context("cuMulticastBindMem");
  d.check(d.cuMulticastBindMem_(static_cast<CUmemGenericAllocationHandle>(mc.value), mc_offset,
                                static_cast<CUmemGenericAllocationHandle>(memory.value), memory_offset, bytes, 0),
          "cuMulticastBindMem", fmt::format("mc offset {:#x} size {:#x}", mc_offset, bytes));
}

void CudaDriver::multicast_unbind(MulticastHandle mc, int device, std::size_t mc_offset, std::size_t bytes) {
  Impl& d = *impl_;
  if (!d.has_multicast()) throw_driver_error(CUDA_ERROR_NOT_SUPPORTED, "cuMulticastUnbind", "not in this driver");
  d.check_device(device, "cuMulticastUnbind");
  d.ensure_context("cuMulticastUnbind");
  d.check(d.cuMulticastUnbind_(static_cast<CUmemGenericAllocationHandle>(mc.value),
                               d.devices[static_cast<std::size_t>(device)], mc_offset, bytes),
          "cuMulticastUnbind", fmt::format("device {} mc offset {:#x} size {:#x}", device, mc_offset, bytes));
}

void CudaDriver::multicast_release(MulticastHandle mc) {
  Impl& d = *impl_;
  d.ensure_context("cuMemRelease");
  d.check(d.cuMemRelease_(static_cast<CUmemGenericAllocationHandle>(mc.value)), "cuMemRelease(multicast)",
          fmt::format("handle {:#x}", mc.value));
}

void* CudaDriver::host_alloc(std::size_t bytes) {
  Impl& d = *impl_;
  d.ensure_context("cuMemHostAlloc");
  void* p = nullptr;
  d.check(d.cuMemHostAlloc_(&p, bytes, CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc", fmt::format("size {}", bytes));
  return p;
}

void CudaDriver::host_free(void* p) {
  Impl& d = *impl_;
  d.ensure_context("cuMemFreeHost");
  d.check(d.cuMemFreeHost_(p), "cuMemFreeHost", fmt::format("{}", p));
}

Stream CudaDriver::stream_create(int device) {
  Impl& d = *impl_;
  d.bind(device, "cuStreamCreate");
  CUstream s = nullptr;
  d.check(d.cuStreamCreate_(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate", fmt::format("device {}", device));
  return Stream{reinterpret_cast<std::uint64_t>(s), device};
}

void CudaDriver::stream_destroy(Stream s) {
  Impl& d = *impl_;
  d.bind(s.device, "cuStreamDestroy");
  d.check(d.cuStreamDestroy_(reinterpret_cast<CUstream>(s.value)), "cuStreamDestroy", "");
}

void CudaDriver::copy_async(void* dst, const void* src, std::size_t bytes, Stream s) {
  Impl& d = *impl_;
  d.bind(s.device, "cuMemcpyAsync");
  d.check(d.cuMemcpyAsync_(reinterpret_cast<CUdeviceptr>(dst), reinterpret_cast<CUdeviceptr>(src), bytes,
                           reinterpret_cast<CUstream>(s.value)),
          "cuMemcpyAsync", fmt::format("dst {} src {} size {}", dst, src, bytes));
}

void CudaDriver::fill_async(device_ptr dst, std::uint8_t value, std::size_t bytes, Stream s) {
  Impl& d = *impl_;
  d.bind(s.device, "cuMemsetD8Async");
  d.check(d.cuMemsetD8Async_(static_cast<CUdeviceptr>(dst), value, bytes, reinterpret_cast<CUstream>(s.value)),
          "cuMemsetD8Async", fmt::format("dst {:#x} size {}", dst, bytes));
}

void CudaDriver::stream_synchronize(Stream s) {
  Impl& d = *impl_;
  d.bind(s.device, "cuStreamSynchronize");
  d.check(d.cuStreamSynchronize_(reinterpret_cast<CUstream>(s.value)), "cuStreamSynchronize", "");
}

void CudaDriver::device_synchronize(int device) {
  Impl& d = *impl_;
  d.bind(device, "cuCtxSynchronize");
  d.check(d.cuCtxSynchronize_(), "cuCtxSynchronize", fmt::format("device {}", device));
}

Event CudaDriver::event_create(int device) {
  Impl& d = *impl_;
  d.bind(device, "cuEventCreate");
  CUevent e = nullptr;
  d.check(d.cuEventCreate_(&e, CU_EVENT_DISABLE_TIMING), "cuEventCreate", fmt::format("device {}", device));
  return Event{reinterpret_cast<std::uint64_t>(e), device};
}

void CudaDriver::event_destroy(Event e) {
  Impl& d = *impl_;
  d.bind(e.device, "cuEventDestroy");
  d.check(d.cuEventDestroy_(reinterpret_cast<CUevent>(e.value)), "cuEventDestroy", "");
}

void CudaDriver::event_record(Event e, Stream s) {
  Impl& d = *impl_;
  d.bind(s.device, "cuEventRecord");
  d.check(d.cuEventRecord_(reinterpret_cast<CUevent>(e.value), reinterpret_cast<CUstream>(s.value)), "cuEventRecord", "");
}

void CudaDriver::stream_wait_event(Stream s, Event e) {
  Impl& d = *impl_;
  d.bind(s.device, "cuStreamWaitEvent");
  d.check(d.cuStreamWaitEvent_(reinterpret_cast<CUstream>(s.value), reinterpret_cast<CUevent>(e.value), 0),
          "cuStreamWaitEvent", "");
}

void CudaDriver::event_synchronize(Event e) {
  Impl& d = *impl_;
  d.bind(e.device, "cuEventSynchronize");
  d.check(d.cuEventSynchronize_(reinterpret_cast<CUevent>(e.value)), "cuEventSynchronize", "");
}

}  // namespace torpor
