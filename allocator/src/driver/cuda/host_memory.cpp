// CudaDriver's host memory: page-locked blocks (cuMemHostAlloc) and page-locked ranges of
// existing memory (cuMemHostRegister), both portable, so every device's context can copy to and
// from them at link speed.
//
// The calls run in the caller's current context when it has one, else in the primary context
// of the device named (a store's pinning thread that never touched CUDA must not create device
// 0's context in a process that uses another device).
#include "driver/cuda/library.hpp"

namespace torpor {

void* CudaDriver::host_alloc(std::size_t bytes) {
  Impl& d = *impl_;
  auto context = d.ensure_context("cuMemHostAlloc");
  void* p = nullptr;
  d.check(d.cuMemHostAlloc_(&p, bytes, CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc", fmt::format("size {}", bytes));
  return p;
}

void CudaDriver::host_free(void* p) {
  impl_->call_in_context("cuMemFreeHost", fmt::format("{}", p), impl_->cuMemFreeHost_, p);
}

void CudaDriver::host_register(void* p, std::size_t bytes, int device) {
  Impl& d = *impl_;
  auto context = d.ensure_context_on(device, "cuMemHostRegister");
  d.check(d.cuMemHostRegister_(p, bytes, CU_MEMHOSTREGISTER_PORTABLE), "cuMemHostRegister",
          fmt::format("{} size {}", p, bytes));
}

void CudaDriver::host_unregister(void* p, int device) {
  Impl& d = *impl_;
  auto context = d.ensure_context_on(device, "cuMemHostUnregister");
  d.check(d.cuMemHostUnregister_(p), "cuMemHostUnregister", fmt::format("{}", p));
}

}  // namespace torpor
