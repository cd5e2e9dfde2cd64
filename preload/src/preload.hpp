// libtorpor_preload.so: torch_memory_saver's preload mode over torpor's pools. This header holds
// what its files share (internal: the library exports only the C entry points).
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
//
// The files: runtime.cpp (finding the real runtime; the forwarders of cudaHostGetFlags and
// cudaGetLastError), thread_config.cpp (the region settings), state.cpp (the allocation map, the
// host slots, the disk tier, pause and resume), cuda_malloc.cpp (the interposed cudaMalloc and
// cudaFree), host_buffers.cpp (torpor.tms's zero-copy backups), tms_entry_points.cpp
// (torch_memory_saver's C entry points).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "common/options.hpp"
#include "torpor/torpor.h"

namespace torpor::preload {

using cuda_error = int;
constexpr cuda_error cuda_success = 0;
constexpr cuda_error cuda_error_invalid_value = 1;
constexpr cuda_error cuda_error_memory_allocation = 2;
constexpr cuda_error cuda_error_unknown = 999;

// One line on stderr: "[torpor_preload] message".
void say(const std::string& message);

// -- the real runtime (runtime.cpp) ----------------------------------------------------------------

using malloc_fn = cuda_error (*)(void**, size_t);
using free_fn = cuda_error (*)(void*);
using get_device_fn = cuda_error (*)(int*);

// The runtime's functions this library calls, each resolved at its first use (nullptr while the
// process has no runtime): the interposed ones through RTLD_NEXT, the others wherever the loaded
// runtime is (never this library's own definitions).
struct Runtime {
  std::atomic<malloc_fn> malloc_{nullptr};
  std::atomic<free_fn> free_{nullptr};
  std::atomic<get_device_fn> get_device_{nullptr};
  std::atomic<malloc_fn> malloc_host_{nullptr};
  std::atomic<free_fn> free_host_{nullptr};
  malloc_fn malloc();
  free_fn free();
  get_device_fn get_device();
  malloc_fn malloc_host();
  free_fn free_host();
};

Runtime& runtime();

// -- per-thread region settings (thread_config.cpp) ------------------------------------------------

// A TMS_* switch; an invalid value is said and taken as off, where torch_memory_saver exits.
bool env_switch(torpor::options::id key);

// torch_memory_saver's ThreadLocalConfig: every setting unset until set or first read, then read
// from its TMS_* variable.
struct ThreadConfig {
  std::string tag = "default";
  std::optional<bool> interesting;
  std::optional<bool> cpu_backup;
  std::optional<bool> disk_backup;
  std::optional<std::string> backend;

  bool is_interesting();
  bool enable_cpu_backup();
  bool enable_disk_backup();
  const std::string& cpu_backup_backend();
};

// The calling thread's settings.
ThreadConfig& thread_config();

// -- allocations and host slots (state.cpp) --------------------------------------------------------

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

// The library's one shared state (never destroyed: the runtime frees memory from static
// destructors that may run after ours).
State& state();

void release_slot(Slot& slot);
// Host memory for a slot, of the backend's kind (page-locked when "pinned" and the runtime gives
// it, else anonymous pageable); false (and a message) when none could be had.
bool make_slot(Slot& slot, size_t bytes, const std::string& backend);
// The torch pool of `device`, or nullptr (and a message).
torpor_pool_t device_pool(int device);
// Whether the slot now holds the pool's host copy of its allocation (false: the pool holds none).
bool refill(std::uintptr_t base, const Allocation& a, Slot& slot);
// The disk tier in `dir` (under state().mu).
void configure_disk(const std::string& dir);
// The CUDA error for a torpor status.
cuda_error status_error(torpor_status s);
// tms_pause (sleep) or tms_resume of `tag` ("" = every tag this library allocated in).
cuda_error sleep_or_wake(const std::string& tag, bool sleep);

}  // namespace torpor::preload
