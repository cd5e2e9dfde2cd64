// CudaDriver's loader: libcuda opened at run time, so a torpor binary starts on a machine
// without a GPU and says why it cannot use one.
//
// dlopen("libcuda.so.1") then cuGetProcAddress for every entry point of library.hpp's tables,
// each pinned to one explicit ABI version. Asking for "the newest" is wrong: CUDA 13 answers
// "cuCtxSynchronize" with a variant that takes a context argument. A missing required entry
// point, a failed cuInit or no device is a reason (open's why_not), never a crash. Here too: the
// primary contexts, retained on first use and released with the driver, and the context guard
// every call that needs a context holds.
#include "driver/cuda/library.hpp"

#include <dlfcn.h>

#include "torpor/log.hpp"

namespace torpor {

CudaDriver::Impl::~Impl() {
  for (std::size_t i = 0; i < hash_states.size(); ++i) {
    cuda::HashState& h = *hash_states[i];
    if (contexts[i] == nullptr) continue;
    cuCtxSetCurrent_(contexts[i]);
    if (h.device_buffer != 0) cuMemFree_(h.device_buffer);
    if (h.host_buffer != nullptr) cuMemFreeHost_(h.host_buffer);
    if (h.module != nullptr) cuModuleUnload_(h.module);
  }
  for (std::size_t i = 0; i < contexts.size(); ++i)
    if (contexts[i] != nullptr && cuDevicePrimaryCtxRelease_ != nullptr) cuDevicePrimaryCtxRelease_(devices[i]);
  if (lib != nullptr) ::dlclose(lib);
}

std::string CudaDriver::Impl::describe(CUresult r) const {
  const char* name = nullptr;
  const char* text = nullptr;
  if (cuGetErrorName_ == nullptr || cuGetErrorName_(r, &name) != CUDA_SUCCESS) name = "CUDA_ERROR_?";
  if (cuGetErrorString_ == nullptr || cuGetErrorString_(r, &text) != CUDA_SUCCESS) text = "";
  return fmt::format("{} ({}): {}", name, static_cast<int>(r), text);
}

CudaDriver::Impl::ContextGuard::~ContextGuard() {
  if (restore_ && d_->cuCtxSetCurrent_(previous_) != CUDA_SUCCESS)
    log::error("CudaDriver: restoring the caller's current context failed");
}

CUcontext CudaDriver::Impl::primary(int device, const char* call) {
  check_device(device, call);
  std::lock_guard lock(mu);
  auto i = static_cast<std::size_t>(device);
  if (contexts[i] == nullptr)
    check(cuDevicePrimaryCtxRetain_(&contexts[i], devices[i]), "cuDevicePrimaryCtxRetain",
          fmt::format("device {}", device));
  return contexts[i];
}

CudaDriver::Impl::ContextGuard CudaDriver::Impl::bind(int device, const char* call) {
  CUcontext ctx = primary(device, call);
  CUcontext previous = nullptr;
  check(cuCtxGetCurrent_(&previous), "cuCtxGetCurrent", call);
  if (previous == ctx) return ContextGuard(this, previous, false);
  check(cuCtxSetCurrent_(ctx), "cuCtxSetCurrent", fmt::format("device {}", device));
  return ContextGuard(this, previous, true);
}

CudaDriver::Impl::ContextGuard CudaDriver::Impl::ensure_context_on(int device, const char* call) {
  CUcontext cur = nullptr;
  if (cuCtxGetCurrent_(&cur) == CUDA_SUCCESS && cur != nullptr) return ContextGuard(this, cur, false);
  return bind(device, call);
}

std::unique_ptr<CudaDriver> CudaDriver::open(std::string* why_not) {
  auto fail = [&](std::string reason) -> std::unique_ptr<CudaDriver> {
    if (why_not) *why_not = std::move(reason);
    return nullptr;
  };
  auto impl = std::make_unique<Impl>();
  impl->lib = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (impl->lib == nullptr) {
    const char* e = ::dlerror();
    return fail(
        fmt::format("libcuda.so.1 could not be loaded ({}): no NVIDIA driver on this machine", e ? e : "unknown"));
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
  for (std::size_t i = 0; i < impl->devices.size(); ++i)
    impl->hash_states.push_back(std::make_unique<cuda::HashState>());
  return std::unique_ptr<CudaDriver>(new CudaDriver(std::move(impl)));
}

CudaDriver::CudaDriver(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaDriver::~CudaDriver() = default;

int CudaDriver::driver_version() const noexcept { return impl_->version; }

}  // namespace torpor
