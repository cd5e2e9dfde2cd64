// The C API's sleep, wake and hooks (torpor.h): sleep and wake of a pool, its preserve globs,
// its fill on wake, the C sleep hooks (before_sleep / after_wake, as a SleepObserver) and the
// tag hooks (before_unmap / after_map). A hook that refuses gives a status; the sleep then
// throws that status's exception type (common/error_kind), so torpor_sleep, and a collective
// sleep, which sends the type to every rank, report the kind of failure the hook returned.
#include <fmt/core.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "api/c_api_internal.hpp"
#include "common/error_kind.hpp"
#include "torpor/error.hpp"
#include "torpor/pool.hpp"
#include "torpor/torpor.h"

namespace torpor::detail {

namespace {

// The typed error of a hook's status. A status whose kind does not come back as its own type
// (TORPOR_ERROR_DRIVER, ..., or no status at all) is a torpor::error whose message names it.
[[noreturn]] void throw_refusal(torpor_status s, const std::string& message) {
  const std::optional<ErrorKind> kind = error_kind_of_status(s);
  if (kind && raises_own_type(*kind)) raise_error_kind(*kind, message);
  throw error(fmt::format("{} (status {})", message, torpor_status_name(s)));
}

}  // namespace

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

CPool::CPool() = default;
CPool::~CPool() = default;

}  // namespace torpor::detail

namespace {

using namespace torpor;
using namespace torpor::detail;

}  // namespace

extern "C" {

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

}  // extern "C"
