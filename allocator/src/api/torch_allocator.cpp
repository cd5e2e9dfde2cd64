// The PyTorch pluggable-allocator entry points (torpor/torch_allocator.h).
//
// Design: PyTorch's caching allocator asks for whole segments (2 MiB and up) and carves tensors
// out of them itself; torpor only ever sees segments. Each one is a torpor allocation in the
// calling thread's current (tag, class), made through the C API in the pool of its device. The
// per-device pools are created lazily, under one mutex, and live until the process ends
// (PyTorch may free segments from static destructors). The hot path is one map lookup under
// that mutex plus torpor_alloc: segments are large and rare, so nothing cleverer is needed.
//
// Invariants: no exception leaves an entry point; every failure sets torpor_last_error() and
// counts in torpor_torch_failures(); a free never unmaps memory the device may still be using
// (it synchronizes the device first, and frees nothing when that fails).
#include "torpor/torch_allocator.h"

#include <fmt/core.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "api/c_api_internal.hpp"
#include "api/c_enums.hpp"
#include "api/c_pool_options.hpp"
#include "torpor/backend.hpp"
#include "torpor/log.hpp"

namespace {

using torpor::detail::set_last_error;

struct DevicePool {
  torpor_pool_t handle = nullptr;
  std::shared_ptr<torpor::Driver> driver;  // the driver the pool uses (shared_driver's)
};

struct DevicePools {
  std::mutex mu;
  torpor_pool_options options{};
  std::string spill_dir;  // options.spill_dir points here (or is NULL)
  std::map<int, DevicePool> pools;
};

// Never destroyed: PyTorch may free segments while static destructors run at exit.
DevicePools& device_pools() {
  static DevicePools* d = [] {
    auto* p = new DevicePools;
    torpor_pool_options_init(&p->options);
    return p;
  }();
  return *d;
}

// torpor_torch_set_memory_margin's value; read on every segment allocation.
std::atomic<std::size_t> memory_margin{0};

// NOLINTNEXTLINE(bugprone-throwing-static-initialization): seven characters fit the string's own buffer
thread_local std::string current_tag{"default"};
thread_local int current_class = TORPOR_CLASS_STATE;
thread_local unsigned long long failures = 0;
thread_local torpor_status last_failure = TORPOR_OK;

void failed(torpor_status s) {
  ++failures;
  last_failure = s;
}

// The C enums as the C API reads and names them (api/c_enums.hpp).
const char* class_name(int c) {
  const char* name = torpor::detail::class_name_of(c);
  return name != nullptr ? name : "?";
}

torpor::Backend to_backend(int b) { return torpor::detail::backend_of(b).value_or(torpor::Backend::automatic); }

// The status and message for the exception being handled (common/error_kind's mapping, as the
// C API's). The C API calls do not throw: what reaches here is std::bad_alloc, or a failure of
// the driver's memory_info in the margin check.
torpor_status from_exception(const char* fn) noexcept {
  try {
    return torpor::detail::fail_with_caught(fn);
  } catch (...) {  // formatting the message ran out of memory
    return TORPOR_ERROR_OUT_OF_MEMORY;
  }
}

// Whether a new segment of `size` bytes leaves the memory margin free on `device`; sets the
// error when not.
bool margin_allows(torpor::Driver& driver, std::size_t size, int device) {
  std::size_t margin = memory_margin.load();
  if (margin == 0) return true;
  torpor::MemoryInfo info = driver.memory_info(device);
  if (info.free_bytes >= size && info.free_bytes - size >= margin) return true;
  set_last_error(fmt::format("torpor_torch_malloc({} bytes, device {}, tag '{}'): refused by the memory margin: "
                             "the device has {} bytes free and {} must stay free "
                             "(torpor_torch_set_memory_margin / memory_margin_bytes)",
                             size, device, current_tag, info.free_bytes, margin));
  return false;
}

// The pool of `device`, created when missing. Caller holds d.mu.
torpor_status get_or_create(DevicePools& d, int device, DevicePool** out) {
  auto it = d.pools.find(device);
  if (it != d.pools.end()) {
    *out = &it->second;
    return TORPOR_OK;
  }
  torpor_pool_options o = d.options;
  o.device = device;
  DevicePool slot;
  torpor_status s = torpor_pool_create(&o, &slot.handle);
  if (s != TORPOR_OK) {
    set_last_error(fmt::format("creating the torpor pool of device {}: {}", device, torpor_last_error()));
    return s;
  }
  torpor::detail::keep_for_torch(slot.handle, device);  // just created: live
  // The same driver object torpor_pool_create took (shared_driver caches one per backend).
  slot.driver = torpor::shared_driver(to_backend(o.backend)).driver;
  *out = &(d.pools[device] = std::move(slot));
  return TORPOR_OK;
}

}  // namespace

extern "C" {

void* torpor_torch_malloc(size_t size, int device, void* /*stream*/) {
  try {
    torpor_pool_t pool = nullptr;
    {
      DevicePools& d = device_pools();
      std::lock_guard lock(d.mu);
      DevicePool* slot = nullptr;
      if (torpor_status s = get_or_create(d, device, &slot); s != TORPOR_OK) {
        set_last_error(fmt::format("torpor_torch_malloc: {}", torpor_last_error()));
        failed(s);
        torpor::log::warn("{}", torpor_last_error());
        return nullptr;
      }
      pool = slot->handle;
      if (!margin_allows(*slot->driver, size, device)) {
        failed(TORPOR_ERROR_OUT_OF_MEMORY);
        torpor::log::warn("{}", torpor_last_error());
        return nullptr;
      }
    }
    void* out = nullptr;
    if (torpor_status s = torpor_alloc(pool, size, current_tag.c_str(), current_class, nullptr, &out); s != TORPOR_OK) {
      set_last_error(fmt::format("torpor_torch_malloc({} bytes, device {}, tag '{}', class {}): {}", size, device,
                                 current_tag, class_name(current_class), torpor_last_error()));
      failed(s);
      torpor::log::warn("{}", torpor_last_error());
      return nullptr;
    }
    return out;
  } catch (...) {
    failed(from_exception("torpor_torch_malloc"));
    return nullptr;
  }
}

void torpor_torch_free(void* ptr, size_t size, int device, void* /*stream*/) {
  if (ptr == nullptr) return;  // as free(NULL)
  try {
    DevicePool slot;
    {
      DevicePools& d = device_pools();
      std::lock_guard lock(d.mu);
      auto it = d.pools.find(device);
      if (it == d.pools.end()) {
        set_last_error(fmt::format("torpor_torch_free({}, {} bytes, device {}): torpor has no pool for device {}; "
                                   "the pointer was not allocated by torpor_torch_malloc",
                                   ptr, size, device, device));
        failed(TORPOR_ERROR_INVALID_ARGUMENT);
        torpor::log::warn("{}", torpor_last_error());
        return;
      }
      slot = it->second;
    }
    try {
      slot.driver->device_synchronize(device);
    } catch (const std::exception& e) {
      set_last_error(fmt::format("torpor_torch_free({}, {} bytes, device {}): not freed, because waiting for the "
                                 "device's work failed: {}",
                                 ptr, size, device, e.what()));
      failed(TORPOR_ERROR_DRIVER);
      torpor::log::warn("{}", torpor_last_error());
      return;
    }
    if (torpor_status s = torpor_free(slot.handle, ptr); s != TORPOR_OK) {
      set_last_error(
          fmt::format("torpor_torch_free({}, {} bytes, device {}): {}", ptr, size, device, torpor_last_error()));
      failed(s);
      torpor::log::warn("{}", torpor_last_error());
    }
  } catch (...) {
    failed(from_exception("torpor_torch_free"));
  }
}

torpor_status torpor_set_current_tag(const char* tag) {
  try {
    if (tag != nullptr && tag[0] == '\0') {
      set_last_error("torpor_set_current_tag: empty tag (pass NULL for \"default\")");
      return TORPOR_ERROR_INVALID_ARGUMENT;
    }
    current_tag = tag != nullptr ? tag : "default";
    return TORPOR_OK;
  } catch (...) {
    return from_exception("torpor_set_current_tag");
  }
}

const char* torpor_current_tag(void) { return current_tag.c_str(); }

torpor_status torpor_set_current_class(int memory_class) {
  if (memory_class < TORPOR_CLASS_PARAMETER || memory_class > TORPOR_CLASS_CACHE) {
    set_last_error(fmt::format("torpor_set_current_class: unknown memory class {} (expected 0 = "
                               "TORPOR_CLASS_PARAMETER, 1 = TORPOR_CLASS_STATE, 2 = TORPOR_CLASS_CACHE)",
                               memory_class));
    return TORPOR_ERROR_INVALID_ARGUMENT;
  }
  current_class = memory_class;
  return TORPOR_OK;
}

int torpor_current_class(void) { return current_class; }

torpor_status torpor_torch_pool(int device, torpor_pool_t* out) {
  if (out == nullptr) {
    set_last_error("torpor_torch_pool: out is NULL");
    return TORPOR_ERROR_INVALID_ARGUMENT;
  }
  *out = nullptr;
  try {
    DevicePools& d = device_pools();
    std::lock_guard lock(d.mu);
    DevicePool* slot = nullptr;
    torpor_status s = get_or_create(d, device, &slot);
    if (s != TORPOR_OK) {
      set_last_error(fmt::format("torpor_torch_pool: {}", torpor_last_error()));
      return s;
    }
    *out = slot->handle;
    return TORPOR_OK;
  } catch (...) {
    return from_exception("torpor_torch_pool");
  }
}

torpor_status torpor_torch_configure(const torpor_pool_options* options) {
  torpor_pool_options o;
  torpor_pool_options_init(&o);
  if (options != nullptr) o = *options;
  o.device = 0;
  try {
    // Every field checked as torpor_pool_create checks it (api/c_pool_options.hpp).
    const torpor::detail::PoolSpec wanted = torpor::detail::pool_spec_of(o);
    DevicePools& d = device_pools();
    std::lock_guard lock(d.mu);
    if (!d.pools.empty() && !torpor::detail::same_pool_spec(torpor::detail::pool_spec_of(d.options), wanted)) {
      std::string devices;
      for (auto& [dev, slot] : d.pools) devices += fmt::format("{}{}", devices.empty() ? "" : ", ", dev);
      set_last_error(fmt::format("torpor_torch_configure: the pools of device(s) {} already exist with other "
                                 "options; configure before the first allocation",
                                 devices));
      return TORPOR_ERROR_INVALID_STATE;
    }
    d.spill_dir = o.spill_dir != nullptr ? o.spill_dir : "";
    d.options = o;
    d.options.spill_dir = o.spill_dir != nullptr ? d.spill_dir.c_str() : nullptr;
    return TORPOR_OK;
  } catch (...) {
    return from_exception("torpor_torch_configure");
  }
}

torpor_status torpor_torch_set_memory_margin(size_t bytes) {
  if (bytes > TORPOR_TORCH_MEMORY_MARGIN_MAX) {
    set_last_error(fmt::format("torpor_torch_set_memory_margin: {} bytes is more than the largest margin accepted, "
                               "TORPOR_TORCH_MEMORY_MARGIN_MAX = {} bytes (0 turns the check off)",
                               bytes, TORPOR_TORCH_MEMORY_MARGIN_MAX));
    return TORPOR_ERROR_INVALID_ARGUMENT;
  }
  memory_margin.store(bytes);
  return TORPOR_OK;
}

size_t torpor_torch_memory_margin(void) { return memory_margin.load(); }

unsigned long long torpor_torch_failures(torpor_status* last_status) {
  if (last_status != nullptr) *last_status = last_failure;
  return failures;
}

}  // extern "C"
