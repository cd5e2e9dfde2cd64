// torch_memory_saver's C entry points (preload.hpp): the region settings, pause and resume, the
// CPU backup pointer, with torch_memory_saver's names and signatures.
#include <fmt/core.h>

#include <cstdint>
#include <mutex>
#include <string>

#include "preload.hpp"
#include "torpor/torch_allocator.h"

using namespace torpor::preload;  // for the C entry points below, outside the namespace

extern "C" {

__attribute__((visibility("default"))) void tms_set_interesting_region(bool is_interesting_region) {
  thread_config().interesting = is_interesting_region;
}

__attribute__((visibility("default"))) bool tms_get_interesting_region() { return thread_config().is_interesting(); }

__attribute__((visibility("default"))) void tms_set_current_tag(const char* tag) {
  if (tag == nullptr || *tag == '\0') {
    say("tms_set_current_tag: the tag is null or empty (kept the current one)");
    return;
  }
  thread_config().tag = tag;
}

__attribute__((visibility("default"))) const char* tms_get_current_tag() { return thread_config().tag.c_str(); }

__attribute__((visibility("default"))) bool tms_get_enable_cpu_backup() { return thread_config().enable_cpu_backup(); }

__attribute__((visibility("default"))) void tms_set_enable_cpu_backup(bool enable_cpu_backup) {
  thread_config().cpu_backup = enable_cpu_backup;
}

__attribute__((visibility("default"))) const char* tms_get_cpu_backup_backend() {
  return thread_config().cpu_backup_backend().c_str();
}

__attribute__((visibility("default"))) void tms_set_cpu_backup_backend(const char* backend) {
  std::string b = backend == nullptr || *backend == '\0' ? "pinned" : backend;  // TMS: empty = default
  if (b != "pinned" && b != "mmap") {
    say(fmt::format("tms_set_cpu_backup_backend: '{}' is not mmap or pinned (kept '{}')", b,
                    thread_config().cpu_backup_backend()));
    return;
  }
  thread_config().backend = b;
}

__attribute__((visibility("default"))) bool tms_get_enable_disk_backup() {
  return thread_config().enable_disk_backup();
}

__attribute__((visibility("default"))) void tms_set_enable_disk_backup(bool enable_disk_backup) {
  thread_config().disk_backup = enable_disk_backup;
}

__attribute__((visibility("default"))) void tms_set_disk_backup_dir(const char* dir) {
  if (dir == nullptr || *dir == '\0') {
    say("tms_set_disk_backup_dir: the directory is null or empty");
    return;
  }
  std::lock_guard lock(state().mu);
  configure_disk(dir);
}

__attribute__((visibility("default"))) void set_memory_margin_bytes(std::uint64_t value) {
  if (torpor_torch_set_memory_margin(static_cast<size_t>(value)) != TORPOR_OK)
    say(fmt::format("set_memory_margin_bytes: {}", torpor_last_error()));
}

__attribute__((visibility("default"))) void tms_set_retain_cpu_backup(bool retain_cpu_backup) {
  state().retain.store(retain_cpu_backup);
}

__attribute__((visibility("default"))) bool tms_get_retain_cpu_backup() { return state().retain.load(); }

__attribute__((visibility("default"))) int tms_pause(const char* tag) {
  return sleep_or_wake(tag == nullptr ? "" : tag, true);
}

__attribute__((visibility("default"))) int tms_resume(const char* tag) {
  return sleep_or_wake(tag == nullptr ? "" : tag, false);
}

__attribute__((visibility("default"))) std::uint8_t* tms_get_cpu_backup_pointer(const std::uint8_t* gpu_ptr,
                                                                                std::uint64_t size) {
  State& s = state();
  std::lock_guard lock(s.mu);
  auto q = reinterpret_cast<std::uintptr_t>(gpu_ptr);
  auto it = s.allocations.upper_bound(q);
  if (it == s.allocations.begin() || (--it, q + size > it->first + it->second.bytes)) {
    say(fmt::format("tms_get_cpu_backup_pointer: [{:#x}, +{}) is not inside an allocation of a region", q, size));
    return nullptr;
  }
  const Allocation& a = it->second;
  if (a.disk_backup) return nullptr;  // as torch_memory_saver: no CPU copy of a disk backup
  auto [slot, fresh] = s.slots.try_emplace(it->first);
  if (fresh && !make_slot(slot->second, a.bytes, a.backend)) {
    s.slots.erase(slot);
    return nullptr;
  }
  if (!refill(it->first, a, slot->second)) {
    if (!a.cpu_backup) say(fmt::format("tms_get_cpu_backup_pointer: {:#x} was allocated without a CPU backup", q));
    release_slot(slot->second);
    s.slots.erase(slot);
    return nullptr;  // awake without a retained copy (or no backup at all)
  }
  return static_cast<std::uint8_t*>(slot->second.host) + (q - it->first);
}

}  // extern "C"
