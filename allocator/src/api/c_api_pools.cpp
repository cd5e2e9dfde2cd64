// The C API's pools and allocation: options, create and destroy, allocate, free and mark,
// find and copy, the host store and the host copies (torpor.h). The pool options cross through
// one field list (c_pool_options.hpp); every entry point runs in with_pool() or guarded()
// (c_api_internal.hpp), so no exception crosses the boundary.
#include <fmt/core.h>

#include <memory>
#include <string>
#include <vector>

#include "api/c_api_internal.hpp"
#include "api/c_pool_options.hpp"
#include "torpor/error.hpp"
#include "torpor/pool.hpp"
#include "torpor/torpor.h"

namespace {

using namespace torpor;
using namespace torpor::detail;

}  // namespace

extern "C" {

void torpor_pool_options_init(torpor_pool_options* o) {
  if (o == nullptr) return;
  init_c_pool_options(*o);
}

torpor_status torpor_pool_create(const torpor_pool_options* options, torpor_pool_t* out) {
  return guarded("torpor_pool_create", [&] {
    if (out == nullptr) throw invalid_argument("out is NULL");
    *out = nullptr;
    torpor_pool_options o;
    torpor_pool_options_init(&o);
    if (options != nullptr) o = *options;
    const PoolSpec spec = pool_spec_of(o);
    auto cp = std::make_shared<CPool>();
    cp->driver = shared_driver(spec.backend);
    cp->pool = std::make_unique<Pool>(*cp->driver.driver, spec.pool);
    Registry& r = registry();
    *out = reinterpret_cast<torpor_pool_t>(r.add(r.pools, std::move(cp)));
  });
}

torpor_status torpor_pool_destroy(torpor_pool_t pool) {
  Registry& r = registry();
  if (std::shared_ptr<CPool> kept = r.find(r.pools, pool); kept && kept->torch_device >= 0)
    return fail(TORPOR_ERROR_INVALID_STATE,
                fmt::format("torpor_pool_destroy: pool {} is the pool behind PyTorch's allocator on device {} "
                            "(torpor_torch_pool); PyTorch holds segments in it, so it lives until the process "
                            "exits: free the tensors (torch.cuda.empty_cache gives their segments back) instead",
                            static_cast<const void*>(pool), kept->torch_device));
  std::shared_ptr<CPool> p = r.take(r.pools, pool);
  if (!p) return not_live_to_destroy("torpor_pool_destroy", "pool", pool);
  // The pool is destroyed when the last in-flight call on it returns.
  return TORPOR_OK;
}

torpor_status torpor_alloc(torpor_pool_t pool, size_t bytes, const char* tag, int memory_class, const char* name,
                           void** out) {
  return with_pool("torpor_alloc", pool, [&](CPool& p) {
    if (out == nullptr) throw invalid_argument("out is NULL");
    *out = nullptr;
    AllocationOptions o;
    o.tag = tag != nullptr ? tag : std::string(default_tag);
    o.memory_class = to_class(memory_class);
    o.name = name != nullptr ? name : "";
    *out = p.pool->allocate(bytes, o);
  });
}

torpor_status torpor_free(torpor_pool_t pool, void* ptr) {
  return with_pool("torpor_free", pool, [&](CPool& p) { p.pool->deallocate(ptr); });
}

torpor_status torpor_mark(torpor_pool_t pool, void* ptr, size_t bytes, int memory_class, const char* name) {
  return with_pool("torpor_mark", pool,
                   [&](CPool& p) { p.pool->mark(ptr, bytes, to_class(memory_class), name != nullptr ? name : ""); });
}

torpor_status torpor_mark_ranges(torpor_pool_t pool, size_t count, void* const* ptrs, const size_t* bytes,
                                 const int* memory_classes, const char* const* names) {
  return with_pool("torpor_mark_ranges", pool, [&](CPool& p) {
    if (count == 0) return;
    if (count > TORPOR_MAX_MARK_RANGES)
      throw invalid_argument(fmt::format("count {} is more than TORPOR_MAX_MARK_RANGES ({}) ranges in one call; "
                                         "mark them in several calls",
                                         count, TORPOR_MAX_MARK_RANGES));
    if (ptrs == nullptr || bytes == nullptr || memory_classes == nullptr)
      throw invalid_argument(fmt::format("ptrs, bytes and memory_classes must not be NULL ({} ranges)", count));
    std::vector<Pool::MarkRange> ranges(count);
    for (std::size_t i = 0; i < count; ++i) {
      ranges[i].ptr = ptrs[i];
      ranges[i].bytes = bytes[i];
      try {
        ranges[i].memory_class = to_class(memory_classes[i]);
      } catch (const invalid_argument& e) {
        throw invalid_argument(fmt::format("range {}: {}", i, e.what()));
      }
      if (names != nullptr && names[i] != nullptr) ranges[i].name = names[i];
    }
    p.pool->mark(ranges);
  });
}

torpor_status torpor_release_host_store(torpor_pool_t pool, size_t* released) {
  return with_pool("torpor_release_host_store", pool, [&](CPool& p) {
    std::size_t n = p.pool->release_host_store();
    if (released != nullptr) *released = n;
  });
}

torpor_status torpor_prepare_host_store(torpor_pool_t pool, size_t bytes, int wait, size_t* added) {
  return with_pool("torpor_prepare_host_store", pool, [&](CPool& p) {
    std::size_t n = p.pool->prepare_host_store(bytes);
    if (added != nullptr) *added = n;
    if (wait != 0) p.pool->wait_host_store();
  });
}

torpor_status torpor_find(torpor_pool_t pool, const void* ptr, void** base, size_t* bytes) {
  return with_pool("torpor_find", pool, [&](CPool& p) {
    auto info = p.pool->find(ptr);
    if (!info) throw invalid_argument(fmt::format("{} is not inside any allocation of this pool", ptr));
    if (base != nullptr) *base = reinterpret_cast<void*>(info->base);
    if (bytes != nullptr) *bytes = info->bytes;
  });
}

torpor_status torpor_copy(torpor_pool_t pool, void* dst, const void* src, size_t bytes) {
  return with_pool("torpor_copy", pool, [&](CPool& p) {
    if (bytes > 0 && (dst == nullptr || src == nullptr)) throw invalid_argument("NULL pointer");
    p.pool->copy(dst, src, bytes);
  });
}

torpor_status torpor_read_host_copy(torpor_pool_t pool, const void* ptr, size_t bytes, void* dst, int* asleep) {
  if (asleep != nullptr) *asleep = 0;
  torpor_status uncovered = TORPOR_OK;
  torpor_status s = with_pool("torpor_read_host_copy", pool, [&](CPool& p) {
    HostCopyRead r = p.pool->read_host_copy(ptr, bytes, dst);
    if (asleep != nullptr) *asleep = r.asleep ? 1 : 0;
    if (!r.copied)
      uncovered = fail(TORPOR_ERROR_INVALID_STATE,
                       fmt::format("torpor_read_host_copy: no host copy holds every byte of [{}, +{}): the allocation "
                                   "is {} {}",
                                   ptr, bytes, r.asleep ? "asleep and" : "awake and",
                                   r.asleep ? "some of these bytes were discarded, not offloaded"
                                            : "no copy of its last sleep was retained"));
  });
  return s != TORPOR_OK ? s : uncovered;
}

}  // extern "C"
