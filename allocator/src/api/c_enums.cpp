// The C enumerations' tables, and the C API's entry points that name their values
// (torpor_status_name, torpor_class_name, ...). See c_enums.hpp.
#include "api/c_enums.hpp"

#include <array>
#include <optional>
#include <string_view>

#include "common/enum_names.hpp"
#include "common/error_kind.hpp"
#include "torpor/driver.hpp"
#include "torpor/tags.hpp"

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

namespace torpor::detail {

namespace {

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

}  // namespace torpor::detail

extern "C" {

const char* torpor_version() { return TORPOR_VERSION; }

const char* torpor_status_name(torpor_status s) {
  const std::optional<torpor::ErrorKind> kind = torpor::error_kind_of_status(s);
  return kind ? torpor::status_name(*kind) : "TORPOR_ERROR_UNKNOWN";
}

int torpor_status_value(const char* name) {
  if (name == nullptr) return -1;
  for (int k = 0; k < torpor::error_kind_count; ++k) {
    const auto kind = static_cast<torpor::ErrorKind>(k);
    if (std::string_view(torpor::status_name(kind)) == name) return torpor::status_of(kind);
  }
  return -1;
}

const char* torpor_class_name(int memory_class) { return torpor::detail::class_name_of(memory_class); }

const char* torpor_backend_name(int backend) {
  const std::optional<torpor::Backend> b = torpor::detail::backend_of(backend);
  return b ? to_string(*b).data() : nullptr;
}

const char* torpor_fill_name(int fill) {
  if (fill < TORPOR_FILL_NONE || fill > TORPOR_FILL_POISON) return nullptr;
  return to_string(static_cast<torpor::FillOnWake>(fill)).data();
}

const char* torpor_handle_kind_name(int kind) { return torpor::detail::handle_kind_name_of(kind); }

const char* torpor_sleep_level_name(int level) { return torpor::detail::sleep_level_name_of(level); }

}  // extern "C"
