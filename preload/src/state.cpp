// The library's shared state (preload.hpp): the allocation map, the host slots behind
// tms_get_cpu_backup_pointer, the disk tier, and pause / resume as torpor sleeps and wakes of the
// allocations' tags.
#include <fmt/core.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "preload.hpp"
#include "torpor/torch_allocator.h"

namespace torpor::preload {

State& state() {
  static State* s = new State;  // never destroyed (preload.hpp)
  return *s;
}

void release_slot(Slot& slot) {
  if (slot.host == nullptr) return;
  if (slot.pinned)
    runtime().free_host()(slot.host);
  else
    munmap(slot.host, slot.bytes);
  slot = Slot{};
}

bool make_slot(Slot& slot, size_t bytes, const std::string& backend) {
  if (backend == "pinned" && runtime().malloc_host() != nullptr && runtime().free_host() != nullptr) {
    void* p = nullptr;
    if (runtime().malloc_host()(&p, bytes) == cuda_success && p != nullptr) {
      slot = Slot{p, bytes, true};
      return true;
    }
    say(fmt::format("cudaMallocHost of {} bytes for a CPU backup slot failed: using pageable memory", bytes));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    say(fmt::format("mmap of {} bytes for a CPU backup slot failed: {}", bytes, std::strerror(errno)));
    return false;
  }
  slot = Slot{p, bytes, false};
  return true;
}

torpor_pool_t device_pool(int device) {
  torpor_pool_t pool = nullptr;
  if (torpor_torch_pool(device, &pool) != TORPOR_OK) {
    say(fmt::format("no torpor pool for device {}: {}", device, torpor_last_error()));
    return nullptr;
  }
  return pool;
}

bool refill(std::uintptr_t base, const Allocation& a, Slot& slot) {
  torpor_pool_t pool = device_pool(a.device);
  if (pool == nullptr) return false;
  int asleep = 0;
  return torpor_read_host_copy(pool, reinterpret_cast<void*>(base), a.bytes, slot.host, &asleep) == TORPOR_OK;
}

namespace {

// Every slot refilled from its pool's host copy, or released where there is none.
void refill_slots() {
  State& s = state();
  std::lock_guard lock(s.mu);
  for (auto it = s.slots.begin(); it != s.slots.end();) {
    auto a = s.allocations.find(it->first);
    if (a == s.allocations.end() || !refill(it->first, a->second, it->second)) {
      release_slot(it->second);
      it = s.slots.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace

// The disk tier: torch_memory_saver's directory is process-wide; torpor's tier is the pools'.
void configure_disk(const std::string& dir) {
  State& s = state();
  if (s.disk_dir == dir) return;
  torpor_pool_options o;
  torpor_pool_options_init(&o);
  o.host_store_limit = 1;  // below one store block: every backup goes to the disk tier
  o.spill_dir = dir.c_str();
  o.spill_file_per_allocation = 1;  // as torch_memory_saver: a file per disk-backed allocation
  if (torpor_torch_configure(&o) != TORPOR_OK) {
    say(fmt::format("disk backup into '{}' needs torpor's pools configured before their first allocation, and they "
                    "hold memory already ({}); set TMS_DISK_BACKUP_DIR or call set_disk_backup_dir first. Backups "
                    "stay in host memory",
                    dir, torpor_last_error()));
    s.disk_refused = true;
    return;
  }
  s.disk_dir = dir;
}

cuda_error status_error(torpor_status s) {
  if (s == TORPOR_OK) return cuda_success;
  if (s == TORPOR_ERROR_OUT_OF_MEMORY) return cuda_error_memory_allocation;
  if (s == TORPOR_ERROR_INVALID_ARGUMENT) return cuda_error_invalid_value;
  return cuda_error_unknown;
}

namespace {

// The tags of `tag` ("" = every tag this library allocated in) per device with live allocations.
std::map<int, std::vector<std::string>> tags_by_device(const std::string& tag) {
  State& s = state();
  std::lock_guard lock(s.mu);
  std::map<int, std::set<std::string>> found;
  for (const auto& [base, a] : s.allocations)
    if (tag.empty() || a.tag == tag) found[a.device].insert(a.tag);
  std::map<int, std::vector<std::string>> out;
  for (auto& [device, tags] : found) out[device] = {tags.begin(), tags.end()};
  return out;
}

}  // namespace

cuda_error sleep_or_wake(const std::string& tag, bool sleep) {
  cuda_error result = cuda_success;
  for (const auto& [device, tags] : tags_by_device(tag)) {
    torpor_pool_t pool = device_pool(device);
    if (pool == nullptr) return cuda_error_unknown;
    std::vector<const char*> names;
    for (const std::string& t : tags) names.push_back(t.c_str());
    torpor_status st =
        sleep ? torpor_sleep(pool, 1, names.data(), names.size()) : torpor_wake_up(pool, names.data(), names.size());
    if (st != TORPOR_OK) {
      say(fmt::format("{} of device {} failed: {}", sleep ? "tms_pause" : "tms_resume", device, torpor_last_error()));
      result = status_error(st);
      continue;
    }
    if (!sleep && !state().retain.load()) torpor_release_host_store(pool, nullptr);
  }
  refill_slots();
  return result;
}

}  // namespace torpor::preload
