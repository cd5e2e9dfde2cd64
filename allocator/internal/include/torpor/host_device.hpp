// TORPOR_HD marks a small function that runs on the CPU and, when nvcc compiles the including
// file, on the GPU too (inlined there): the content hash and the MoE tail's arithmetic are
// written once for both, so the CPU and the GPU compute the same bits.
#pragma once

#if defined(__CUDACC__)
#define TORPOR_HD __host__ __device__ __forceinline__
#else
#define TORPOR_HD inline
#endif
