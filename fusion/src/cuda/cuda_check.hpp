// Checking CUDA runtime and cuBLAS results: every call's status becomes a typed torpor error
// naming the call, what it was for and the status (out of memory -> out_of_memory; anything else
// -> driver_error carrying the numeric status). Only the CUDA compute includes this.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string_view>

namespace torpor::fusion {

void check_cuda(cudaError_t status, const char* call, std::string_view what);
void check_cublas(cublasStatus_t status, const char* call, std::string_view what);
// A kernel launcher's result (kernels::gpu::*: a cudaError_t as int).
void check_launch(int status, const char* kernel, std::string_view what);

}  // namespace torpor::fusion
