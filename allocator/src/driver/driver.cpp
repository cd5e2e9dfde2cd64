// The seam's own code, whatever the backend: the names of its enums (capabilities, handle
// kinds, fabric probe causes, and DriverCall's: the kinds of call the fault-injecting driver
// fails), the sentence a fabric probe says, and the default implementations of the optional parts
// of the seam: each says "not supported" (driver_error, CUDA_ERROR_NOT_SUPPORTED) naming the
// backend, as a driver without the call would. Callers ask capabilities() first; the error is for
// the one that did not.
#include "torpor/driver.hpp"

#include <fmt/core.h>
#include <unistd.h>

#include <fstream>

#include "torpor/error.hpp"

namespace torpor {

namespace {

[[noreturn]] void not_supported(const Driver& d, const char* call, std::string_view what) {
  throw_driver_error(static_cast<int>(driver_status::not_supported), call,
                     fmt::format("the {} driver {}", d.backend_name(), what));
}

}  // namespace

std::string_view to_string(DriverCapabilities::Compute c) noexcept {
  switch (c) {
    case DriverCapabilities::Compute::device_kernels: return "device kernels";
    case DriverCapabilities::Compute::cpu_reference: return "CPU reference";
  }
  return "?";
}

std::string_view to_string(DriverCapabilities::Multicast m) noexcept {
  switch (m) {
    case DriverCapabilities::Multicast::none: return "none";
    case DriverCapabilities::Multicast::hardware: return "hardware";
    case DriverCapabilities::Multicast::emulated: return "emulated";
  }
  return "?";
}

std::string_view to_string(HandleKind k) noexcept {
  switch (k) {
    case HandleKind::posix_fd: return "POSIX file descriptor";
    case HandleKind::fabric: return "fabric handle";
  }
  return "?";
}

std::string_view to_string(FabricProbe::Cause c) noexcept {
  switch (c) {
    case FabricProbe::Cause::supported: return "supported";
    case FabricProbe::Cause::backend_without_fabric: return "backend without fabric handles";
    case FabricProbe::Cause::driver_too_old: return "driver too old";
    case FabricProbe::Cause::device_without_fabric: return "device without fabric";
    case FabricProbe::Cause::no_imex_channel: return "no IMEX channel";
    case FabricProbe::Cause::not_permitted: return "not permitted";
    case FabricProbe::Cause::failed: return "failed";
  }
  return "?";
}

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

std::string FabricProbe::describe() const {
  std::string result = code != 0 ? fmt::format(" ({} returned {}{})", call, code, detail.empty() ? "" : ": " + detail)
                       : detail.empty() ? std::string()
                                        : fmt::format(" ({})", detail);
  switch (cause) {
    case Cause::supported: return fmt::format("fabric handles work{}", result);
    case Cause::backend_without_fabric: return fmt::format("this backend has no fabric handles{}", result);
    case Cause::driver_too_old:
      return fmt::format("the CUDA driver is too old for fabric handles{}; fabric handles need driver and toolkit 12.3 "
                         "or newer",
                         result);
    case Cause::device_without_fabric:
      return fmt::format("the device has no fabric handle support{} (no multi-node NVLink: use POSIX descriptors "
                         "within one node)",
                         result);
    case Cause::no_imex_channel:
      return fmt::format("no IMEX channel{}: /dev/nvidia-caps-imex-channels/channel0 must exist in this process's "
                         "namespace (start the nvidia-imex service and create the channel; under containers pass "
                         "the device through, e.g. NVIDIA_IMEX_CHANNELS=0)",
                         result);
    case Cause::not_permitted:
      return fmt::format("the fabric export or import was not permitted{}: the IMEX daemon must run on every node of "
                         "the domain with the nodes listed in its nodes_config, and this process needs access to an "
                         "IMEX channel",
                         result);
    case Cause::failed: return fmt::format("the fabric export failed{}", result);
  }
  return "?";
}

FabricHandle Driver::export_fabric(PhysicalHandle) {
  not_supported(*this, "cuMemExportToShareableHandle(fabric)", "has no fabric handles");
}

PhysicalHandle Driver::import_fabric(const FabricHandle&, std::size_t) {
  not_supported(*this, "cuMemImportFromShareableHandle(fabric)", "has no fabric handles");
}

FabricProbe Driver::probe_fabric(int) {
  FabricProbe p;
  p.cause = FabricProbe::Cause::backend_without_fabric;
  p.detail = fmt::format("the {} driver", backend_name());
  return p;
}

std::string Driver::node_name() {
  // The host name alone can repeat across containers of one machine that cannot share
  // descriptors either way; the boot id tells machines apart.
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) host[0] = '\0';
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  return fmt::format("{}/{}", host, boot);
}

FabricHandle Driver::multicast_export_fabric(MulticastHandle) {
  not_supported(*this, "cuMemExportToShareableHandle(multicast, fabric)", "cannot share multicast objects as fabric");
}

MulticastHandle Driver::multicast_import_fabric(const FabricHandle&) {
  not_supported(*this, "cuMemImportFromShareableHandle(multicast, fabric)", "cannot share multicast objects as fabric");
}

int Driver::multicast_export_fd(MulticastHandle) {
  throw_driver_error(static_cast<int>(driver_status::not_supported), "cuMemExportToShareableHandle(multicast)",
                     "this driver cannot share multicast objects");
}

PhysicalHandle Driver::import_fd_of_size(int fd, std::size_t) { return import_fd(fd); }

MulticastHandle Driver::multicast_import_fd(int) {
  throw_driver_error(static_cast<int>(driver_status::not_supported), "cuMemImportFromShareableHandle(multicast)",
                     "this driver cannot share multicast objects");
}

void Driver::multicast_store(device_ptr, const void*, std::size_t) {
  not_supported(*this, "multimem.st", "has no software multicast fan-out (capabilities().multicast is not emulated)");
}

void Driver::make_current(int) {
  not_supported(*this, "cuCtxSetCurrent", "cannot make a device current for the CUDA runtime");
}

void* Driver::native_stream(Stream) {
  not_supported(*this, "native_stream", "has no native stream for the CUDA runtime's libraries");
}

std::size_t Driver::graph_memory_nodes(std::uintptr_t) {
  not_supported(*this, "cuGraphGetNodes", "has no CUDA graphs");
}

GraphMemory Driver::graph_memory(int) {
  not_supported(*this, "cuDeviceGetGraphMemAttribute", "has no CUDA graph allocator");
}

std::size_t Driver::live_physical_bytes(int) const {
  not_supported(*this, "live_physical_bytes", "keeps no exact account of live physical memory");
}

}  // namespace torpor
