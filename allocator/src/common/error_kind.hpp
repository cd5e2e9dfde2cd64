// The one vocabulary of failures: which kind of failure an exception stands for, which C status
// (torpor.h) that kind is, and which exception it comes back as. Every boundary that turns an
// exception into something else and back goes through it: the C API (exception -> status), its
// hooks (a hook's status -> exception), the PyTorch entry points (exception -> status), and
// consensus (an exception -> the kind a rank's outcome travels as -> the same exception type on
// every rank).
//
// Design: one table (error_kind.cpp) with a row per kind: the kind, its C status and that
// status's name as torpor.h spells it, what it matches when classifying a caught exception, and
// what it throws when raised again. Invariants: every torpor_status has exactly one row
// (statuses run from TORPOR_OK up without gaps, checked at compile time); classifying never
// yields `none` or `invalid_handle` (no exception stands for them); a kind raised again comes
// back as its own exception type, except the kinds whose type cannot travel as a status (a
// driver failure's CUresult, an internal error's type): those come back as torpor::error.
// ErrorKind's values are the bytes consensus sends between ranks (consensus::Failure), so a new
// kind goes at the end.
#pragma once

#include <cstdint>
#include <exception>
#include <optional>
#include <string>

#include "torpor/status.h"

namespace torpor {

enum class ErrorKind : std::uint8_t {
  none = 0,          // no failure: TORPOR_OK
  internal,          // torpor::error, or any other std::exception: a bug or an unclassified failure
  invalid_argument,  // a request that can never succeed as asked
  invalid_state,     // a valid request in the wrong state
  out_of_memory,     // device, VA or host memory exhausted (std::bad_alloc, a driver's out of memory)
  timeout,           // a bounded wait ran out
  unavailable,       // a backend or feature this machine or build cannot provide
  driver,            // a driver call failed (not for lack of memory)
  invalid_handle,    // a C handle that is not live (the C API only: no exception stands for it)
};

// Every kind, in the table's order.
inline constexpr int error_kind_count = static_cast<int>(ErrorKind::invalid_handle) + 1;

// The kind of a caught exception (an unclassified std::exception: internal).
ErrorKind error_kind_of(const std::exception& e) noexcept;

// The kind and text of the exception being handled: call only inside a catch block. A
// std::bad_alloc reads "host out of memory", an exception that is not a std::exception
// "unknown exception".
struct CaughtError {
  ErrorKind kind = ErrorKind::internal;
  std::string message;
};
CaughtError caught_error();

// Throws the kind's exception type with `message` (torpor::error for none, internal, driver and
// invalid_handle: see raises_own_type).
[[noreturn]] void raise_error_kind(ErrorKind kind, const std::string& message);

// Whether raise_error_kind throws the kind's own exception type, so that classifying it again
// gives the same kind back; false where the type does not travel (the message should then say
// what the kind was).
bool raises_own_type(ErrorKind kind) noexcept;

// The C status of a kind, and back (nothing for a value that is not a torpor_status).
torpor_status status_of(ErrorKind kind) noexcept;
std::optional<ErrorKind> error_kind_of_status(int status) noexcept;

// "TORPOR_OK", "TORPOR_ERROR_INVALID_ARGUMENT", ...: the status's name as torpor.h spells it.
const char* status_name(ErrorKind kind) noexcept;

}  // namespace torpor
