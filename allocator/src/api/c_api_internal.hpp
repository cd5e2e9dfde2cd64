// Hooks of the C API for other C entry points of libtorpor (the PyTorch allocator), so their
// failures land in the same thread-local torpor_last_error().
#pragma once

#include <string>

namespace torpor::detail {

void set_last_error(std::string message) noexcept;

}  // namespace torpor::detail
