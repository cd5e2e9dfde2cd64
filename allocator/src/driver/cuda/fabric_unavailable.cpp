// CudaDriver without fabric handles: built where the toolkit's cuda.h predates
// CU_MEM_HANDLE_TYPE_FABRIC (CUDA older than 12.3; chosen by allocator/CMakeLists.txt, see
// fabric.hpp). Memory and multicast objects are created with POSIX descriptors only, every probe
// answers driver_too_old naming the toolkit, and the fabric calls say "not supported" as the
// seam's defaults do (the multicast ones after the kill switches, as with fabric handles).
#include "driver/cuda/fabric.hpp"
#include "driver/cuda/library.hpp"

namespace torpor {

namespace cuda {

unsigned fabric_handle_type() noexcept { return 0; }

bool fabric_attribute(const CudaDriver::Impl&, CUdevice) { return false; }

FabricProbe probe_fabric_export(CudaDriver::Impl&, int) {
  FabricProbe p;
  p.cause = FabricProbe::Cause::driver_too_old;
  p.detail = fmt::format("torpor was built against CUDA {}", CUDA_VERSION);
  return p;
}

}  // namespace cuda

FabricHandle CudaDriver::export_fabric(PhysicalHandle handle) { return Driver::export_fabric(handle); }

PhysicalHandle CudaDriver::import_fabric(const FabricHandle& handle, std::size_t bytes) {
  return Driver::import_fabric(handle, bytes);
}

FabricHandle CudaDriver::multicast_export_fabric(MulticastHandle mc) {
  cuda::refuse_if_killed("cuMemExportToShareableHandle(multicast, fabric)");
  return Driver::multicast_export_fabric(mc);
}

MulticastHandle CudaDriver::multicast_import_fabric(const FabricHandle& handle) {
  cuda::refuse_if_killed("cuMemImportFromShareableHandle(multicast, fabric)");
  return Driver::multicast_import_fabric(handle);
}

}  // namespace torpor
