// The fake runtime of fake_cudart.h: malloc'd blocks in two counted sets.
#include "fake_cudart.h"

#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>

namespace {
std::mutex mu;
std::set<const void*>& device_blocks() {
  static std::set<const void*> s;
  return s;
}
std::map<const void*, size_t>& host_blocks() {  // base -> bytes
  static std::map<const void*, size_t> s;
  return s;
}
// The live cudaMallocHost block holding `ptr` (interior pointers too, as the runtime's), or end.
std::map<const void*, size_t>::iterator host_block_of(const void* ptr) {
  auto& blocks = host_blocks();
  auto it = blocks.upper_bound(ptr);
  if (it == blocks.begin()) return blocks.end();
  --it;
  auto p = reinterpret_cast<std::uintptr_t>(ptr), base = reinterpret_cast<std::uintptr_t>(it->first);
  return p < base + it->second ? it : blocks.end();
}
int last_error = 0;
constexpr int success = 0;
constexpr int invalid_value = 1;
constexpr int memory_allocation = 2;
}  // namespace

extern "C" {
int cudaMalloc(void** ptr, size_t size) {
  if (ptr == nullptr) return invalid_value;
  void* p = std::malloc(size == 0 ? 1 : size);
  if (p == nullptr) return memory_allocation;
  std::lock_guard lock(mu);
  device_blocks().insert(p);
  *ptr = p;
  return success;
}
int cudaFree(void* ptr) {
  if (ptr == nullptr) return success;
  std::lock_guard lock(mu);
  if (device_blocks().erase(ptr) == 0) return invalid_value;
  std::free(ptr);
  return success;
}
int cudaGetDevice(int* device) {
  if (device == nullptr) return invalid_value;
  *device = 0;
  return success;
}
int cudaMallocHost(void** ptr, size_t size) {
  void* p = std::malloc(size == 0 ? 1 : size);
  if (p == nullptr) return memory_allocation;
  std::lock_guard lock(mu);
  host_blocks()[p] = size == 0 ? 1 : size;
  *ptr = p;
  return success;
}
int cudaFreeHost(void* ptr) {
  std::lock_guard lock(mu);
  if (host_blocks().erase(ptr) == 0) return invalid_value;
  std::free(ptr);
  return success;
}
size_t fake_cudart_live_device_blocks() {
  std::lock_guard lock(mu);
  return device_blocks().size();
}
size_t fake_cudart_live_host_blocks() {
  std::lock_guard lock(mu);
  return host_blocks().size();
}
bool fake_cudart_is_host_block(const void* ptr) {
  std::lock_guard lock(mu);
  return host_blocks().count(ptr) != 0;
}
int cudaHostGetFlags(unsigned int* flags, void* host) {
  std::lock_guard lock(mu);
  if (flags == nullptr || host_block_of(host) == host_blocks().end()) {
    last_error = invalid_value;
    return invalid_value;
  }
  *flags = 0;  // cudaHostAllocDefault: what cudaMallocHost gives
  return success;
}
int cudaGetLastError() {
  std::lock_guard lock(mu);
  int e = last_error;
  last_error = 0;
  return e;
}
}
