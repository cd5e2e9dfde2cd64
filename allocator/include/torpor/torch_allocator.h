/* torpor as PyTorch's allocator: the two entry points torch.cuda.memory.CUDAPluggableAllocator
 * loads from libtorpor.so, and the thread-local tag and class they allocate in.
 *
 *   alloc = torch.cuda.memory.CUDAPluggableAllocator(
 *       "libtorpor.so", "torpor_torch_malloc", "torpor_torch_free")
 *   pool = torch.cuda.MemPool(alloc.allocator())
 *   torpor_set_current_tag("weights")   # through ctypes, on the allocating thread
 *   with torch.cuda.use_mem_pool(pool): model = build()
 *
 * The Python package (python/torpor) does all of this; this header is for engines that load
 * the library themselves.
 *
 * One torpor pool per device, created on the first allocation for that device (or by
 * torpor_torch_pool) with the options of torpor_torch_configure (default: backend from
 * TORPOR_BACKEND, else cuda when usable, else host). Those pools are ordinary C API pools:
 * sleep, wake, mark, stats and preserve globs go through torpor.h with the handle that
 * torpor_torch_pool returns. Never torpor_pool_destroy it: PyTorch may still hold segments.
 *
 * PyTorch declares the size as size_t (its documentation's example says ssize_t: the same
 * width and, for any size PyTorch asks for, the same value). cudaStream_t is a pointer; it is
 * taken as an opaque void* so nothing here includes the CUDA headers. Memory is stream
 * agnostic: a mapped segment is usable from every stream of the device.
 *
 * No C++ exception crosses these functions. A failed torpor_torch_malloc returns NULL (PyTorch
 * then frees cached blocks, retries, and raises its out-of-memory error); a failed
 * torpor_torch_free has no way to report, so it logs a warning. Either way the message is in
 * torpor_last_error() on the calling thread and torpor_torch_failures() counts it, with its status. */
#ifndef TORPOR_TORCH_ALLOCATOR_H
#define TORPOR_TORCH_ALLOCATOR_H

#include <stddef.h> /* NOLINT(modernize-deprecated-headers): a C header */

#include "torpor/torpor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* CUDAPluggableAllocator's alloc_fn: `size` bytes on `device` in this thread's current tag and
 * class. NULL on failure. */
void* torpor_torch_malloc(size_t size, int device, void* stream);
/* CUDAPluggableAllocator's free_fn. Waits for the device's queued work first: PyTorch hands a
 * segment back without waiting (it relies on cudaFree's implicit synchronization), and
 * unmapping memory a kernel still reads is an illegal address. */
void torpor_torch_free(void* ptr, size_t size, int device, void* stream);

/* The tag and class torpor_torch_malloc allocates in, per thread (PyTorch allocates on the
 * thread that creates the tensor). Defaults: "default" and TORPOR_CLASS_STATE.
 * tag NULL = "default"; the string is copied. */
torpor_status torpor_set_current_tag(const char* tag);
/* Valid until the next torpor_set_current_tag on this thread. */
const char* torpor_current_tag(void);
torpor_status torpor_set_current_class(int memory_class);
int torpor_current_class(void);

/* The pool of `device`, created if it does not exist yet. */
torpor_status torpor_torch_pool(int device, torpor_pool_t* out);
/* Options for the pools created from now on (options->device is ignored; NULL = defaults).
 * Once a pool exists, only the same options are accepted again (TORPOR_ERROR_INVALID_STATE
 * otherwise): pools of one process do not differ. */
torpor_status torpor_torch_configure(const torpor_pool_options* options);

/* Free device memory that torpor_torch_malloc leaves alone, for the other users of the device:
 * a segment is refused (NULL, counted as TORPOR_ERROR_OUT_OF_MEMORY) when the device's free memory
 * is less than the segment's size plus this margin, even if it would fit in memory the pool
 * already holds. 0, the default, checks nothing. Process-wide (torch_memory_saver's
 * memory_margin_bytes); at most TORPOR_TORCH_MEMORY_MARGIN_MAX bytes. */
#define TORPOR_TORCH_MEMORY_MARGIN_MAX ((size_t)1 << 50) /* 1 PiB */
torpor_status torpor_torch_set_memory_margin(size_t bytes);
size_t torpor_torch_memory_margin(void);

/* Failed torpor_torch_malloc / torpor_torch_free calls on this thread since it started; the
 * status of the latest goes to *last_status when last_status is not NULL (TORPOR_OK if none). */
unsigned long long torpor_torch_failures(torpor_status* last_status);

#ifdef __cplusplus
}
#endif

#endif /* TORPOR_TORCH_ALLOCATOR_H */
