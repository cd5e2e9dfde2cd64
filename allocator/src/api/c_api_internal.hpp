// The C API's internals, shared by its files (c_api_*.cpp) and by the PyTorch entry points
// (torch_allocator.cpp), so every C entry point of libtorpor reports through the same
// thread-local torpor_last_error() and the same exception -> status mapping (common/error_kind).
//
// Design: pool and group handles are registry ids, never pointers to freed memory, so a call on
// a destroyed pool is reported (TORPOR_ERROR_INVALID_HANDLE) instead of crashing. A call holds a
// shared_ptr to its pool (with_pool), so destroy racing another call is safe: the pool goes when
// the last in-flight call on it returns. Every entry point runs its body in guarded() (or
// with_pool(), which is guarded() on a live pool): no exception crosses the C boundary; each
// becomes its kind's status, and its message, prefixed with the entry point's name, becomes
// torpor_last_error().
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "torpor/backend.hpp"
#include "torpor/callback_group.hpp"
#include "torpor/pool.hpp"
#include "torpor/torpor.h"

namespace torpor::detail {

// --- the calling thread's last error ---------------------------------------------------------

void set_last_error(std::string message) noexcept;
const char* last_error() noexcept;

// Sets the last error to `message` and returns `s`.
torpor_status fail(torpor_status s, std::string message);

// Call inside a catch block: the status of the exception being handled (its ErrorKind's), with
// "<fn>: <its message>" as the last error.
torpor_status fail_with_caught(const char* fn);

// Runs f; an exception it throws becomes its status and last error (see fail_with_caught).
template <typename F>
torpor_status guarded(const char* fn, F&& f) {
  try {
    f();
    return TORPOR_OK;
  } catch (...) {
    return fail_with_caught(fn);
  }
}

// --- pools and groups behind their handles ---------------------------------------------------

class HookObserver;  // a C sleep hook as a SleepObserver (c_api_sleep.cpp)

struct CPool {
  CPool();  // both in c_api_sleep.cpp, where HookObserver is complete
  ~CPool();

  DriverSelection driver;
  // Before `pool`, so that the pool (which points at the active ones) is destroyed first.
  std::vector<std::unique_ptr<HookObserver>> hooks;
  std::unique_ptr<Pool> pool;
  std::mutex report_mu;
  std::string last_report = "{}";
  std::mutex hooks_mu;
  unsigned long long next_hook = 1;
  int torch_device = -1;  // >= 0: the pool behind PyTorch's allocator on that device (never destroyed)
};

struct Registry {
  std::mutex mu;
  std::uintptr_t next = 1;
  std::map<std::uintptr_t, std::shared_ptr<CPool>> pools;
  std::map<std::uintptr_t, std::shared_ptr<CallbackGroup>> groups;  // ids shared with pools

  // `object` under a fresh id, which is its handle.
  template <class T>
  std::uintptr_t add(std::map<std::uintptr_t, std::shared_ptr<T>>& live, std::shared_ptr<T> object) {
    std::lock_guard lock(mu);
    std::uintptr_t id = next++;
    live.emplace(id, std::move(object));
    return id;
  }

  // The live object behind `handle`, or null.
  template <class T>
  std::shared_ptr<T> find(std::map<std::uintptr_t, std::shared_ptr<T>>& live, const void* handle) {
    std::lock_guard lock(mu);
    auto it = live.find(reinterpret_cast<std::uintptr_t>(handle));
    return it == live.end() ? nullptr : it->second;
  }

  // Unregisters the object behind `handle` and hands it back (null when `handle` is not live): it
  // is destroyed outside the lock, when the caller and every in-flight call have let go of it.
  template <class T>
  std::shared_ptr<T> take(std::map<std::uintptr_t, std::shared_ptr<T>>& live, const void* handle) {
    std::lock_guard lock(mu);
    auto it = live.find(reinterpret_cast<std::uintptr_t>(handle));
    if (it == live.end()) return nullptr;
    std::shared_ptr<T> object = std::move(it->second);
    live.erase(it);
    return object;
  }
};

// Never destroyed: pools may be used from other static destructors at exit.
Registry& registry();

// The live pool behind `handle`, or null.
std::shared_ptr<CPool> find_pool(torpor_pool_t handle);

// A destroy given a handle that is not live (`what`: pool or group).
torpor_status not_live_to_destroy(const char* fn, const char* what, const void* handle);

// TORPOR_ERROR_INVALID_HANDLE for a pool handle that is not live.
torpor_status not_a_live_pool(const char* fn, torpor_pool_t handle);

// guarded(f(pool)) on the live pool behind `handle`, which the call holds until it returns.
template <typename F>
torpor_status with_pool(const char* fn, torpor_pool_t handle, F&& f) {
  std::shared_ptr<CPool> p = find_pool(handle);
  if (!p) return not_a_live_pool(fn, handle);
  return guarded(fn, [&] { f(*p); });
}

// Marks a pool as the one behind PyTorch's allocator on `device`: torpor_pool_destroy refuses it
// from then on (PyTorch holds segments in it, and the allocator keeps its handle for the
// process's life). False when `pool` is not a live pool.
bool keep_for_torch(torpor_pool_t pool, int device) noexcept;

// --- arguments -------------------------------------------------------------------------------

// A torpor_memory_class; throws invalid_argument naming the accepted values.
MemoryClass to_class(int c);

// The longest list of tags or globs a call takes: far beyond any real use, and a wrong count
// (a negative int passed as size_t) is refused before the array is read.
inline constexpr std::size_t max_list_count = 65536;

// A C array of `n` strings (`what` names it in the refusal: NULL entries, a count out of range).
std::vector<std::string> to_strings(const char* const* v, std::size_t n, const char* what);

// Copies `text` into buffer (truncated, NUL-terminated) and its size + 1 into *needed.
torpor_status write_out(const std::string& text, char* buffer, std::size_t capacity, std::size_t* needed);

}  // namespace torpor::detail
