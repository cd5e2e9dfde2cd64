// CudaDriver's streams, copies and events.
//
// A Stream's value is the CUstream this driver created (non-blocking, so it never waits for the
// legacy default stream), an Event's the CUevent (timing disabled); both name their device, and
// every call on them runs in that device's primary context. Copies go through cuMemcpyAsync in
// any direction: host and device pointers share one address space.
#include "driver/cuda/library.hpp"

namespace torpor {

using cuda::cu;

// A Stream's value is the CUstream this driver created (stream_create).
void* CudaDriver::native_stream(Stream s) { return reinterpret_cast<void*>(static_cast<std::uintptr_t>(s.value)); }

Stream CudaDriver::stream_create(int device) {
  return impl_->create_on<Stream, CUstream>(device, "cuStreamCreate", impl_->cuStreamCreate_, CU_STREAM_NON_BLOCKING);
}

void CudaDriver::stream_destroy(Stream s) {
  impl_->call_on(s.device, "cuStreamDestroy", "", impl_->cuStreamDestroy_, cu(s));
}

void CudaDriver::copy_async(void* dst, const void* src, std::size_t bytes, Stream s) {
  impl_->call_on(s.device, "cuMemcpyAsync", fmt::format("dst {} src {} size {}", dst, src, bytes),
                 impl_->cuMemcpyAsync_, reinterpret_cast<CUdeviceptr>(dst), reinterpret_cast<CUdeviceptr>(src), bytes,
                 cu(s));
}

void CudaDriver::fill_async(device_ptr dst, std::uint8_t value, std::size_t bytes, Stream s) {
  impl_->call_on(s.device, "cuMemsetD8Async", fmt::format("dst {:#x} size {}", dst, bytes), impl_->cuMemsetD8Async_,
                 static_cast<CUdeviceptr>(dst), value, bytes, cu(s));
}

void CudaDriver::stream_synchronize(Stream s) {
  impl_->call_on(s.device, "cuStreamSynchronize", "", impl_->cuStreamSynchronize_, cu(s));
}

void CudaDriver::device_synchronize(int device) {
  impl_->call_on(device, "cuCtxSynchronize", fmt::format("device {}", device), impl_->cuCtxSynchronize_);
}

Event CudaDriver::event_create(int device) {
  return impl_->create_on<Event, CUevent>(device, "cuEventCreate", impl_->cuEventCreate_, CU_EVENT_DISABLE_TIMING);
}

void CudaDriver::event_destroy(Event e) {
  impl_->call_on(e.device, "cuEventDestroy", "", impl_->cuEventDestroy_, cu(e));
}

void CudaDriver::event_record(Event e, Stream s) {
  impl_->call_on(s.device, "cuEventRecord", "", impl_->cuEventRecord_, cu(e), cu(s));
}

void CudaDriver::stream_wait_event(Stream s, Event e) {
  impl_->call_on(s.device, "cuStreamWaitEvent", "", impl_->cuStreamWaitEvent_, cu(s), cu(e), 0);
}

void CudaDriver::event_synchronize(Event e) {
  impl_->call_on(e.device, "cuEventSynchronize", "", impl_->cuEventSynchronize_, cu(e));
}

}  // namespace torpor
