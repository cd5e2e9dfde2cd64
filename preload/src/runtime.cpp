// The real CUDA runtime behind the interposed calls (preload.hpp), and the two runtime calls this
// library exports as forwarders to it (cudaHostGetFlags, cudaGetLastError: see the note there).
#include <dlfcn.h>
#include <link.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

#include "preload.hpp"

namespace torpor::preload {

void say(const std::string& message) { std::fprintf(stderr, "[torpor_preload] %s\n", message.c_str()); }

namespace {

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

}  // namespace

malloc_fn Runtime::malloc() { return next_symbol(malloc_, "cudaMalloc"); }
free_fn Runtime::free() { return next_symbol(free_, "cudaFree"); }
get_device_fn Runtime::get_device() { return next_symbol(get_device_, "cudaGetDevice"); }
malloc_fn Runtime::malloc_host() { return forwarded(malloc_host_, "cudaMallocHost"); }
free_fn Runtime::free_host() { return forwarded(free_host_, "cudaFreeHost"); }

Runtime& runtime() {
  static Runtime r;
  return r;
}

namespace {

// NOLINTBEGIN(cppcoreguidelines-avoid-non-const-global-variables): a preload library's state is global
using host_get_flags_fn = cuda_error (*)(unsigned int*, void*);
using get_last_error_fn = cuda_error (*)();
std::atomic<host_get_flags_fn> real_host_get_flags{nullptr};
std::atomic<get_last_error_fn> real_get_last_error{nullptr};
// What cudaGetLastError reports of a forwarder that found no runtime (then cleared, as the runtime's).
thread_local cuda_error unforwarded_error = cuda_success;
constexpr cuda_error cuda_error_initialization = 3;  // cudaErrorInitializationError: no runtime loaded
// NOLINTEND(cppcoreguidelines-avoid-non-const-global-variables)

}  // namespace

}  // namespace torpor::preload

using namespace torpor::preload;  // for the C entry points below, outside the namespace

extern "C" {

// torch_memory_saver's library links the runtime: these resolve through it (see preload.hpp).
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

}  // extern "C"
