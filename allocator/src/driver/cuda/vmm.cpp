// CudaDriver's virtual memory: address reservations, physical handles, mappings and access.
//
// One call of the driver each, checked, in the caller's current context when it has one (VA and
// handle calls need only some context) and in the device's primary context where the device
// matters (cuMemCreate). Exportable memory asks for the POSIX descriptor type, the fabric type
// where the device's probe said yes, and GPUDirect RDMA where the device supports it for VMM
// allocations; memory that is not exportable asks for none of them.
#include <vector>

#include "driver/cuda/fabric.hpp"
#include "driver/cuda/library.hpp"

namespace torpor {

using cuda::cu;

CUmemAllocationProp CudaDriver::Impl::prop(int device, bool exportable, bool fabric, bool rdma) const {
  CUmemAllocationProp p{};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = devices[static_cast<std::size_t>(device)];
  unsigned types = exportable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
  if (exportable && fabric) types |= cuda::fabric_handle_type();
  p.requestedHandleTypes = static_cast<CUmemAllocationHandleType>(types);
  p.allocFlags.gpuDirectRDMACapable = exportable && rdma ? 1 : 0;
  return p;
}

device_ptr CudaDriver::reserve(std::size_t bytes, std::size_t alignment) {
  Impl& d = *impl_;
  auto context = d.ensure_context("cuMemAddressReserve");
  CUdeviceptr p = 0;
  d.check(d.cuMemAddressReserve_(&p, bytes, alignment, 0, 0), "cuMemAddressReserve",
          fmt::format("size {:#x} alignment {:#x}", bytes, alignment));
  return static_cast<device_ptr>(p);
}

void CudaDriver::free_reservation(device_ptr va, std::size_t bytes) {
  impl_->call_in_context("cuMemAddressFree", fmt::format("va {:#x} size {:#x}", va, bytes), impl_->cuMemAddressFree_,
                         static_cast<CUdeviceptr>(va), bytes);
}

PhysicalHandle CudaDriver::create(int device, std::size_t bytes, bool exportable) {
  Impl& d = *impl_;
  d.check_device(device, "cuMemCreate");
  // Exportable memory can also travel as a fabric handle where a real export said it may: the
  // symmetric layer then chooses per pool, and a device without fabric keeps POSIX descriptors.
  // It is also GPUDirect RDMA capable where the device supports that for VMM allocations, so a
  // transport can register it with a NIC (NCCL and NVSHMEM create their buffers the same way).
  const bool fabric = exportable && probe_fabric(device).supported();
  const bool rdma = exportable && d.rdma_vmm(device);
  auto context = d.bind(device, "cuMemCreate");
  CUmemAllocationProp prop = d.prop(device, exportable, fabric, rdma);
  CUmemGenericAllocationHandle h = 0;
  d.check(d.cuMemCreate_(&h, bytes, &prop, 0), "cuMemCreate",
          fmt::format("device {} size {:#x}{}{}{}", device, bytes, exportable ? " exportable" : "",
                      fabric ? " fabric" : "", rdma ? " GPUDirect-RDMA-capable" : ""));
  return PhysicalHandle{static_cast<std::uint64_t>(h)};
}

void CudaDriver::release(PhysicalHandle handle) {
  impl_->call_in_context("cuMemRelease", fmt::format("handle {:#x}", handle.value), impl_->cuMemRelease_, cu(handle));
}

void CudaDriver::map(device_ptr va, std::size_t bytes, PhysicalHandle handle, std::size_t handle_offset) {
  impl_->call_in_context("cuMemMap",
                         fmt::format("va {:#x} size {:#x} handle {:#x} offset {:#x}", va, bytes, handle.value,
                                     handle_offset),
                         impl_->cuMemMap_, static_cast<CUdeviceptr>(va), bytes, handle_offset, cu(handle), 0);
}

void CudaDriver::unmap(device_ptr va, std::size_t bytes) {
  impl_->call_in_context("cuMemUnmap", fmt::format("va {:#x} size {:#x}", va, bytes), impl_->cuMemUnmap_,
                         static_cast<CUdeviceptr>(va), bytes);
}

void CudaDriver::set_access(device_ptr va, std::size_t bytes, std::span<const int> devices) {
  Impl& d = *impl_;
  auto context = d.ensure_context("cuMemSetAccess");
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

}  // namespace torpor
