// Hooks of the C API for other C entry points of libtorpor (the PyTorch allocator), so their
// failures land in the same thread-local torpor_last_error().
#pragma once

#include <string>

#include "torpor/torpor.h"

namespace torpor::detail {

void set_last_error(std::string message) noexcept;

// Call inside a catch block: the status of the exception being handled (its ErrorKind's,
// common/error_kind.hpp), with "<fn>: <its message>" as the last error.
torpor_status fail_with_caught(const char* fn);

// Marks a pool as the one behind PyTorch's allocator on `device`: torpor_pool_destroy refuses it
// from then on (PyTorch holds segments in it, and the allocator keeps its handle for the
// process's life). False when `pool` is not a live pool.
bool keep_for_torch(torpor_pool_t pool, int device) noexcept;

}  // namespace torpor::detail
