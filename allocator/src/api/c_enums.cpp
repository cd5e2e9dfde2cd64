// The C enumerations' tables. See c_enums.hpp.
#include "api/c_enums.hpp"

#include <array>

#include "common/enum_names.hpp"

namespace torpor::detail {

namespace {

constexpr auto status_names =
    std::to_array<EnumName<int>>({{TORPOR_OK, "TORPOR_OK"},
                                  {TORPOR_ERROR_INVALID_ARGUMENT, "TORPOR_ERROR_INVALID_ARGUMENT"},
                                  {TORPOR_ERROR_INVALID_STATE, "TORPOR_ERROR_INVALID_STATE"},
                                  {TORPOR_ERROR_OUT_OF_MEMORY, "TORPOR_ERROR_OUT_OF_MEMORY"},
                                  {TORPOR_ERROR_DRIVER, "TORPOR_ERROR_DRIVER"},
                                  {TORPOR_ERROR_TIMEOUT, "TORPOR_ERROR_TIMEOUT"},
                                  {TORPOR_ERROR_INVALID_HANDLE, "TORPOR_ERROR_INVALID_HANDLE"},
                                  {TORPOR_ERROR_INTERNAL, "TORPOR_ERROR_INTERNAL"},
                                  {TORPOR_ERROR_UNAVAILABLE, "TORPOR_ERROR_UNAVAILABLE"}});
// Every status from TORPOR_OK to status_last has its name (tests/python/test_constants.py checks
// torpor.h's list against torpor_status_value).
static_assert(status_names.size() == status_last + 1);

constexpr auto handle_kind_names = std::to_array<EnumName<int>>(
    {{TORPOR_HANDLE_AUTO, "auto"}, {TORPOR_HANDLE_POSIX_FD, "posix_fd"}, {TORPOR_HANDLE_FABRIC, "fabric"}});

}  // namespace

std::optional<Backend> backend_of(int backend) noexcept {
  const BackendEntry* b = backend_entry_of_c(backend);
  return b ? std::optional<Backend>(b->value) : std::nullopt;
}

std::optional<MemoryClass> memory_class_of(int memory_class) noexcept {
  if (memory_class < 0 || memory_class >= static_cast<int>(memory_class_count)) return std::nullopt;
  return static_cast<MemoryClass>(memory_class);
}

const char* class_name_of(int memory_class) noexcept {
  const std::optional<MemoryClass> c = memory_class_of(memory_class);
  return c ? to_string(*c).data() : nullptr;  // the names are literals, so NUL-terminated
}

const char* handle_kind_name_of(int kind) noexcept {
  const std::string_view name = name_of(handle_kind_names, kind);
  return name == "?" ? nullptr : name.data();
}

const char* sleep_level_name_of(int level) noexcept {
  static_assert(TORPOR_SLEEP_NONE == static_cast<int>(SleepLevel::none) &&
                TORPOR_SLEEP_OFFLOAD == static_cast<int>(SleepLevel::offload) &&
                TORPOR_SLEEP_DISCARD_PARAMETERS == static_cast<int>(SleepLevel::discard_parameters));
  if (level < TORPOR_SLEEP_NONE || level > TORPOR_SLEEP_DISCARD_PARAMETERS) return nullptr;
  return to_string(static_cast<SleepLevel>(level)).data();  // literals, so NUL-terminated
}

const char* status_name_of(int status) noexcept {
  const std::string_view name = name_of(status_names, status);
  return name == "?" ? nullptr : name.data();
}

}  // namespace torpor::detail
