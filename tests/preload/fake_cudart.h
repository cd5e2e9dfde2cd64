// A stand-in for the CUDA runtime's memory calls, for testing libtorpor_preload.so without CUDA:
// the test program links this library as it would link libcudart, and runs with the preload
// library on LD_PRELOAD, so cudaMalloc / cudaFree resolve to the interposer and its
// dlsym(RTLD_NEXT) finds these. "Device" memory here is plain host memory, counted.
#pragma once

#include <cstddef>

extern "C" {
int cudaMalloc(void** ptr, size_t size);
int cudaFree(void* ptr);
int cudaGetDevice(int* device);
int cudaMallocHost(void** ptr, size_t size);
int cudaFreeHost(void* ptr);
// Success for a pointer inside a live cudaMallocHost block; invalid value (recorded) otherwise.
int cudaHostGetFlags(unsigned int* flags, void* host);
int cudaGetLastError();
// What the fake holds: live cudaMalloc'd blocks, live cudaMallocHost'd blocks.
size_t fake_cudart_live_device_blocks();
size_t fake_cudart_live_host_blocks();
// Whether `ptr` is a live cudaMallocHost block (cudaHostGetFlags succeeding, for the tests).
bool fake_cudart_is_host_block(const void* ptr);
}
