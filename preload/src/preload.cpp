// libtorpor_preload.so: torch_memory_saver's preload mode over torpor's pools.
//
// Put on LD_PRELOAD (torpor.tms.configure_subprocess() does), it interposes the CUDA runtime's
// cudaMalloc and cudaFree, as torch_memory_saver's preload binary does (csrc/entrypoint.cpp at
// fzyzcjy/torch_memory_saver 4a43c97, TMS_HOOK_MODE_PRELOAD: those two and no other runtime call).
// A cudaMalloc made while the calling thread is in a region (tms_set_interesting_region, or
// TMS_INIT_ENABLE for every thread from the start) goes to the torch pool of the current device
// (torpor_torch_pool: the pools torpor.tms and torpor.torch share) under the thread's tag, class
// state when the region keeps a backup (CPU or disk), cache otherwise; every other cudaMalloc,
// and every cudaFree of a pointer this library did not hand out, goes to the next definition in
// the lookup order (dlsym RTLD_NEXT: the real libcudart). It exports torch_memory_saver's C entry
// points with the same names and signatures, so its Python layer (and scripts that call them
// through ctypes) work unchanged.
//
// Invariants:
//   - the region settings are per thread, each unset one read from its TMS_* variable on first
//     use (torpor::options, the one environment table), as torch_memory_saver's ThreadLocalConfig;
//   - the allocation map is the only shared state; no torpor call runs under its lock except
//     allocation (so a pause on one thread never waits for a cudaFree on another to finish);
//   - where torch_memory_saver exits the process (pause of a paused allocation, resume of an
//     awake one, a backup pointer of unknown memory), this library is idempotent or returns an
//     error / NULL with a message on stderr: torpor's sleep and wake are idempotent;
//   - a pause is a level-1 sleep of the tags: cache bytes are discarded, state bytes offloaded to
//     torpor's host store (or its disk tier, when a disk directory configured the pools);
//   - tms_get_cpu_backup_pointer returns a host slot per allocation, of the region's backend
//     (page-locked through the runtime's cudaMallocHost, or anonymous pageable memory), filled from
//     torpor's host copy, renewed by every pause and freed by a resume without retain: the
//     address torch_memory_saver's users hold stays valid across a retained resume.
//   - nothing here includes cuda.h or cuda_runtime.h: cudaError_t is an int-sized enum, taken as int.
//   - torch_memory_saver's library links the CUDA runtime, so its users resolve runtime calls through
//     it with ctypes (test/examples/cpu_backup.py: cudaHostGetFlags, cudaGetLastError on its cdll).
//     This library does not link the runtime: it exports those two as forwarders to the runtime the
//     process has loaded (real_symbol: RTLD_NEXT, then the global scope, then a libcudart loaded
//     RTLD_LOCAL, as PyTorch's is; never this library's own definition). The same library, loaded
//     with ctypes and not preloaded, is torpor.tms's _impl in hook_mode "torch" too: its region
//     settings mirror the Python side's, and torpor_preload_host_alloc gives the zero-copy backups
//     there page-locked memory of their own (cudaMallocHost, freed with the backup), not PyTorch's
//     caching host allocator, which keeps freed blocks registered.
//   - cudaFree reports a failure only of the torpor_torch_free it made (the thread's failure count
//     before and after that call), never an earlier failed cudaMalloc's: PyTorch frees its cache
//     after an out-of-memory cudaMalloc and checks every cudaFree, so a stale count made its retry
//     fail with "out of memory".
#include <dlfcn.h>
#include <fmt/core.h>
#include <link.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/options.hpp"
#include "torpor/torch_allocator.h"
#include "torpor/torpor.h"

// NOLINTBEGIN(cppcoreguidelines-avoid-non-const-global-variables): a preload library's state is global

namespace {

using cuda_error = int;
constexpr cuda_error cuda_success = 0;
constexpr cuda_error cuda_error_invalid_value = 1;
constexpr cuda_error cuda_error_memory_allocation = 2;
constexpr cuda_error cuda_error_unknown = 999;

void say(const std::string& message) { std::fprintf(stderr, "[torpor_preload] %s\n", message.c_str()); }

// -- the real runtime ----------------------------------------------------------------------------

using malloc_fn = cuda_error (*)(void**, size_t);
using free_fn = cuda_error (*)(void*);
using get_device_fn = cuda_error (*)(int*);

// RTLD_NEXT: the definition after this library's in the lookup order, i.e. libcudart's. Resolved
// at the first call that needs it, and again while it is missing: the runtime may be loaded after
// this library (PyTorch opens it with its CUDA libraries), as torch_memory_saver's APIForwarder.
template <class Fn>
Fn next_symbol(std::atomic<Fn>& cache, const char* name) {
  Fn fn = cache.load(std::memory_order_acquire);
  if (fn == nullptr) {
    fn = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, name));
    cache.store(fn, std::memory_order_release);
  }
  return fn;
}

// Where RTLD_NEXT finds no runtime (this library loaded with ctypes, RTLD_LOCAL, in hook_mode
// "torch"), the global scope, then a libcudart that is loaded but not global (PyTorch's).
void* loaded_cudart_symbol(const char* name) {
  std::string found;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* out) -> int {
        const char* path = info->dlpi_name;
        if (path != nullptr && std::strstr(path, "libcudart.so") != nullptr) {
          *static_cast<std::string*>(out) = path;
          return 1;
        }
        return 0;
      },
      &found);
  if (found.empty()) return nullptr;
  void* handle = dlopen(found.c_str(), RTLD_LAZY | RTLD_NOLOAD);  // only one already loaded
  if (handle == nullptr) return nullptr;
  void* sym = dlsym(handle, name);
  dlclose(handle);  // NOLOAD took a reference; the runtime stays loaded by whoever loaded it
  return sym;
}

// Whether `sym` lies in this library. Compared by object, not by the address of an exported
// function: a reference to one from here may bind to another library's definition of that name.
bool in_this_library(const void* sym) {
  Dl_info mine{};
  Dl_info theirs{};
  if (dladdr(reinterpret_cast<const void*>(&say), &mine) == 0 || dladdr(sym, &theirs) == 0) return false;
  return mine.dli_fbase == theirs.dli_fbase;
}

void* real_symbol(const char* name) {
  for (void* sym : {dlsym(RTLD_NEXT, name), dlsym(RTLD_DEFAULT, name)})
    if (sym != nullptr && !in_this_library(sym)) return sym;
  void* sym = loaded_cudart_symbol(name);
  return sym != nullptr && !in_this_library(sym) ? sym : nullptr;
}

template <class Fn>
Fn forwarded(std::atomic<Fn>& cache, const char* name) {
  Fn fn = cache.load(std::memory_order_acquire);
  if (fn == nullptr) {
    fn = reinterpret_cast<Fn>(real_symbol(name));
    cache.store(fn, std::memory_order_release);
  }
  return fn;
}

struct Runtime {
  std::atomic<malloc_fn> malloc_{nullptr};
  std::atomic<free_fn> free_{nullptr};
  std::atomic<get_device_fn> get_device_{nullptr};
  std::atomic<malloc_fn> malloc_host_{nullptr};
  std::atomic<free_fn> free_host_{nullptr};
  malloc_fn malloc() { return next_symbol(malloc_, "cudaMalloc"); }
  free_fn free() { return next_symbol(free_, "cudaFree"); }
  get_device_fn get_device() { return next_symbol(get_device_, "cudaGetDevice"); }
  malloc_fn malloc_host() { return forwarded(malloc_host_, "cudaMallocHost"); }
  free_fn free_host() { return forwarded(free_host_, "cudaFreeHost"); }
};

Runtime& runtime() {
  static Runtime r;
  return r;
}

// -- per-thread region settings ---------------------------------------------------------------

bool env_switch(torpor::options::id key) {
  try {
    return torpor::options::tms_switch(key);
  } catch (const std::exception& e) {
    say(fmt::format("{}: taken as off", e.what()));  // torch_memory_saver exits here
    return false;
  }
}

std::string env_backend() {
  try {
    return torpor::options::tms_cpu_backup_backend();
  } catch (const std::exception& e) {
    say(fmt::format("{}: taken as pinned", e.what()));
    return "pinned";
  }
}

struct ThreadConfig {
  std::string tag = "default";
  std::optional<bool> interesting;
  std::optional<bool> cpu_backup;
  std::optional<bool> disk_backup;
  std::optional<std::string> backend;

  bool is_interesting() {
    if (!interesting) interesting = env_switch(torpor::options::id::tms_init_enable);
    return *interesting;
  }
  bool enable_cpu_backup() {
    if (!cpu_backup) cpu_backup = env_switch(torpor::options::id::tms_init_enable_cpu_backup);
    return *cpu_backup;
  }
  bool enable_disk_backup() {
    if (!disk_backup) disk_backup = env_switch(torpor::options::id::tms_init_enable_disk_backup);
    return *disk_backup;
  }
  const std::string& cpu_backup_backend() {
    if (!backend) backend = env_backend();
    return *backend;
  }
};

thread_local ThreadConfig config;

// -- allocations and host slots -----------------------------------------------------------------

struct Allocation {
  int device = 0;
  size_t bytes = 0;
  std::string tag;
  bool cpu_backup = false;
  bool disk_backup = false;
  std::string backend;
};

struct Slot {
  void* host = nullptr;
  size_t bytes = 0;
  bool pinned = false;
};

struct State {
  std::mutex mu;
  std::map<std::uintptr_t, Allocation> allocations;  // by base address
  std::map<std::uintptr_t, Slot> slots;              // by base address: get_cpu_backup_pointer's
  std::map<std::uintptr_t, Slot> host_buffers;       // torpor_preload_host_alloc's, by address
  std::atomic<bool> retain{env_switch(torpor::options::id::tms_retain_cpu_backup)};
  std::string disk_dir;       // the directory the pools' disk tier was configured in ("" = none)
  bool disk_refused = false;  // the pools held memory when a disk tier was first asked for
};

State& state() {
  // Never destroyed: the runtime frees memory from static destructors that may run after ours.
  static State* s = new State;
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

// Whether the slot now holds the pool's host copy of its allocation (false: the pool holds none).
bool refill(std::uintptr_t base, const Allocation& a, Slot& slot) {
  torpor_pool_t pool = device_pool(a.device);
  if (pool == nullptr) return false;
  int asleep = 0;
  return torpor_read_host_copy(pool, reinterpret_cast<void*>(base), a.bytes, slot.host, &asleep) == TORPOR_OK;
}

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

}  // namespace

// -- the interposed runtime calls ------------------------------------------------------------------

extern "C" {

__attribute__((visibility("default"))) cuda_error cudaMalloc(void** ptr, size_t size) {
  Runtime& rt = runtime();
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

// torch_memory_saver's library links the runtime: these resolve through it (see the note above).
__attribute__((visibility("default"))) cuda_error cudaHostGetFlags(unsigned int* flags, void* host);
__attribute__((visibility("default"))) cuda_error cudaGetLastError();
}  // extern "C"

namespace {

using host_get_flags_fn = cuda_error (*)(unsigned int*, void*);
using get_last_error_fn = cuda_error (*)();
std::atomic<host_get_flags_fn> real_host_get_flags{nullptr};
std::atomic<get_last_error_fn> real_get_last_error{nullptr};
// What cudaGetLastError reports of a forwarder that found no runtime (then cleared, as the runtime's).
thread_local cuda_error unforwarded_error = cuda_success;
constexpr cuda_error cuda_error_initialization = 3;  // cudaErrorInitializationError: no runtime loaded

}  // namespace

extern "C" {

__attribute__((visibility("default"))) cuda_error cudaHostGetFlags(unsigned int* flags, void* host) {
  host_get_flags_fn real = forwarded(real_host_get_flags, "cudaHostGetFlags");
  if (real == nullptr) {
    static std::once_flag said;
    std::call_once(said, [] { say("cudaHostGetFlags: no CUDA runtime is loaded in this process to forward it to"); });
    unforwarded_error = cuda_error_initialization;
    return unforwarded_error;
  }
  return real(flags, host);
}

__attribute__((visibility("default"))) cuda_error cudaGetLastError() {
  get_last_error_fn real = forwarded(real_get_last_error, "cudaGetLastError");
  cuda_error mine = unforwarded_error;
  unforwarded_error = cuda_success;
  if (real == nullptr) return mine;
  cuda_error theirs = real();
  return theirs != cuda_success ? theirs : mine;
}

// torpor.tms's zero-copy backups in hook_mode "torch" (not a CUDA or TMS name): host memory of
// the backend's kind, page-locked ("pinned", cudaMallocHost through the loaded runtime; pageable
// when there is none or it refuses, with a message) or anonymous pageable ("mmap"), given back by
// torpor_preload_host_free. NULL (and a message) when no memory could be had.
__attribute__((visibility("default"))) void* torpor_preload_host_alloc(std::uint64_t bytes, const char* backend) {
  if (bytes == 0 || backend == nullptr) return nullptr;
  if (bytes > (std::uint64_t{1} << 50)) {
    say(fmt::format("torpor_preload_host_alloc: {} bytes is more than any host holds", bytes));
    return nullptr;
  }
  Slot slot;
  if (!make_slot(slot, static_cast<size_t>(bytes), backend)) return nullptr;
  State& s = state();
  std::lock_guard lock(s.mu);
  s.host_buffers[reinterpret_cast<std::uintptr_t>(slot.host)] = slot;
  return slot.host;
}

// Whether the buffer was one of torpor_preload_host_alloc's (and is now given back).
__attribute__((visibility("default"))) bool torpor_preload_host_free(void* host) {
  Slot slot;
  {
    State& s = state();
    std::lock_guard lock(s.mu);
    auto it = s.host_buffers.find(reinterpret_cast<std::uintptr_t>(host));
    if (it == s.host_buffers.end()) return false;
    slot = it->second;
    s.host_buffers.erase(it);
  }
  release_slot(slot);
  return true;
}

// Whether the buffer is page-locked (cudaMallocHost's) rather than pageable.
__attribute__((visibility("default"))) bool torpor_preload_host_pinned(const void* host) {
  State& s = state();
  std::lock_guard lock(s.mu);
  auto it = s.host_buffers.find(reinterpret_cast<std::uintptr_t>(host));
  return it != s.host_buffers.end() && it->second.pinned;
}

// -- torch_memory_saver's entry points -----------------------------------------------------------

__attribute__((visibility("default"))) void tms_set_interesting_region(bool is_interesting_region) {
  config.interesting = is_interesting_region;
}

__attribute__((visibility("default"))) bool tms_get_interesting_region() { return config.is_interesting(); }

__attribute__((visibility("default"))) void tms_set_current_tag(const char* tag) {
  if (tag == nullptr || *tag == '\0') {
    say("tms_set_current_tag: the tag is null or empty (kept the current one)");
    return;
  }
  config.tag = tag;
}

__attribute__((visibility("default"))) const char* tms_get_current_tag() { return config.tag.c_str(); }

__attribute__((visibility("default"))) bool tms_get_enable_cpu_backup() { return config.enable_cpu_backup(); }

__attribute__((visibility("default"))) void tms_set_enable_cpu_backup(bool enable_cpu_backup) {
  config.cpu_backup = enable_cpu_backup;
}

__attribute__((visibility("default"))) const char* tms_get_cpu_backup_backend() {
  return config.cpu_backup_backend().c_str();
}

__attribute__((visibility("default"))) void tms_set_cpu_backup_backend(const char* backend) {
  std::string b = backend == nullptr || *backend == '\0' ? "pinned" : backend;  // TMS: empty = default
  if (b != "pinned" && b != "mmap") {
    say(fmt::format("tms_set_cpu_backup_backend: '{}' is not mmap or pinned (kept '{}')", b,
                    config.cpu_backup_backend()));
    return;
  }
  config.backend = b;
}

__attribute__((visibility("default"))) bool tms_get_enable_disk_backup() { return config.enable_disk_backup(); }

__attribute__((visibility("default"))) void tms_set_enable_disk_backup(bool enable_disk_backup) {
  config.disk_backup = enable_disk_backup;
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

// NOLINTEND(cppcoreguidelines-avoid-non-const-global-variables)
