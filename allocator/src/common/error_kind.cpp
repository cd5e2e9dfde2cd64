// The ErrorKind table. See error_kind.hpp.
#include "common/error_kind.hpp"

#include <array>
#include <new>
#include <type_traits>

#include "torpor/error.hpp"

namespace torpor {

namespace {

using Matcher = bool (*)(const std::exception&) noexcept;
using Raiser = void (*)(const std::string&);

struct ErrorKindRow {
  ErrorKind kind;
  torpor_status status;
  const char* status_name;  // as torpor.h spells it
  Matcher matches;          // whether a caught exception is of this kind; nullptr: no exception is
  Raiser raise;             // throws the kind's exception with the message
  bool own_type;            // `raise` throws a type that `matches` accepts
};

template <class E>
bool is_a(const std::exception& e) noexcept {
  return dynamic_cast<const E*>(&e) != nullptr;
}

template <class E>
void throw_as(const std::string& message) {
  throw E(message);
}

// Out of memory wherever it ran out: ours, the C++ runtime's, or the driver's.
bool is_out_of_memory(const std::exception& e) noexcept {
  if (is_a<out_of_memory>(e) || is_a<std::bad_alloc>(e)) return true;
  const auto* d = dynamic_cast<const driver_error*>(&e);
  return d != nullptr && d->is_out_of_memory();
}

bool is_driver_failure(const std::exception& e) noexcept {
  const auto* d = dynamic_cast<const driver_error*>(&e);
  return d != nullptr && !d->is_out_of_memory();
}

// A row whose kind is raised again as `Raised`: its own type unless that is torpor::error, the
// type of the kinds whose type a status cannot carry.
template <class Raised>
constexpr ErrorKindRow row(ErrorKind kind, torpor_status status, const char* name, Matcher matches) {
  return {kind, status, name, matches, throw_as<Raised>, !std::is_same_v<Raised, error>};
}

// One row per kind, in ErrorKind's order. The matchers are disjoint; an exception none of them
// takes is internal (its row has no matcher: it is the fallback).
constexpr std::array<ErrorKindRow, error_kind_count> rows{{
    row<error>(ErrorKind::none, TORPOR_OK, "TORPOR_OK", nullptr),
    row<error>(ErrorKind::internal, TORPOR_ERROR_INTERNAL, "TORPOR_ERROR_INTERNAL", nullptr),
    row<invalid_argument>(ErrorKind::invalid_argument, TORPOR_ERROR_INVALID_ARGUMENT, "TORPOR_ERROR_INVALID_ARGUMENT",
                          is_a<invalid_argument>),
    row<invalid_state>(ErrorKind::invalid_state, TORPOR_ERROR_INVALID_STATE, "TORPOR_ERROR_INVALID_STATE",
                       is_a<invalid_state>),
    row<out_of_memory>(ErrorKind::out_of_memory, TORPOR_ERROR_OUT_OF_MEMORY, "TORPOR_ERROR_OUT_OF_MEMORY",
                       is_out_of_memory),
    row<timeout_error>(ErrorKind::timeout, TORPOR_ERROR_TIMEOUT, "TORPOR_ERROR_TIMEOUT", is_a<timeout_error>),
    row<unavailable>(ErrorKind::unavailable, TORPOR_ERROR_UNAVAILABLE, "TORPOR_ERROR_UNAVAILABLE", is_a<unavailable>),
    // The C status carries no CUresult and no call, so a driver failure comes back as torpor::error.
    row<error>(ErrorKind::driver, TORPOR_ERROR_DRIVER, "TORPOR_ERROR_DRIVER", is_driver_failure),
    row<error>(ErrorKind::invalid_handle, TORPOR_ERROR_INVALID_HANDLE, "TORPOR_ERROR_INVALID_HANDLE", nullptr),
}};

constexpr bool rows_in_kind_order() {
  for (std::size_t i = 0; i < rows.size(); ++i)
    if (static_cast<std::size_t>(rows[i].kind) != i) return false;
  return true;
}
static_assert(rows_in_kind_order(), "rows[k] is the row of ErrorKind k");

// The highest torpor_status: torpor.h's statuses run from TORPOR_OK up to it without gaps.
constexpr int status_last = TORPOR_ERROR_UNAVAILABLE;

constexpr bool one_row_per_status() {
  if (rows.size() != static_cast<std::size_t>(status_last) + 1) return false;
  for (int s = TORPOR_OK; s <= status_last; ++s) {
    int found = 0;
    for (const ErrorKindRow& r : rows) found += r.status == s ? 1 : 0;
    if (found != 1) return false;
  }
  return true;
}
static_assert(one_row_per_status(), "every torpor_status has exactly one row");

const ErrorKindRow& row_of(ErrorKind kind) noexcept {
  const auto i = static_cast<std::size_t>(kind);
  return i < rows.size() ? rows[i] : rows[static_cast<std::size_t>(ErrorKind::internal)];
}

}  // namespace

ErrorKind error_kind_of(const std::exception& e) noexcept {
  for (const ErrorKindRow& r : rows)
    if (r.matches != nullptr && r.matches(e)) return r.kind;
  return ErrorKind::internal;
}

CaughtError caught_error() {
  try {
    throw;
  } catch (const std::bad_alloc&) {
    return {ErrorKind::out_of_memory, "host out of memory"};
  } catch (const std::exception& e) {
    return {error_kind_of(e), e.what()};
  } catch (...) {
    return {ErrorKind::internal, "unknown exception"};
  }
}

void raise_error_kind(ErrorKind kind, const std::string& message) {
  row_of(kind).raise(message);
  throw error(message);  // not reached: every row's raise throws
}

bool raises_own_type(ErrorKind kind) noexcept { return row_of(kind).own_type; }

torpor_status status_of(ErrorKind kind) noexcept { return row_of(kind).status; }

std::optional<ErrorKind> error_kind_of_status(int status) noexcept {
  for (const ErrorKindRow& r : rows)
    if (r.status == status) return r.kind;
  return std::nullopt;
}

const char* status_name(ErrorKind kind) noexcept { return row_of(kind).status_name; }

}  // namespace torpor
