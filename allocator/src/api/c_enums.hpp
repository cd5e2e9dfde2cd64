// The C enumerations of torpor.h, read and named once for both C entry points: the C API
// (c_api_*.cpp) and the PyTorch allocator entry points (torch_allocator.cpp). Each enum has one
// table (common/enum_names.hpp's EnumNames), so the two cannot disagree on what a value means or
// how it prints. The C values of classes and fills are the C++ ones (c_enums.cpp asserts it), so
// they convert by a checked cast. The statuses are named by the ErrorKind table
// (common/error_kind.hpp).
#pragma once

#include <optional>

#include "torpor/backend.hpp"
#include "torpor/pool.hpp"
#include "torpor/torpor.h"

namespace torpor::detail {

// torpor_backend -> Backend; nothing for a value out of range.
std::optional<Backend> backend_of(int backend) noexcept;

// torpor_memory_class -> MemoryClass; nothing for a value out of range.
std::optional<MemoryClass> memory_class_of(int memory_class) noexcept;

// "parameter", "state" or "cache" for a torpor_memory_class; nullptr for a value out of range.
const char* class_name_of(int memory_class) noexcept;

// "auto", "posix_fd" or "fabric" for a torpor_handle_kind; nullptr for a value out of range.
const char* handle_kind_name_of(int kind) noexcept;

// "none", "offload" or "discard_parameters" for a torpor_sleep_level; nullptr out of range.
const char* sleep_level_name_of(int level) noexcept;

}  // namespace torpor::detail
