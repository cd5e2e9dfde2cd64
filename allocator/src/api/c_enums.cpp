// The C enumerations' tables. See c_enums.hpp.
#include "api/c_enums.hpp"

#include <array>

#include "common/enum_names.hpp"

namespace torpor::detail {

namespace {

constexpr auto handle_kind_names = std::to_array<EnumName<int>>(
    {{TORPOR_HANDLE_AUTO, "auto"}, {TORPOR_HANDLE_POSIX_FD, "posix_fd"}, {TORPOR_HANDLE_FABRIC, "fabric"}});

}  // namespace

std::optional<Backend> backend_of(int backend) noexcept {
  switch (backend) {
    case TORPOR_BACKEND_AUTO: return Backend::automatic;
    case TORPOR_BACKEND_HOST: return Backend::host;
    case TORPOR_BACKEND_CUDA: return Backend::cuda;
    default: return std::nullopt;
  }
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

}  // namespace torpor::detail
