// The interposed cudaMalloc and cudaFree (preload.hpp): a region's allocation goes to the torch
// pool of the current device under the thread's tag and class; everything else to the runtime.
#include <fmt/core.h>

#include <cstdint>
#include <exception>
#include <mutex>
#include <string>

#include "preload.hpp"
#include "torpor/torch_allocator.h"

using namespace torpor::preload;  // for the C entry points below, outside the namespace

extern "C" {

__attribute__((visibility("default"))) cuda_error cudaMalloc(void** ptr, size_t size) {
  Runtime& rt = runtime();
  ThreadConfig& config = thread_config();
  if (!config.is_interesting() || size == 0) {
    malloc_fn real = rt.malloc();
    return real == nullptr ? cuda_error_unknown : real(ptr, size);  // unknown: no runtime after this library
  }
  if (ptr == nullptr) return cuda_error_invalid_value;
  bool cpu = config.enable_cpu_backup();
  bool disk = config.enable_disk_backup();
  if (cpu && disk) {
    say("cudaMalloc in a region with both a CPU and a disk backup: they are mutually exclusive");
    return cuda_error_invalid_value;
  }
  int device = 0;
  if (get_device_fn get = rt.get_device()) {
    cuda_error e = get(&device);
    if (e != cuda_success) return e;
  }
  if (disk) {
    std::lock_guard lock(state().mu);
    try {
      // TMS_DISK_BACKUP_DIR (or /tmp) unless tms_set_disk_backup_dir chose one
      if (state().disk_dir.empty() && !state().disk_refused) configure_disk(torpor::options::tms_disk_backup_dir());
    } catch (const std::exception& e) {
      say(e.what());
    }
  }
  // torpor_torch_malloc allocates in the thread's torpor tag and class: set them for this call
  // only, so that torpor.torch's own routing on this thread is left as it was.
  std::string saved_tag = torpor_current_tag();
  int saved_class = torpor_current_class();
  torpor_set_current_tag(config.tag.c_str());
  torpor_set_current_class(cpu || disk ? TORPOR_CLASS_STATE : TORPOR_CLASS_CACHE);
  void* p = torpor_torch_malloc(size, device, nullptr);
  std::string error = p == nullptr ? torpor_last_error() : "";
  torpor_set_current_tag(saved_tag.c_str());
  torpor_set_current_class(saved_class);
  if (p == nullptr) {
    say(fmt::format("cudaMalloc of {} bytes in tag '{}' on device {}: {}", size, config.tag, device, error));
    return cuda_error_memory_allocation;
  }
  State& s = state();
  std::lock_guard lock(s.mu);
  s.allocations[reinterpret_cast<std::uintptr_t>(p)] =
      Allocation{device, size, config.tag, cpu, disk, cpu ? config.cpu_backup_backend() : std::string()};
  *ptr = p;
  return cuda_success;
}

__attribute__((visibility("default"))) cuda_error cudaFree(void* ptr) {
  State& s = state();
  Allocation a;
  Slot slot;
  {
    std::lock_guard lock(s.mu);
    auto it = s.allocations.find(reinterpret_cast<std::uintptr_t>(ptr));
    if (it == s.allocations.end()) {
      free_fn real = runtime().free();
      return real == nullptr ? cuda_error_unknown : real(ptr);
    }
    a = it->second;
    s.allocations.erase(it);
    auto sl = s.slots.find(reinterpret_cast<std::uintptr_t>(ptr));
    if (sl != s.slots.end()) {
      slot = sl->second;
      s.slots.erase(sl);
    }
  }
  release_slot(slot);
  // Waits for the device's queued work first, as cudaFree does. Only this call's failure counts.
  unsigned long long before = torpor_torch_failures(nullptr);
  torpor_torch_free(ptr, a.bytes, a.device, nullptr);
  torpor_status last = TORPOR_OK;
  bool failed = torpor_torch_failures(&last) != before;
  return failed ? status_error(last) : cuda_success;
}

}  // extern "C"
