// See cuda_runtime.hpp.
#include "cuda_runtime.hpp"

#include <fmt/core.h>

#include <vector>

#include "torpor/error.hpp"
#include "torpor/log.hpp"

namespace torpor::fusion::detail {

void cuda_check(cudaError_t e, const char* call, const std::string& what) {
  if (e == cudaSuccess) return;
  throw error(fmt::format("{} failed: {} ({}) [{}]", call, cudaGetErrorName(e), cudaGetErrorString(e), what));
}

std::size_t graph_memory_nodes(cudaGraph_t graph) {
  std::size_t count = 0;
  TORPOR_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &count), "counting a captured graph's nodes");
  std::vector<cudaGraphNode_t> nodes(count);
  if (count > 0) TORPOR_CUDA_CHECK(cudaGraphGetNodes(graph, nodes.data(), &count), "listing a captured graph's nodes");
  std::size_t found = 0;
  for (std::size_t i = 0; i < count; ++i) {
    cudaGraphNodeType type{};
    TORPOR_CUDA_CHECK(cudaGraphNodeGetType(nodes[i], &type), "the type of a captured graph's node");
    if (type == cudaGraphNodeTypeMemAlloc || type == cudaGraphNodeTypeMemFree) {
      ++found;
    } else if (type == cudaGraphNodeTypeGraph) {
      cudaGraph_t child = nullptr;
      TORPOR_CUDA_CHECK(cudaGraphChildGraphNodeGetGraph(nodes[i], &child), "a child graph of a captured graph");
      found += graph_memory_nodes(child);
    }
  }
  return found;
}

GraphAllocatorBytes graph_allocator_bytes(int device) {
  GraphAllocatorBytes b;
  unsigned long long used = 0, reserved = 0;  // the attributes' value type is cuuint64_t
  TORPOR_CUDA_CHECK(cudaDeviceGetGraphMemAttribute(device, cudaGraphMemAttrUsedMemCurrent, &used),
                    fmt::format("graph allocator bytes in use on device {}", device));
  TORPOR_CUDA_CHECK(cudaDeviceGetGraphMemAttribute(device, cudaGraphMemAttrReservedMemCurrent, &reserved),
                    fmt::format("graph allocator bytes reserved on device {}", device));
  b.used = static_cast<std::size_t>(used);
  b.reserved = static_cast<std::size_t>(reserved);
  return b;
}

DeviceGuard::DeviceGuard(int device) {
  int current = -1;
  TORPOR_CUDA_CHECK(cudaGetDevice(&current), fmt::format("making device {} current", device));
  if (current != device) {
    TORPOR_CUDA_CHECK(cudaSetDevice(device), fmt::format("making device {} current", device));
    previous_ = current;
  }
}

DeviceGuard::~DeviceGuard() {
  if (previous_ < 0) return;
  cudaError_t e = cudaSetDevice(previous_);
  if (e != cudaSuccess) log::error("restoring device {} as current failed: {}", previous_, cudaGetErrorString(e));
}

}  // namespace torpor::fusion::detail
