// The C API over Pool. Pool handles are registry ids, never pointers to freed memory, so a
// call on a destroyed pool is reported (TORPOR_ERROR_INVALID_HANDLE) instead of crashing.
// A call holds a shared_ptr to its pool, so destroy racing another call is safe.
#include <fmt/core.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "api/c_api_internal.hpp"
#include "api/c_enums.hpp"
#include "torpor/backend.hpp"
#include "torpor/callback_group.hpp"
#include "torpor/collective_sleep.hpp"
#include "torpor/error.hpp"
#include "torpor/pool.hpp"
#include "torpor/torpor.h"

// torpor.h's tag macros are torpor/tags.hpp's strings.
static_assert(std::string_view(TORPOR_TAG_WEIGHTS) == torpor::tags::weights);
static_assert(std::string_view(TORPOR_TAG_KV_CACHE) == torpor::tags::kv_cache);
static_assert(std::string_view(TORPOR_TAG_CUDA_GRAPH) == torpor::tags::cuda_graph);
// The C enumerations' values are the C++ ones, so a class or fill converts by a cast.
static_assert(static_cast<int>(torpor::MemoryClass::parameter) == TORPOR_CLASS_PARAMETER &&
              static_cast<int>(torpor::MemoryClass::state) == TORPOR_CLASS_STATE &&
              static_cast<int>(torpor::MemoryClass::cache) == TORPOR_CLASS_CACHE &&
              torpor::memory_class_count == TORPOR_CLASS_CACHE + 1);
// torpor_handle_kind's concrete kinds are the seam's HandleKind values.
static_assert(static_cast<int>(torpor::HandleKind::posix_fd) == TORPOR_HANDLE_POSIX_FD &&
              static_cast<int>(torpor::HandleKind::fabric) == TORPOR_HANDLE_FABRIC);
static_assert(TORPOR_FABRIC_HANDLE_BYTES == torpor::fabric_handle_bytes);
static_assert(static_cast<int>(torpor::FillOnWake::none) == TORPOR_FILL_NONE &&
              static_cast<int>(torpor::FillOnWake::zero) == TORPOR_FILL_ZERO &&
              static_cast<int>(torpor::FillOnWake::poison) == TORPOR_FILL_POISON);

namespace {

using namespace torpor;

// The typed error of a hook's status, so that torpor_sleep (and a collective sleep, which
// sends the type to every rank) reports the kind of failure the hook returned.
[[noreturn]] void throw_refusal(torpor_status s, const std::string& message) {
  switch (s) {
    case TORPOR_ERROR_INVALID_ARGUMENT: throw invalid_argument(message);
    case TORPOR_ERROR_INVALID_STATE: throw invalid_state(message);
    case TORPOR_ERROR_OUT_OF_MEMORY: throw out_of_memory(message);
    case TORPOR_ERROR_TIMEOUT: throw timeout_error(message);
    case TORPOR_ERROR_UNAVAILABLE: throw unavailable(message);
    default: throw error(fmt::format("{} (status {})", message, torpor_status_name(s)));
  }
}

// The C sleep hooks as a SleepObserver. A removed hook stays allocated (inactive) until its
// pool is destroyed: a sleep on another thread may hold its pointer (Pool calls observers
// outside its lock), so it may not be freed while the pool lives.
class HookObserver final : public SleepObserver {
 public:
  HookObserver(torpor_pool_t handle, torpor_before_sleep_hook before, torpor_after_wake_hook after, void* user,
               unsigned long long id)
      : handle_(handle), before_(before), after_(after), user_(user), id_(id) {}
  void deactivate() noexcept { active_.store(false); }
  bool active() const noexcept { return active_.load(); }
  unsigned long long id() const noexcept { return id_; }

  void before_sleep(Pool& /*pool*/, int level, const std::vector<std::string>& tags) override {
    if (before_ == nullptr || !active()) return;
    std::vector<const char*> names = c_strings(tags);
    std::string message(message_capacity, '\0');
    const torpor_status s = before_(user_, handle_, level, names.data(), names.size(), message.data(), message.size());
    if (s == TORPOR_OK) return;
    message.resize(std::min(std::strlen(message.c_str()), message.size()));
    throw_refusal(s, fmt::format("sleep hook {} refused the sleep: {}", id_,
                                 message.empty() ? std::string("(the hook gave no reason)") : message));
  }
  void after_wake(Pool& /*pool*/, const std::vector<std::string>& tags, bool ok) override {
    if (after_ == nullptr || !active()) return;
    std::vector<const char*> names = c_strings(tags);
    after_(user_, handle_, names.data(), names.size(), ok ? 1 : 0);
  }

 private:
  static constexpr std::size_t message_capacity = 4096;

  static std::vector<const char*> c_strings(const std::vector<std::string>& v) {
    std::vector<const char*> out;
    out.reserve(v.size());
    for (const auto& s : v) out.push_back(s.c_str());
    return out;
  }
  torpor_pool_t handle_;
  torpor_before_sleep_hook before_;
  torpor_after_wake_hook after_;
  void* user_;
  unsigned long long id_;
  std::atomic<bool> active_{true};
};

struct CPool {
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
Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}

thread_local std::string last_error;

torpor_status fail(torpor_status s, std::string message) {
  last_error = std::move(message);
  return s;
}

template <typename F>
torpor_status guarded(const char* fn, F&& f) {
  try {
    f();
    return TORPOR_OK;
  } catch (const invalid_argument& e) {
    return fail(TORPOR_ERROR_INVALID_ARGUMENT, fmt::format("{}: {}", fn, e.what()));
  } catch (const invalid_state& e) {
    return fail(TORPOR_ERROR_INVALID_STATE, fmt::format("{}: {}", fn, e.what()));
  } catch (const out_of_memory& e) {
    return fail(TORPOR_ERROR_OUT_OF_MEMORY, fmt::format("{}: {}", fn, e.what()));
  } catch (const timeout_error& e) {
    return fail(TORPOR_ERROR_TIMEOUT, fmt::format("{}: {}", fn, e.what()));
  } catch (const unavailable& e) {
    return fail(TORPOR_ERROR_UNAVAILABLE, fmt::format("{}: {}", fn, e.what()));
  } catch (const driver_error& e) {
    return fail(e.is_out_of_memory() ? TORPOR_ERROR_OUT_OF_MEMORY : TORPOR_ERROR_DRIVER,
                fmt::format("{}: {}", fn, e.what()));
  } catch (const std::bad_alloc&) {
    return fail(TORPOR_ERROR_OUT_OF_MEMORY, fmt::format("{}: host out of memory", fn));
  } catch (const std::exception& e) {
    return fail(TORPOR_ERROR_INTERNAL, fmt::format("{}: {}", fn, e.what()));
  } catch (...) {
    return fail(TORPOR_ERROR_INTERNAL, fmt::format("{}: unknown exception", fn));
  }
}

struct bad_handle {};

// A destroy given a handle that is not live (`what`: pool or group).
torpor_status not_live_to_destroy(const char* fn, const char* what, const void* handle) {
  return fail(TORPOR_ERROR_INVALID_HANDLE,
              fmt::format("{}: {} handle {} is not a live {} (destroyed twice?)", fn, what, handle, what));
}

std::shared_ptr<CPool> lookup(torpor_pool_t handle) {
  Registry& r = registry();
  std::shared_ptr<CPool> p = r.find(r.pools, handle);
  if (!p) throw bad_handle{};
  return p;
}

template <typename F>
torpor_status with_pool(const char* fn, torpor_pool_t handle, F&& f) {
  std::shared_ptr<CPool> p;
  try {
    p = lookup(handle);
  } catch (const bad_handle&) {
    return fail(TORPOR_ERROR_INVALID_HANDLE,
                fmt::format("{}: pool handle {} is not a live pool (destroyed, or never created)", fn,
                            static_cast<void*>(handle)));
  }
  return guarded(fn, [&] { f(*p); });
}

// The C enums' tables, shared with the PyTorch entry points (api/c_enums.hpp).
using detail::backend_of;
using detail::status_last;

MemoryClass to_class(int c) {
  if (c < 0 || c >= static_cast<int>(memory_class_count))
    throw invalid_argument(fmt::format("unknown memory class {} (expected 0 = TORPOR_CLASS_PARAMETER, "
                                       "1 = TORPOR_CLASS_STATE, 2 = TORPOR_CLASS_CACHE)",
                                       c));
  return static_cast<MemoryClass>(c);
}

// The longest list of tags or globs a call takes: far beyond any real use, and a wrong count
// (a negative int passed as size_t) is refused before the array is read.
constexpr std::size_t max_list_count = 65536;

std::vector<std::string> to_strings(const char* const* v, std::size_t n, const char* what) {
  std::vector<std::string> out;
  if (n > max_list_count)
    throw invalid_argument(fmt::format("{}: count {} is outside [0, {}]", what, n, max_list_count));
  if (n > 0 && v == nullptr) throw invalid_argument(fmt::format("{} is NULL but count is {}", what, n));
  for (std::size_t i = 0; i < n; ++i) {
    if (v[i] == nullptr) throw invalid_argument(fmt::format("{}[{}] is NULL", what, i));
    out.emplace_back(v[i]);
  }
  return out;
}

torpor_status write_out(const std::string& text, char* buffer, std::size_t capacity, std::size_t* needed) {
  if (needed != nullptr) *needed = text.size() + 1;
  if (buffer != nullptr && capacity > 0) {
    std::size_t n = std::min(capacity - 1, text.size());
    text.copy(buffer, n);
    buffer[n] = '\0';
  }
  return TORPOR_OK;
}

}  // namespace

namespace torpor::detail {
void set_last_error(std::string message) noexcept { last_error = std::move(message); }

bool keep_for_torch(torpor_pool_t pool, int device) noexcept {
  try {
    Registry& r = registry();
    std::shared_ptr<CPool> p = r.find(r.pools, pool);
    if (!p) return false;
    p->torch_device = device;
    return true;
  } catch (...) {
    return false;
  }
}
}  // namespace torpor::detail

extern "C" {

void torpor_pool_options_init(torpor_pool_options* o) {
  if (o == nullptr) return;
  *o = torpor_pool_options{};
  o->device = 0;
  o->backend = TORPOR_BACKEND_AUTO;
  o->va_bytes = 0;
  o->fill_on_wake = TORPOR_FILL_NONE;
  o->exportable = 0;
  o->skip_unchanged = 1;
  o->host_store_limit = 0;
  o->host_store_prepare = 0;
  o->spill_dir = nullptr;
  o->spill_limit = 0;
  o->spill_file_per_allocation = 0;
}

torpor_status torpor_pool_create(const torpor_pool_options* options, torpor_pool_t* out) {
  return guarded("torpor_pool_create", [&] {
    if (out == nullptr) throw invalid_argument("out is NULL");
    *out = nullptr;
    torpor_pool_options o;
    torpor_pool_options_init(&o);
    if (options != nullptr) o = *options;
    const std::optional<Backend> b = backend_of(o.backend);
    if (!b) throw invalid_argument(fmt::format("unknown backend {} (0 auto, 1 host, 2 cuda)", o.backend));
    if (o.fill_on_wake < TORPOR_FILL_NONE || o.fill_on_wake > TORPOR_FILL_POISON)
      throw invalid_argument(fmt::format("unknown fill_on_wake {} (0 none, 1 zero, 2 poison)", o.fill_on_wake));
    auto cp = std::make_shared<CPool>();
    cp->driver = shared_driver(*b);
    PoolOptions po;
    po.device = o.device;
    po.va_bytes = o.va_bytes;
    po.fill_on_wake = static_cast<FillOnWake>(o.fill_on_wake);
    po.exportable = o.exportable != 0;
    if (o.skip_unchanged != 0 && o.skip_unchanged != 1)
      throw invalid_argument(fmt::format("skip_unchanged {} is not 0 or 1", o.skip_unchanged));
    po.skip_unchanged = o.skip_unchanged != 0;
    po.host_store_limit = o.host_store_limit;
    po.host_store_prepare = o.host_store_prepare;
    if (o.spill_dir != nullptr) po.spill_dir = o.spill_dir;
    po.spill_limit = o.spill_limit;
    po.spill_file_per_allocation = o.spill_file_per_allocation != 0;
    cp->pool = std::make_unique<Pool>(*cp->driver.driver, po);
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

torpor_status torpor_set_preserve(torpor_pool_t pool, const char* const* globs, size_t count) {
  return with_pool("torpor_set_preserve", pool,
                   [&](CPool& p) { p.pool->set_preserve(to_strings(globs, count, "globs")); });
}

torpor_status torpor_sleep_host_bytes(torpor_pool_t pool, int level, const char* const* tags, size_t count,
                                      size_t* bytes) {
  if (bytes == nullptr) return fail(TORPOR_ERROR_INVALID_ARGUMENT, "torpor_sleep_host_bytes: bytes is NULL");
  *bytes = 0;
  return with_pool("torpor_sleep_host_bytes", pool, [&](CPool& p) {
    auto t = to_strings(tags, count, "tags");
    *bytes = p.pool->sleep_host_bytes(level, t);
  });
}

torpor_status torpor_sleep(torpor_pool_t pool, int level, const char* const* tags, size_t count) {
  return with_pool("torpor_sleep", pool, [&](CPool& p) {
    auto t = to_strings(tags, count, "tags");
    TransitionReport r = p.pool->sleep(level, t);
    std::lock_guard lock(p.report_mu);
    p.last_report = to_json(r);
  });
}

torpor_status torpor_add_sleep_hook(torpor_pool_t pool, torpor_before_sleep_hook before_sleep,
                                    torpor_after_wake_hook after_wake, void* user, unsigned long long* id) {
  if (id == nullptr) return fail(TORPOR_ERROR_INVALID_ARGUMENT, "torpor_add_sleep_hook: id is NULL");
  *id = 0;
  if (before_sleep == nullptr && after_wake == nullptr)
    return fail(TORPOR_ERROR_INVALID_ARGUMENT,
                "torpor_add_sleep_hook: before_sleep and after_wake are both NULL (a hook needs one of them)");
  return with_pool("torpor_add_sleep_hook", pool, [&](CPool& p) {
    std::lock_guard lock(p.hooks_mu);
    auto hook = std::make_unique<HookObserver>(pool, before_sleep, after_wake, user, p.next_hook);
    p.hooks.reserve(p.hooks.size() + 1);  // no throw between add_observer and the push
    p.pool->add_observer(hook.get());
    p.hooks.push_back(std::move(hook));
    *id = p.next_hook++;
  });
}

torpor_status torpor_set_fill_on_wake(torpor_pool_t pool, int fill, int* previous) {
  if (fill < TORPOR_FILL_NONE || fill > TORPOR_FILL_POISON)
    return fail(TORPOR_ERROR_INVALID_ARGUMENT,
                fmt::format("torpor_set_fill_on_wake: unknown fill {} (0 none, 1 zero, 2 poison)", fill));
  return with_pool("torpor_set_fill_on_wake", pool, [&](CPool& p) {
    FillOnWake old = p.pool->set_fill_on_wake(static_cast<FillOnWake>(fill));
    if (previous != nullptr) *previous = static_cast<int>(old);
  });
}

torpor_status torpor_add_tag_hooks(torpor_pool_t pool, const char* tag, torpor_before_unmap_hook before_unmap,
                                   torpor_after_map_hook after_map, void* user, unsigned long long* id) {
  if (id == nullptr) return fail(TORPOR_ERROR_INVALID_ARGUMENT, "torpor_add_tag_hooks: id is NULL");
  *id = 0;
  if (tag == nullptr) return fail(TORPOR_ERROR_INVALID_ARGUMENT, "torpor_add_tag_hooks: tag is NULL");
  if (before_unmap == nullptr && after_map == nullptr)
    return fail(TORPOR_ERROR_INVALID_ARGUMENT,
                "torpor_add_tag_hooks: before_unmap and after_map are both NULL (a hook needs one of them)");
  return with_pool("torpor_add_tag_hooks", pool, [&](CPool& p) {
    TagHooks hooks;
    if (before_unmap != nullptr)
      hooks.before_unmap = [=](const std::string& t) {
        constexpr std::size_t capacity = 4096;
        std::string message(capacity, '\0');
        const torpor_status s = before_unmap(user, pool, t.c_str(), message.data(), message.size());
        if (s == TORPOR_OK) return;
        message.resize(std::min(std::strlen(message.c_str()), message.size()));
        throw_refusal(s, fmt::format("before_unmap hook of tag '{}' refused the sleep: {}", t,
                                     message.empty() ? std::string("(the hook gave no reason)") : message));
      };
    if (after_map != nullptr) hooks.after_map = [=](const std::string& t) { after_map(user, pool, t.c_str()); };
    *id = p.pool->add_tag_hooks(tag, std::move(hooks));
  });
}

torpor_status torpor_remove_tag_hooks(torpor_pool_t pool, unsigned long long id) {
  return with_pool("torpor_remove_tag_hooks", pool, [&](CPool& p) { p.pool->remove_tag_hooks(id); });
}

torpor_status torpor_run_after_map_hooks(torpor_pool_t pool) {
  return with_pool("torpor_run_after_map_hooks", pool, [&](CPool& p) { p.pool->run_after_map_hooks(); });
}

torpor_status torpor_remove_sleep_hook(torpor_pool_t pool, unsigned long long id) {
  return with_pool("torpor_remove_sleep_hook", pool, [&](CPool& p) {
    std::lock_guard lock(p.hooks_mu);
    auto it = std::find_if(p.hooks.begin(), p.hooks.end(),
                           [&](const std::unique_ptr<HookObserver>& h) { return h->id() == id && h->active(); });
    if (it == p.hooks.end())
      throw invalid_argument(fmt::format("{} is not a sleep hook of this pool (removed twice, or never added)", id));
    p.pool->remove_observer(it->get());
    (*it)->deactivate();
  });
}

torpor_status torpor_wake_up(torpor_pool_t pool, const char* const* tags, size_t count) {
  return with_pool("torpor_wake_up", pool, [&](CPool& p) {
    auto t = to_strings(tags, count, "tags");
    TransitionReport r = p.pool->wake_up(t);
    std::lock_guard lock(p.report_mu);
    p.last_report = to_json(r);
  });
}

torpor_status torpor_stats_json(torpor_pool_t pool, char* buffer, size_t capacity, size_t* needed) {
  return with_pool("torpor_stats_json", pool,
                   [&](CPool& p) { write_out(to_json(p.pool->stats()), buffer, capacity, needed); });
}

torpor_status torpor_tags_json(torpor_pool_t pool, char* buffer, size_t capacity, size_t* needed) {
  return with_pool("torpor_tags_json", pool, [&](CPool& p) {
    std::vector<std::string> tags = p.pool->tags();
    std::sort(tags.begin(), tags.end());
    write_out(nlohmann::json(tags).dump(), buffer, capacity, needed);
  });
}

torpor_status torpor_last_report_json(torpor_pool_t pool, char* buffer, size_t capacity, size_t* needed) {
  return with_pool("torpor_last_report_json", pool, [&](CPool& p) {
    std::lock_guard lock(p.report_mu);
    write_out(p.last_report, buffer, capacity, needed);
  });
}

const char* torpor_pool_backend(torpor_pool_t pool) {
  try {
    auto p = lookup(pool);
    return to_string(p->driver.backend).data();  // the table's names are literals
  } catch (...) {
    last_error = "torpor_pool_backend: pool handle is not a live pool";
    return nullptr;
  }
}

torpor_status torpor_find(torpor_pool_t pool, const void* ptr, void** base, size_t* bytes) {
  return with_pool("torpor_find", pool, [&](CPool& p) {
    auto info = p.pool->find(ptr);
    if (!info) throw invalid_argument(fmt::format("{} is not inside any allocation of this pool", ptr));
    if (base != nullptr) *base = reinterpret_cast<void*>(info->base);
    if (bytes != nullptr) *bytes = info->bytes;
  });
}

torpor_status torpor_export_handles(torpor_pool_t pool, const char* const* tags, size_t count, int kind,
                                    torpor_chunk_export* out, size_t capacity, size_t* exported) {
  if (exported == nullptr) return fail(TORPOR_ERROR_INVALID_ARGUMENT, "torpor_export_handles: exported is NULL");
  *exported = 0;
  return with_pool("torpor_export_handles", pool, [&](CPool& p) {
    if (kind < TORPOR_HANDLE_AUTO || kind > TORPOR_HANDLE_FABRIC)
      throw invalid_argument(fmt::format("unknown handle kind {} (0 = TORPOR_HANDLE_AUTO, 1 = TORPOR_HANDLE_POSIX_FD, "
                                         "2 = TORPOR_HANDLE_FABRIC)",
                                         kind));
    if (out == nullptr && capacity > 0)
      throw invalid_argument(fmt::format("out is NULL but capacity is {} (pass NULL and 0 to ask how many)", capacity));
    const std::vector<std::string> t = to_strings(tags, count, "tags");
    const std::optional<HandleKind> k =
        kind == TORPOR_HANDLE_AUTO ? std::nullopt : std::optional<HandleKind>(static_cast<HandleKind>(kind));
    const std::size_t n = p.pool->export_count(t, k);
    *exported = n;
    if (out == nullptr) return;  // the question: how many
    if (n > capacity)
      throw invalid_argument(fmt::format("{} chunks to export, room for {} in out: nothing exported; call again with "
                                         "room for {} (*exported says how many)",
                                         n, capacity, n));
    // The descriptors are owned by `chunks` until the last check passed, so a refusal closes them.
    std::vector<ExportedChunk> chunks = p.pool->export_handles(t, k, capacity);
    *exported = chunks.size();
    for (const ExportedChunk& c : chunks)
      if (c.tag.size() > TORPOR_EXPORT_TAG_MAX)
        throw invalid_argument(fmt::format("the tag of chunk {:#x} is {} bytes, more than TORPOR_EXPORT_TAG_MAX ({}) "
                                           "an entry carries: nothing exported; use a shorter tag",
                                           c.va, c.tag.size(), TORPOR_EXPORT_TAG_MAX));
    for (std::size_t i = 0; i < chunks.size(); ++i) {  // nothing below throws
      ExportedChunk& c = chunks[i];
      torpor_chunk_export& e = out[i];
      e = torpor_chunk_export{};
      e.va = reinterpret_cast<void*>(c.va);
      e.bytes = c.bytes;
      e.kind = static_cast<int>(c.kind);
      std::memcpy(e.fabric, c.fabric.bytes.data(), sizeof e.fabric);
      e.gpu_direct_rdma = c.gpu_direct_rdma ? 1 : 0;
      std::memcpy(e.tag, c.tag.data(), c.tag.size());  // e.tag is zeroed: NUL-terminated
      e.fd = c.release_fd();                           // -1 for a fabric handle
    }
  });
}

torpor_status torpor_pool_exportable(torpor_pool_t pool, int* exportable) {
  if (exportable == nullptr) return fail(TORPOR_ERROR_INVALID_ARGUMENT, "torpor_pool_exportable: exportable is NULL");
  *exportable = 0;
  return with_pool("torpor_pool_exportable", pool,
                   [&](CPool& p) { *exportable = p.pool->options().exportable ? 1 : 0; });
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

const char* torpor_last_error(void) { return last_error.c_str(); }

const char* torpor_version() { return TORPOR_VERSION; }

const char* torpor_status_name(torpor_status s) {
  const char* name = detail::status_name_of(s);
  return name != nullptr ? name : "TORPOR_ERROR_UNKNOWN";
}

int torpor_status_value(const char* name) {
  if (name == nullptr) return -1;
  for (int s = TORPOR_OK; s <= status_last; ++s)
    if (std::string_view(torpor_status_name(static_cast<torpor_status>(s))) == name) return s;
  return -1;
}

const char* torpor_class_name(int memory_class) {
  if (memory_class < 0 || memory_class >= static_cast<int>(memory_class_count)) return nullptr;
  return to_string(static_cast<MemoryClass>(memory_class)).data();
}

const char* torpor_backend_name(int backend) {
  const std::optional<Backend> b = backend_of(backend);
  return b ? to_string(*b).data() : nullptr;
}

const char* torpor_fill_name(int fill) {
  if (fill < TORPOR_FILL_NONE || fill > TORPOR_FILL_POISON) return nullptr;
  return to_string(static_cast<FillOnWake>(fill)).data();
}

const char* torpor_handle_kind_name(int kind) { return detail::handle_kind_name_of(kind); }

const char* torpor_sleep_level_name(int level) { return detail::sleep_level_name_of(level); }

torpor_status torpor_graph_memory_nodes(unsigned long long graph, size_t* count) {
  return guarded("torpor_graph_memory_nodes", [&] {
    if (count == nullptr) throw invalid_argument("count is NULL");
    if (graph == 0) throw invalid_argument("graph is 0 (no captured graph)");
    *count = shared_driver(Backend::cuda).driver->graph_memory_nodes(static_cast<std::uintptr_t>(graph));
  });
}

torpor_status torpor_graph_memory(int device, unsigned long long* used, unsigned long long* reserved) {
  return guarded("torpor_graph_memory", [&] {
    if (used == nullptr || reserved == nullptr) throw invalid_argument("used or reserved is NULL");
    const GraphMemory m = shared_driver(Backend::cuda).driver->graph_memory(device);
    *used = m.used_bytes;
    *reserved = m.reserved_bytes;
  });
}

}  // extern "C"

// --- groups over the embedder's collectives ------------------------------------------------

struct torpor_gather_s {
  std::vector<std::vector<std::byte>> parts;
  std::size_t limit = 0;  // the group's size: more appends than ranks are refused
  std::string failure;
};

namespace {

constexpr int group_size_max = 65536;
constexpr int group_timeout_ms_max = 86400000;

GroupCallbacks callbacks_of(const torpor_group_callbacks& c, int size) {
  GroupCallbacks out;
  out.all_gather = [c, size](std::span<const std::byte> mine) {
    torpor_gather_s gathered;
    gathered.limit = static_cast<std::size_t>(size);
    int rc = c.all_gather(c.user, mine.data(), mine.size(), &gathered);
    if (rc != 0) throw error(fmt::format("returned {}{}", rc, gathered.failure.empty() ? "" : ": " + gathered.failure));
    return std::move(gathered.parts);
  };
  out.barrier = [c] {
    int rc = c.barrier(c.user);
    if (rc != 0) throw error(fmt::format("returned {}", rc));
  };
  return out;
}

template <typename F>
torpor_status with_pool_and_group(const char* fn, torpor_pool_t pool, torpor_group_t group, F&& f) {
  Registry& r = registry();
  std::shared_ptr<CallbackGroup> g = r.find(r.groups, group);
  if (!g)
    return fail(TORPOR_ERROR_INVALID_HANDLE, fmt::format("{}: group handle {} is not a live group (destroyed, or "
                                                         "never created)",
                                                         fn, static_cast<void*>(group)));
  return with_pool(fn, pool, [&](CPool& p) { f(p, *g); });
}

}  // namespace

torpor_status torpor_group_create_callbacks(int rank, int size, const torpor_group_callbacks* callbacks, int timeout_ms,
                                            torpor_group_t* out) {
  return guarded("torpor_group_create_callbacks", [&] {
    if (out == nullptr) throw invalid_argument("out is NULL");
    *out = nullptr;
    if (callbacks == nullptr || callbacks->all_gather == nullptr || callbacks->barrier == nullptr)
      throw invalid_argument("callbacks, callbacks->all_gather and callbacks->barrier must all be set");
    if (size < 1 || size > group_size_max)
      throw invalid_argument(fmt::format("size {} is outside [1, {}]", size, group_size_max));
    if (rank < 0 || rank >= size) throw invalid_argument(fmt::format("rank {} is outside [0, {})", rank, size));
    if (timeout_ms < 0 || timeout_ms > group_timeout_ms_max)
      throw invalid_argument(
          fmt::format("timeout_ms {} is outside [0, {}] (0 = the default)", timeout_ms, group_timeout_ms_max));
    GroupOptions o;
    o.timeout = std::chrono::milliseconds(timeout_ms);
    auto g = std::make_shared<CallbackGroup>(rank, size, callbacks_of(*callbacks, size), o);
    Registry& r = registry();
    *out = reinterpret_cast<torpor_group_t>(r.add(r.groups, std::move(g)));
  });
}

torpor_status torpor_group_destroy(torpor_group_t group) {
  Registry& r = registry();
  std::shared_ptr<CallbackGroup> g = r.take(r.groups, group);
  if (!g) return not_live_to_destroy("torpor_group_destroy", "group", group);
  return guarded("torpor_group_destroy", [&] { g.reset(); });
}

torpor_status torpor_gather_append(torpor_gather_t out, const void* data, size_t bytes) {
  return guarded("torpor_gather_append", [&] {
    if (out == nullptr) throw invalid_argument("out is NULL");
    if (data == nullptr && bytes > 0) throw invalid_argument(fmt::format("data is NULL but bytes is {}", bytes));
    if (out->parts.size() >= out->limit)
      throw invalid_argument(
          fmt::format("already {} parts appended, one per rank of a group of {}", out->parts.size(), out->limit));
    const auto* p = static_cast<const std::byte*>(data);
    out->parts.emplace_back(p, p + bytes);
  });
}

void torpor_gather_fail(torpor_gather_t out, const char* message) {
  if (out != nullptr && message != nullptr) out->failure = message;
}

torpor_status torpor_collective_sleep(torpor_pool_t pool, torpor_group_t group, int level, const char* const* tags,
                                      size_t count) {
  return with_pool_and_group("torpor_collective_sleep", pool, group, [&](CPool& p, CallbackGroup& g) {
    auto t = to_strings(tags, count, "tags");
    TransitionReport r = collective_sleep(*p.pool, g, level, t);
    std::lock_guard lock(p.report_mu);
    p.last_report = to_json(r);
  });
}

torpor_status torpor_collective_wake_up(torpor_pool_t pool, torpor_group_t group, const char* const* tags,
                                        size_t count) {
  return with_pool_and_group("torpor_collective_wake_up", pool, group, [&](CPool& p, CallbackGroup& g) {
    auto t = to_strings(tags, count, "tags");
    TransitionReport r = collective_wake_up(*p.pool, g, t);
    std::lock_guard lock(p.report_mu);
    p.last_report = to_json(r);
  });
}
