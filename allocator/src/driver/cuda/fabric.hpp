// The part of CudaDriver that depends on the toolkit having fabric handles
// (CU_MEM_HANDLE_TYPE_FABRIC, CUmemFabricHandle: cuda.h of CUDA 12.3 and newer).
//
// allocator/CMakeLists.txt chooses one of two files by CUDAToolkit_VERSION, as it chooses the
// NCCL files: fabric.cpp (the toolkit has them: real probes, exports and imports) or
// fabric_unavailable.cpp (it does not: no handle type bit, every probe answers driver_too_old,
// and the fabric calls say "not supported" as the seam's defaults do). Both define what this
// header declares and CudaDriver's export_fabric, import_fabric, multicast_export_fabric and
// multicast_import_fabric; no other file of driver/cuda/ names a fabric symbol of cuda.h.
#pragma once

#include <cuda.h>

#include "driver/cuda_driver.hpp"

namespace torpor::cuda {

// The handle type bit that asks cuMemCreate and cuMulticastCreate for fabric handles too
// (CU_MEM_HANDLE_TYPE_FABRIC); 0 where the toolkit has none.
unsigned fabric_handle_type() noexcept;

// CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED of `device` (an attribute the driver does not
// know reads as no); no where the toolkit has no fabric handles.
bool fabric_attribute(const CudaDriver::Impl& d, CUdevice device);

// One real fabric allocation and export on `device`, or why not (never throws for a refusal).
// CudaDriver::probe_fabric caches it per device.
FabricProbe probe_fabric_export(CudaDriver::Impl& d, int device);

}  // namespace torpor::cuda
