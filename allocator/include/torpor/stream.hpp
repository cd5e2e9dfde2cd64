// torpor::Stream: an ordered queue of work on one device, as the driver seam creates it
// (Driver::stream_create).
//
// One stream type crosses every boundary above the driver: the Driver seam, fusion's Tail and
// Compute, and the kernel launchers of kernels/ all take a Stream, never a void* or a
// cudaStream_t. Why this one: it is what the seam hands out, it names its device (so a caller can
// check that work goes where it belongs), and a header that takes it needs no CUDA header. Only
// code that calls CUDA itself converts it to the native handle (kernels::native, in
// torpor/kernels/native_stream.hpp): on the cuda backend `value` is the CUstream, the same object
// as the runtime's cudaStream_t.
//
// This header stays C++17 (no <span>): the CUDA kernels, compiled as C++17, include it.
#pragma once

#include <cstdint>

namespace torpor {

struct Stream {
  // 0 is not a stream of the seam (use Driver::stream_create); a kernel launcher, and Tail::run on
  // a GPU, read it as CUDA's default stream.
  std::uint64_t value = 0;
  int device = 0;
  explicit operator bool() const noexcept { return value != 0; }
};

}  // namespace torpor
