// The CUDA handle behind a torpor::Stream, for code that calls CUDA itself (the kernels' .cu
// files, fusion's CUDA compute and CUDA tail). Everything above that code passes the Stream
// (torpor/stream.hpp says why); this is the one place the two meet.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "torpor/stream.hpp"

namespace torpor::kernels {

// On the cuda backend a Stream's value is the CUstream, the runtime's cudaStream_t; Stream{} is
// CUDA's default stream.
inline cudaStream_t native(Stream s) noexcept {
  return reinterpret_cast<cudaStream_t>(static_cast<std::uintptr_t>(s.value));
}

// The Stream of a stream made by the CUDA runtime (tests, benches), on `device`.
inline Stream from_native(cudaStream_t s, int device) noexcept {
  return Stream{static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(s)), device};
}

}  // namespace torpor::kernels
