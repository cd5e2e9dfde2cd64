// CUDA runtime helpers for the fusion layer (built with TORPOR_CUDA only): a checked call that
// throws torpor::error naming the call, the CUDA error and what it was for, a guard that makes
// a device current for a scope and restores the caller's device afterwards, and graph memory
// (the memory nodes of a captured graph, the bytes of the device's graph allocator) through
// libtorpor's one entry for it (torpor_graph_memory_nodes / torpor_graph_memory, which the
// Python package calls too): a failure throws its status's exception type.
#pragma once

#if !defined(TORPOR_KERNELS_CUDA)
#error "cuda_runtime.hpp is for CUDA builds only"
#endif

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "torpor/fusion/compute.hpp"

namespace torpor::fusion::detail {

// Throws torpor::error: "<call> failed: cudaErrorX (text) [<what>]".
void cuda_check(cudaError_t e, const char* call, const std::string& what);

#define TORPOR_CUDA_CHECK(call, what) ::torpor::fusion::detail::cuda_check((call), #call, (what))

// Memory nodes (allocation and free nodes) of `graph`, child graphs included: memory that CUDA's
// own graph allocator would own, outside every pool.
std::size_t graph_memory_nodes(cudaGraph_t graph);

// Bytes CUDA's graph allocator holds on `device` (current and reserved): the memory nodes of
// every graph of the process instantiated on that device.
GraphAllocatorBytes graph_allocator_bytes(int device);

class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();  // restores the previous device; logs (never throws) on failure
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace torpor::fusion::detail
