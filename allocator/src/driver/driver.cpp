// Default implementations of the optional parts of the driver seam: each says "not supported"
// (driver_error, CUDA_ERROR_NOT_SUPPORTED) naming the backend, as a driver without the call would.
// Callers ask capabilities() first; the error is for the one that did not.
#include "torpor/driver.hpp"

#include <fmt/format.h>

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

std::size_t Driver::live_physical_bytes(int) const {
  not_supported(*this, "live_physical_bytes", "keeps no exact account of live physical memory");
}

}  // namespace torpor
