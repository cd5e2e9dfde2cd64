// CudaDriver's multicast objects (NVLS): create, add devices, bind and unbind memory, share.
//
// The entry points are optional (a driver without them has no multicast). The seam never
// creates, shares or sizes a multicast object while a kill switch is set, even though the
// symmetric layer only gets here after a collective "yes" (defence in depth: cuMulticastCreate
// can put shared GPUs out of service). An object is created shareable as a fabric handle only
// where every local device's fabric probe said yes.
#include "common/options.hpp"
#include "driver/cuda/fabric.hpp"
#include "driver/cuda/library.hpp"

namespace torpor {

using cuda::cu;

namespace cuda {

void refuse_if_killed(const char* call) {
  if (auto k = options::multicast_kill_switch())  // the same switches as ranks/multicast.hpp
    throw_driver_error(CUDA_ERROR_NOT_PERMITTED, call,
                       fmt::format("refused: multicast is disabled by {}; torpor never calls it then", *k));
}

}  // namespace cuda

namespace {

CUmulticastObjectProp multicast_prop(std::span<const int> devices, std::size_t bytes, bool fabric = false) {
  CUmulticastObjectProp prop{};
  prop.numDevices = static_cast<unsigned>(devices.size());
  prop.size = bytes;
  unsigned long long types = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  if (fabric) types |= cuda::fabric_handle_type();
  prop.handleTypes = types;
  return prop;
}

}  // namespace

bool CudaDriver::multicast_entry_points() { return impl_->has_multicast(); }

std::size_t CudaDriver::multicast_granularity(std::span<const int> devices, std::size_t bytes) {
  Impl& d = *impl_;
  cuda::refuse_if_killed("cuMulticastGetGranularity");
  if (!d.has_multicast())
    throw_driver_error(CUDA_ERROR_NOT_SUPPORTED, "cuMulticastGetGranularity", "not in this driver");
  CUmulticastObjectProp prop = multicast_prop(devices, bytes);
  std::size_t g = 0;
  auto context = d.ensure_context("cuMulticastGetGranularity");
  d.check(d.cuMulticastGetGranularity_(&g, &prop, CU_MULTICAST_GRANULARITY_RECOMMENDED), "cuMulticastGetGranularity",
          fmt::format("devices {} size {:#x}", devices.size(), bytes));
  return g;
}

MulticastHandle CudaDriver::multicast_create(std::span<const int> devices, std::size_t bytes) {
  Impl& d = *impl_;
  // Defence in depth: the symmetric layer only gets here after a collective "yes", but the
  // seam itself never creates a multicast object while a kill switch is set.
  cuda::refuse_if_killed("cuMulticastCreate");
  if (!d.has_multicast()) throw_driver_error(CUDA_ERROR_NOT_SUPPORTED, "cuMulticastCreate", "not in this driver");
  // Shareable across nodes where every local device's probe said yes (the probe never creates a
  // multicast object; the kill switches were checked above, before anything).
  bool fabric = !devices.empty();
  for (int dev : devices) fabric = fabric && probe_fabric(dev).supported();
  CUmulticastObjectProp prop = multicast_prop(devices, bytes, fabric);
  CUmemGenericAllocationHandle h = 0;
  auto context = d.ensure_context("cuMulticastCreate");
  d.check(d.cuMulticastCreate_(&h, &prop), "cuMulticastCreate",
          fmt::format("devices {} size {:#x}", devices.size(), bytes));
  return MulticastHandle{static_cast<std::uint64_t>(h)};
}

void CudaDriver::multicast_add_device(MulticastHandle mc, int device) {
  Impl& d = *impl_;
  cuda::refuse_if_killed("cuMulticastAddDevice");
  d.check_device(device, "cuMulticastAddDevice");
  auto context = d.ensure_context("cuMulticastAddDevice");
  d.check(d.cuMulticastAddDevice_(cu(mc), d.devices[static_cast<std::size_t>(device)]), "cuMulticastAddDevice",
          fmt::format("device {}", device));
}

void CudaDriver::multicast_bind(MulticastHandle mc, std::size_t mc_offset, PhysicalHandle memory,
                                std::size_t memory_offset, std::size_t bytes) {
  Impl& d = *impl_;
  cuda::refuse_if_killed("cuMulticastBindMem");
  auto context = d.ensure_context("cuMulticastBindMem");
  d.check(d.cuMulticastBindMem_(cu(mc), mc_offset, cu(memory), memory_offset, bytes, 0), "cuMulticastBindMem",
          fmt::format("mc offset {:#x} size {:#x}", mc_offset, bytes));
}

void CudaDriver::multicast_unbind(MulticastHandle mc, int device, std::size_t mc_offset, std::size_t bytes) {
  Impl& d = *impl_;
  if (!d.has_multicast()) throw_driver_error(CUDA_ERROR_NOT_SUPPORTED, "cuMulticastUnbind", "not in this driver");
  d.check_device(device, "cuMulticastUnbind");
  auto context = d.ensure_context("cuMulticastUnbind");
  d.check(d.cuMulticastUnbind_(cu(mc), d.devices[static_cast<std::size_t>(device)], mc_offset, bytes),
          "cuMulticastUnbind", fmt::format("device {} mc offset {:#x} size {:#x}", device, mc_offset, bytes));
}

void CudaDriver::multicast_release(MulticastHandle mc) {
  Impl& d = *impl_;
  auto context = d.ensure_context("cuMemRelease");
  d.check(d.cuMemRelease_(cu(mc)), "cuMemRelease(multicast)", fmt::format("handle {:#x}", mc.value));
}

int CudaDriver::multicast_export_fd(MulticastHandle mc) {
  cuda::refuse_if_killed("cuMemExportToShareableHandle(multicast)");
  return impl_->export_handle(cu(mc), "cuMemExportToShareableHandle(multicast)");
}

MulticastHandle CudaDriver::multicast_import_fd(int fd) {
  cuda::refuse_if_killed("cuMemImportFromShareableHandle(multicast)");
  return MulticastHandle{impl_->import_handle(fd, "cuMemImportFromShareableHandle(multicast)")};
}

}  // namespace torpor
