// CudaDriver's sharing between processes: POSIX descriptors within a node, and the cached
// answer of whether a device's memory can travel as a fabric handle across nodes.
//
// A descriptor is exported and imported as CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (multicast
// objects use the same two helpers, multicast.cpp). The fabric probe is one real granularity-
// sized cuMemCreate and export per device (fabric.cpp, or fabric_unavailable.cpp where the
// toolkit has no fabric handles), asked once and cached, so a device whose attribute says yes
// while the IMEX channel is missing is found out before any pool depends on it.
#include "driver/cuda/fabric.hpp"
#include "driver/cuda/library.hpp"
#include "torpor/log.hpp"

namespace torpor {

using cuda::cu;

int CudaDriver::Impl::export_handle(CUmemGenericAllocationHandle h, const char* call) {
  auto context = ensure_context("cuMemExportToShareableHandle");
  int fd = -1;
  check(cuMemExportToShareableHandle_(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0), call,
        fmt::format("handle {:#x}", h));
  return fd;
}

CUmemGenericAllocationHandle CudaDriver::Impl::import_handle(int fd, const char* call) {
  auto context = ensure_context("cuMemImportFromShareableHandle");
  CUmemGenericAllocationHandle h = 0;
  // The POSIX fd is passed by value, cast through a pointer-sized integer as the API requires.
  check(cuMemImportFromShareableHandle_(&h, reinterpret_cast<void*>(static_cast<std::uintptr_t>(fd)),
                                        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
        call, fmt::format("fd {}", fd));
  return h;
}

int CudaDriver::export_fd(PhysicalHandle handle) {
  return impl_->export_handle(cu(handle), "cuMemExportToShareableHandle");
}

PhysicalHandle CudaDriver::import_fd(int fd) {
  return PhysicalHandle{impl_->import_handle(fd, "cuMemImportFromShareableHandle")};
}

FabricProbe CudaDriver::probe_fabric(int device) {
  Impl& d = *impl_;
  d.check_device(device, "probe_fabric");
  {
    std::lock_guard lock(d.mu);
    if (auto it = d.fabric_probes.find(device); it != d.fabric_probes.end()) return it->second;
  }
  FabricProbe p = cuda::probe_fabric_export(d, device);
  log::info("CudaDriver: fabric probe on device {}: {}", device, p.describe());
  std::lock_guard lock(d.mu);
  d.fabric_probes.emplace(device, p);
  return p;
}

}  // namespace torpor
