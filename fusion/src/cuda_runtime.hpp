// CUDA runtime helpers for the fusion layer (built with TORPOR_CUDA only): a checked call that
// throws torpor::error naming the call, the CUDA error and what it was for, and a guard that makes
// a device current for a scope and restores the caller's device afterwards.
#pragma once

#if !defined(TORPOR_KERNELS_CUDA)
#error "cuda_runtime.hpp is for CUDA builds only"
#endif

#include <cuda_runtime.h>

#include <string>

namespace torpor::fusion::detail {

// Throws torpor::error: "<call> failed: cudaErrorX (text) [<what>]".
void cuda_check(cudaError_t e, const char* call, const std::string& what);

#define TORPOR_CUDA_CHECK(call, what) ::torpor::fusion::detail::cuda_check((call), #call, (what))

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
