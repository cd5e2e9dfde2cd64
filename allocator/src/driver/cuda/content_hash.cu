// Device kernels for torpor::content_hash (see content_hash.hpp for the definition).
// Compiled to a fatbin, embedded in libtorpor and loaded by CudaDriver with cuModuleLoadData,
// so the allocator needs no CUDA runtime.
//
// One launch hashes many ranges: the host gives each range a block count (ceil(bytes / slice));
// block b finds its range by binary search over the ranges' first block, sums the mixed words
// of its slice (16-byte loads when the range is 16-byte aligned) and adds its two partial sums
// into the range's accumulators with 64-bit atomics. Addition mod 2^64 is exact in any order,
// so the result is deterministic and equal to the CPU reference. A second kernel finalizes.
#include "torpor/content_hash.hpp"

namespace {

struct HashJob {
  const unsigned char* ptr;
  unsigned long long bytes;
  unsigned long long first_block;
};

__device__ unsigned long long load_word(const unsigned char* p, unsigned long long word, unsigned long long bytes) {
  unsigned long long start = word * 8;
  if (start + 8 <= bytes && (reinterpret_cast<unsigned long long>(p) & 7) == 0)
    return *reinterpret_cast<const unsigned long long*>(p + start);
  unsigned long long w = 0;
  for (int i = 0; i < 8 && start + i < bytes; ++i) w |= static_cast<unsigned long long>(p[start + i]) << (8 * i);
  return w;
}

}  // namespace

extern "C" __global__ void __launch_bounds__(256)
    torpor_hash_partial(const HashJob* jobs, unsigned n_jobs, unsigned long long slice_bytes,
                        unsigned long long* sums) {
  // Find the job whose block range holds this block.
  unsigned lo = 0, hi = n_jobs;
  unsigned long long block = blockIdx.x;
  while (hi - lo > 1) {
    unsigned mid = (lo + hi) / 2;
    if (jobs[mid].first_block <= block)
      lo = mid;
    else
      hi = mid;
  }
  const HashJob job = jobs[lo];
  unsigned long long begin = (block - job.first_block) * slice_bytes;
  unsigned long long end = begin + slice_bytes < job.bytes ? begin + slice_bytes : job.bytes;
  unsigned long long a = 0, b = 0;
  if ((reinterpret_cast<unsigned long long>(job.ptr) & 15) == 0) {
    // Pairs of words through 16-byte loads; the slice is a multiple of 16 bytes.
    unsigned long long pair_end = end / 16;
    for (unsigned long long pair = begin / 16 + threadIdx.x; pair < pair_end; pair += blockDim.x) {
      ulonglong2 v = reinterpret_cast<const ulonglong2*>(job.ptr)[pair];
      a += torpor::content_hash::lane_a(v.x, 2 * pair) + torpor::content_hash::lane_a(v.y, 2 * pair + 1);
      b += torpor::content_hash::lane_b(v.x, 2 * pair) + torpor::content_hash::lane_b(v.y, 2 * pair + 1);
    }
    // The range's last (partial) pair.
    unsigned long long tail_word = pair_end * 2;
    unsigned long long words_end = (end + 7) / 8;
    for (unsigned long long w = tail_word + threadIdx.x; w < words_end; w += blockDim.x) {
      unsigned long long v = load_word(job.ptr, w, job.bytes);
      a += torpor::content_hash::lane_a(v, w);
      b += torpor::content_hash::lane_b(v, w);
    }
  } else {
    unsigned long long words_end = (end + 7) / 8;
    for (unsigned long long w = begin / 8 + threadIdx.x; w < words_end; w += blockDim.x) {
      unsigned long long v = load_word(job.ptr, w, job.bytes);
      a += torpor::content_hash::lane_a(v, w);
      b += torpor::content_hash::lane_b(v, w);
    }
  }
  // Warp, then block reduction; one pair of atomics per block.
  for (int offset = 16; offset > 0; offset /= 2) {
    a += __shfl_down_sync(0xffffffffu, a, offset);
    b += __shfl_down_sync(0xffffffffu, b, offset);
  }
  __shared__ unsigned long long sa[8], sb[8];
  unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    sa[warp] = a;
    sb[warp] = b;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long ta = 0, tb = 0;
    for (unsigned w = 0; w < blockDim.x / 32; ++w) {
      ta += sa[w];
      tb += sb[w];
    }
    atomicAdd(&sums[2 * lo], ta);
    atomicAdd(&sums[2 * lo + 1], tb);
  }
}

extern "C" __global__ void torpor_hash_finalize(const HashJob* jobs, unsigned n_jobs, const unsigned long long* sums,
                                                torpor::Hash128* out) {
  unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n_jobs) out[i] = torpor::content_hash::finalize(sums[2 * i], sums[2 * i + 1], jobs[i].bytes);
}
