// The C API's groups over the embedder's collectives and the collective sleep and wake
// (torpor.h): a CallbackGroup whose all-gather and barrier are the embedder's C callbacks (an
// engine's torch.distributed, say), and a pool's sleep and wake run collectively over it. A
// group handle is a registry id of its own kind, beside the pools' (c_api_internal.hpp).
#include <fmt/core.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "api/c_api_internal.hpp"
#include "torpor/callback_group.hpp"
#include "torpor/collective_sleep.hpp"
#include "torpor/error.hpp"
#include "torpor/pool.hpp"
#include "torpor/torpor.h"

struct torpor_gather_s {
  std::vector<std::vector<std::byte>> parts;
  std::size_t limit = 0;  // the group's size: more appends than ranks are refused
  std::string failure;
};

namespace {

using namespace torpor;
using namespace torpor::detail;

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
