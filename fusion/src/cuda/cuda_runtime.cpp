// See cuda_runtime.hpp.
#include "cuda_runtime.hpp"

#include <fmt/core.h>

#include <cstdint>

#include "common/error_kind.hpp"
#include "torpor/error.hpp"
#include "torpor/log.hpp"
#include "torpor/torpor.h"

namespace torpor::fusion::detail {

void cuda_check(cudaError_t e, const char* call, const std::string& what) {
  if (e == cudaSuccess) return;
  throw error(fmt::format("{} failed: {} ({}) [{}]", call, cudaGetErrorName(e), cudaGetErrorString(e), what));
}

namespace {

// A status of libtorpor's C API as its exception type, with the entry's message.
void check_torpor(torpor_status s, const std::string& what) {
  if (s == TORPOR_OK) return;
  raise_error_kind(error_kind_of_status(s).value_or(ErrorKind::internal),
                   fmt::format("{} [{}]", torpor_last_error(), what));
}

}  // namespace

std::size_t graph_memory_nodes(cudaGraph_t graph) {
  // A cudaGraph_t is the driver's CUgraph, which the entry takes as an integer.
  std::size_t count = 0;
  check_torpor(torpor_graph_memory_nodes(reinterpret_cast<std::uintptr_t>(graph), &count),
               "the memory nodes of a captured graph");
  return count;
}

GraphAllocatorBytes graph_allocator_bytes(int device) {
  unsigned long long used = 0, reserved = 0;
  check_torpor(torpor_graph_memory(device, &used, &reserved),
               fmt::format("graph allocator bytes on device {}", device));
  GraphAllocatorBytes b;
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
