// CudaDriver's devices: what each device is and can do, its memory, and the calling thread's
// current device.
//
// Device properties read attributes; an attribute an older driver does not know reads as "not
// supported", never as an error. The memory CUDA's own graph allocator holds is here too
// (graph_memory, graph_memory_nodes): memory on the device that torpor does not own and a sleep
// cannot give back. The optional entry points these need answer "not supported" when missing.
#include <vector>

#include "driver/cuda/fabric.hpp"
#include "driver/cuda/library.hpp"
#include "torpor/log.hpp"

namespace torpor {

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
  if (d.cuDeviceGetPCIBusId_ != nullptr) {
    char bus[64] = {};  // "0000:3b:00.0": the host store's NUMA node comes from it
    if (d.cuDeviceGetPCIBusId_(bus, static_cast<int>(sizeof bus), dev) == CUDA_SUCCESS) p.pci_bus_id = bus;
  }
  p.fabric_handles_supported = cuda::fabric_attribute(d, dev);
  p.gpu_direct_rdma_vmm = d.rdma_vmm(device);
  if (p.vmm_supported) {
    auto context = d.bind(device, "cuMemGetAllocationGranularity");
    CUmemAllocationProp prop = d.prop(device, false);
    d.check(d.cuMemGetAllocationGranularity_(&p.granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
            "cuMemGetAllocationGranularity", fmt::format("device {}", device));
  }
  return p;
}

// CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, cached per device. An attribute
// unknown to an older driver, or a failed query (logged), reads as "no": the memory is then
// created without the flag, as on a device without the support.
bool CudaDriver::Impl::rdma_vmm(int device) {
  {
    std::lock_guard lock(mu);
    if (auto it = rdma_vmm_by_device.find(device); it != rdma_vmm_by_device.end()) return it->second;
  }
  int v = 0;
  const CUresult r = cuDeviceGetAttribute_(&v, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
                                           devices[static_cast<std::size_t>(device)]);
  if (r != CUDA_SUCCESS) {
    log::debug("CudaDriver: CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED of device {}: {}", device,
               describe(r));
    v = 0;
  }
  std::lock_guard lock(mu);
  rdma_vmm_by_device.emplace(device, v != 0);
  return v != 0;
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
  auto context = d.bind(device, "cuMemGetInfo");
  MemoryInfo m;
  d.check(d.cuMemGetInfo_(&m.free_bytes, &m.total_bytes), "cuMemGetInfo", fmt::format("device {}", device));
  return m;
}

DriverCapabilities CudaDriver::capabilities() const noexcept {
  return {.compute = DriverCapabilities::Compute::device_kernels,
          .host_memory = false,
          .multicast =
              impl_->has_multicast() ? DriverCapabilities::Multicast::hardware : DriverCapabilities::Multicast::none,
          .make_current = true,
          .physical_accounting = false,
          // The NVIDIA driver pins registered pages in its kernel module, not with mlock: they
          // are charged to the cgroup, not to RLIMIT_MEMLOCK.
          .host_register_charged_to_memlock = false,
          .posix_fd_handles = true,
          .fabric_handles = cuda::fabric_handle_type() != 0};
}

void CudaDriver::make_current(int device) {
  // Deliberately persistent (no guard): the caller wants this device current from now on.
  Impl& d = *impl_;
  d.check(d.cuCtxSetCurrent_(d.primary(device, "cuCtxSetCurrent")), "cuCtxSetCurrent",
          fmt::format("device {}", device));
}

namespace {

// Memory nodes of one graph and of the graphs its child-graph nodes hold, recursively.
std::size_t count_graph_memory_nodes(const CudaDriver::Impl& d, CUgraph graph) {
  std::size_t count = 0;
  d.check(d.cuGraphGetNodes_(graph, nullptr, &count), "cuGraphGetNodes", "count");
  std::vector<CUgraphNode> nodes(count);
  if (count != 0) d.check(d.cuGraphGetNodes_(graph, nodes.data(), &count), "cuGraphGetNodes", "nodes");
  std::size_t found = 0;
  for (std::size_t i = 0; i < count; ++i) {
    CUgraphNodeType type{};
    d.check(d.cuGraphNodeGetType_(nodes[i], &type), "cuGraphNodeGetType", fmt::format("node {}", i));
    if (type == CU_GRAPH_NODE_TYPE_MEM_ALLOC || type == CU_GRAPH_NODE_TYPE_MEM_FREE) {
      ++found;
    } else if (type == CU_GRAPH_NODE_TYPE_GRAPH) {
      CUgraph child = nullptr;
      d.check(d.cuGraphChildGraphNodeGetGraph_(nodes[i], &child), "cuGraphChildGraphNodeGetGraph",
              fmt::format("node {}", i));
      found += count_graph_memory_nodes(d, child);
    }
  }
  return found;
}

}  // namespace

std::size_t CudaDriver::graph_memory_nodes(std::uintptr_t graph) {
  Impl& d = *impl_;
  if (d.cuGraphGetNodes_ == nullptr || d.cuGraphNodeGetType_ == nullptr || d.cuGraphChildGraphNodeGetGraph_ == nullptr)
    throw_driver_error(CUDA_ERROR_NOT_SUPPORTED, "cuGraphGetNodes", "not in this driver");
  if (graph == 0) throw invalid_argument("graph_memory_nodes: the graph handle is null");
  return count_graph_memory_nodes(d, reinterpret_cast<CUgraph>(graph));
}

GraphMemory CudaDriver::graph_memory(int device) {
  Impl& d = *impl_;
  if (d.cuDeviceGetGraphMemAttribute_ == nullptr)
    throw_driver_error(CUDA_ERROR_NOT_SUPPORTED, "cuDeviceGetGraphMemAttribute", "not in this driver");
  auto context = d.bind(device, "cuDeviceGetGraphMemAttribute");
  GraphMemory m;
  const std::string args = fmt::format("device {}", device);
  d.check(d.cuDeviceGetGraphMemAttribute_(d.devices[device], CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT, &m.used_bytes),
          "cuDeviceGetGraphMemAttribute(used)", args);
  d.check(d.cuDeviceGetGraphMemAttribute_(d.devices[device], CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, &m.reserved_bytes),
          "cuDeviceGetGraphMemAttribute(reserved)", args);
  return m;
}

}  // namespace torpor
