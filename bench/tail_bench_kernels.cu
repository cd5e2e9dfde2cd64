// The link measurement of the tail bench: SM stores into a peer's memory through its mapping,
// the same path the fused tail's partials take (16-byte stores, grid-stride).
#include <cuda_runtime.h>

#include <cstddef>
#include <stdexcept>
#include <string>

namespace torpor::bench {

namespace {
__global__ void peer_store_kernel(uint4* dst, const uint4* src, std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n; i += stride) dst[i] = src[i];
}
}  // namespace

void launch_peer_store(void* dst, const void* src, std::size_t bytes, int blocks, void* stream) {
  peer_store_kernel<<<blocks, 512, 0, static_cast<cudaStream_t>(stream)>>>(static_cast<uint4*>(dst),
                                                                           static_cast<const uint4*>(src), bytes / 16);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string("peer_store_kernel: ") + cudaGetErrorString(e));
}

}  // namespace torpor::bench
