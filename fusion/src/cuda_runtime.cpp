// See cuda_runtime.hpp.
#include "cuda_runtime.hpp"

#include <fmt/format.h>

#include "torpor/error.hpp"
#include "torpor/log.hpp"

namespace torpor::fusion::detail {

void cuda_check(cudaError_t e, const char* call, const std::string& what) {
  if (e == cudaSuccess) return;
  throw error(fmt::format("{} failed: {} ({}) [{}]", call, cudaGetErrorName(e), cudaGetErrorString(e), what));
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
