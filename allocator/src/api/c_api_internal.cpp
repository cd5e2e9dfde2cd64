// The C API's shared internals: the last error, the registry of handles, the argument readers.
// See c_api_internal.hpp.
#include "api/c_api_internal.hpp"

#include <fmt/core.h>

#include <algorithm>

#include "common/error_kind.hpp"
#include "torpor/error.hpp"

namespace torpor::detail {

namespace {

thread_local std::string last_error_text;

}  // namespace

void set_last_error(std::string message) noexcept { last_error_text = std::move(message); }

const char* last_error() noexcept { return last_error_text.c_str(); }

torpor_status fail(torpor_status s, std::string message) {
  last_error_text = std::move(message);
  return s;
}

torpor_status fail_with_caught(const char* fn) {
  const CaughtError caught = caught_error();
  return fail(status_of(caught.kind), fmt::format("{}: {}", fn, caught.message));
}

Registry& registry() {
  static auto* r = new Registry;
  return *r;
}

std::shared_ptr<CPool> find_pool(torpor_pool_t handle) {
  Registry& r = registry();
  return r.find(r.pools, handle);
}

torpor_status not_live_to_destroy(const char* fn, const char* what, const void* handle) {
  return fail(TORPOR_ERROR_INVALID_HANDLE,
              fmt::format("{}: {} handle {} is not a live {} (destroyed twice?)", fn, what, handle, what));
}

torpor_status not_a_live_pool(const char* fn, torpor_pool_t handle) {
  return fail(TORPOR_ERROR_INVALID_HANDLE, fmt::format("{}: pool handle {} is not a live pool (destroyed, or never "
                                                       "created)",
                                                       fn, static_cast<void*>(handle)));
}

bool keep_for_torch(torpor_pool_t pool, int device) noexcept {
  try {
    std::shared_ptr<CPool> p = find_pool(pool);
    if (!p) return false;
    p->torch_device = device;
    return true;
  } catch (...) {
    return false;
  }
}

MemoryClass to_class(int c) {
  if (c < 0 || c >= static_cast<int>(memory_class_count))
    throw invalid_argument(fmt::format("unknown memory class {} (expected 0 = TORPOR_CLASS_PARAMETER, "
                                       "1 = TORPOR_CLASS_STATE, 2 = TORPOR_CLASS_CACHE)",
                                       c));
  return static_cast<MemoryClass>(c);
}

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

}  // namespace torpor::detail

// The C entry point of the last error.
const char* torpor_last_error(void) { return torpor::detail::last_error(); }
