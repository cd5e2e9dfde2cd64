// CudaDriver's fabric handles where the toolkit has them (CUDA 12.3 and newer; chosen by
// allocator/CMakeLists.txt, see fabric.hpp): 64 bytes that name exportable memory, or a
// multicast object, in any process of the NVLink domain, imported through the IMEX service.
//
// A refused export or import is classified (no IMEX channel, not permitted, device without
// fabric, failed) by the driver's result and whether an IMEX channel device is visible, so the
// error says the cause and its fix. The multicast calls honour the kill switches first.
#include "driver/cuda/fabric.hpp"

#include <cstring>
#include <filesystem>

#include "driver/cuda/library.hpp"
#include "torpor/log.hpp"

#if CUDA_VERSION < 12030
#error "fabric.cpp needs CU_MEM_HANDLE_TYPE_FABRIC (CUDA 12.3): allocator/CMakeLists.txt builds fabric_unavailable.cpp"
#endif

namespace torpor {

using cuda::cu;

namespace {

// Whether any IMEX channel device is visible: the driver's NOT_PERMITTED / INVALID_VALUE at a
// fabric export reads the same with and without one, the channel says which cause it is.
bool imex_channel_present() {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator("/dev/nvidia-caps-imex-channels", ec))
    if (e.path().filename().string().starts_with("channel")) return true;
  return false;
}

FabricProbe classify_fabric_failure(CUresult r, const char* call, std::string text) {
  FabricProbe p;
  p.code = static_cast<int>(r);
  p.call = call;
  p.detail = std::move(text);
  const bool channel = imex_channel_present();
  if (r == CUDA_ERROR_NOT_PERMITTED)
    p.cause = channel ? FabricProbe::Cause::not_permitted : FabricProbe::Cause::no_imex_channel;
  else if (r == CUDA_ERROR_INVALID_VALUE || r == CUDA_ERROR_NOT_SUPPORTED)
    p.cause = channel ? FabricProbe::Cause::failed : FabricProbe::Cause::no_imex_channel;
  else
    p.cause = FabricProbe::Cause::failed;
  return p;
}

FabricHandle to_seam(const CUmemFabricHandle& h) {
  static_assert(sizeof(CUmemFabricHandle) == fabric_handle_bytes);
  FabricHandle out;
  std::memcpy(out.bytes.data(), &h, fabric_handle_bytes);
  return out;
}

CUmemFabricHandle to_cu(const FabricHandle& h) {
  CUmemFabricHandle out{};
  std::memcpy(&out, h.bytes.data(), fabric_handle_bytes);
  return out;
}

}  // namespace

namespace cuda {

unsigned fabric_handle_type() noexcept { return CU_MEM_HANDLE_TYPE_FABRIC; }

bool fabric_attribute(const CudaDriver::Impl& d, CUdevice device) {
  int v = 0;
  return d.cuDeviceGetAttribute_(&v, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, device) == CUDA_SUCCESS &&
         v != 0;
}

FabricProbe probe_fabric_export(CudaDriver::Impl& d, int device) {
  FabricProbe p;
  CUdevice dev = d.devices[static_cast<std::size_t>(device)];
  int attribute = 0;
  if (d.version < 12030) {
    p.cause = FabricProbe::Cause::driver_too_old;
    p.detail = fmt::format("the driver is CUDA {}.{}", d.version / 1000, (d.version % 1000) / 10);
  } else if (d.cuDeviceGetAttribute_(&attribute, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, dev) !=
                 CUDA_SUCCESS ||
             attribute == 0) {
    p.cause = FabricProbe::Cause::device_without_fabric;
    p.call = "cuDeviceGetAttribute";
    p.detail = "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED is 0";
  } else {
    // The attribute can say yes while the export fails (vllm-project/vllm#35489): ask the driver
    // with a real allocation of one granule.
    auto context = d.bind(device, "probe_fabric");
    // The properties create() gives exportable memory here, the RDMA flag included.
    CUmemAllocationProp prop = d.prop(device, true, true, d.rdma_vmm(device));
    std::size_t granularity = 0;
    CUresult r = d.cuMemGetAllocationGranularity_(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    CUmemGenericAllocationHandle h = 0;
    if (r == CUDA_SUCCESS) r = d.cuMemCreate_(&h, granularity, &prop, 0);
    if (r != CUDA_SUCCESS) {
      p = classify_fabric_failure(r, "cuMemCreate", d.describe(r));
    } else {
      CUmemFabricHandle fh{};
      r = d.cuMemExportToShareableHandle_(&fh, h, CU_MEM_HANDLE_TYPE_FABRIC, 0);
      if (r != CUDA_SUCCESS)
        p = classify_fabric_failure(r, "cuMemExportToShareableHandle", d.describe(r));
      else {
        p.cause = FabricProbe::Cause::supported;
        p.call = "cuMemExportToShareableHandle";
        p.detail = fmt::format("a {}-byte fabric export on device {}", granularity, device);
      }
      if (d.cuMemRelease_(h) != CUDA_SUCCESS) log::warn("CudaDriver: releasing the fabric probe's allocation failed");
    }
  }
  return p;
}

}  // namespace cuda

FabricHandle CudaDriver::export_fabric(PhysicalHandle handle) {
  Impl& d = *impl_;
  auto context = d.ensure_context("cuMemExportToShareableHandle(fabric)");
  CUmemFabricHandle fh{};
  CUresult r = d.cuMemExportToShareableHandle_(&fh, cu(handle), CU_MEM_HANDLE_TYPE_FABRIC, 0);
  if (r != CUDA_SUCCESS) {
    FabricProbe why = classify_fabric_failure(r, "cuMemExportToShareableHandle(fabric)", d.describe(r));
    throw_driver_error(static_cast<int>(r), "cuMemExportToShareableHandle(fabric)",
                       fmt::format("handle {:#x}: {}", handle.value, why.describe()));
  }
  return to_seam(fh);
}

PhysicalHandle CudaDriver::import_fabric(const FabricHandle& handle, std::size_t bytes) {
  Impl& d = *impl_;
  auto context = d.ensure_context("cuMemImportFromShareableHandle(fabric)");
  CUmemFabricHandle fh = to_cu(handle);
  CUmemGenericAllocationHandle h = 0;
  CUresult r = d.cuMemImportFromShareableHandle_(&h, &fh, CU_MEM_HANDLE_TYPE_FABRIC);
  if (r != CUDA_SUCCESS) {
    FabricProbe why = classify_fabric_failure(r, "cuMemImportFromShareableHandle(fabric)", d.describe(r));
    throw_driver_error(static_cast<int>(r), "cuMemImportFromShareableHandle(fabric)",
                       fmt::format("{} bytes: {}", bytes, why.describe()));
  }
  return PhysicalHandle{static_cast<std::uint64_t>(h)};
}

FabricHandle CudaDriver::multicast_export_fabric(MulticastHandle mc) {
  cuda::refuse_if_killed("cuMemExportToShareableHandle(multicast, fabric)");
  Impl& d = *impl_;
  auto context = d.ensure_context("cuMemExportToShareableHandle(multicast, fabric)");
  CUmemFabricHandle fh{};
  d.check(d.cuMemExportToShareableHandle_(&fh, cu(mc), CU_MEM_HANDLE_TYPE_FABRIC, 0),
          "cuMemExportToShareableHandle(multicast, fabric)", fmt::format("handle {:#x}", mc.value));
  return to_seam(fh);
}

MulticastHandle CudaDriver::multicast_import_fabric(const FabricHandle& handle) {
  cuda::refuse_if_killed("cuMemImportFromShareableHandle(multicast, fabric)");
  Impl& d = *impl_;
  auto context = d.ensure_context("cuMemImportFromShareableHandle(multicast, fabric)");
  CUmemFabricHandle fh = to_cu(handle);
  CUmemGenericAllocationHandle h = 0;
  d.check(d.cuMemImportFromShareableHandle_(&h, &fh, CU_MEM_HANDLE_TYPE_FABRIC),
          "cuMemImportFromShareableHandle(multicast, fabric)", "fabric handle");
  return MulticastHandle{static_cast<std::uint64_t>(h)};
}

}  // namespace torpor
