// Consensus over a Group: the one way torpor's collective operations agree before they act and
// learn together how the action went, so no rank waits in a later collective for a rank that
// already gave up, and every rank raises the same error.
//
//   - encode_fields / decode_fields: a canonical byte form of a list of strings (each field
//     length-prefixed, so any byte may appear in a field);
//   - gather_text: every rank's text, indexed by rank;
//   - compare_requests / agree: every rank all-gathers a canonical request (and, alongside it, a
//     per-rank extra that need not agree); agree() throws invalid_argument on every rank when a
//     request differs from rank 0's, naming those ranks, before anything has changed;
//   - run_all_or_none: each rank runs its action, every rank all-gathers every rank's outcome
//     (error type and message), and when any rank failed every rank runs its rollback. The
//     returned Outcomes name the failed ranks (the first one first) and re-raise the first failed
//     rank's error type on every rank.
// Every function here is a collective: every rank calls it, in the same order. A group failure
// (timeout, broken group) propagates as the group's own error.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "torpor/group.hpp"

namespace torpor::consensus {

std::vector<std::byte> to_bytes(std::string_view text);
std::string from_bytes(std::span<const std::byte> bytes);

// "<length>:<bytes>" for each field, in order: the same fields give the same bytes everywhere.
std::string encode_fields(std::initializer_list<std::string_view> fields);
std::string encode_fields(const std::vector<std::string>& fields);
// The fields of encode_fields' text; throws error naming `what` when the text is malformed or
// holds another number of fields than `count`.
std::vector<std::string> decode_fields(std::string_view text, std::size_t count, std::string_view what);

// Every rank's text, indexed by rank, own included.
std::vector<std::string> gather_text(Group& group, std::string_view mine);

struct Agreement {
  std::vector<std::string> requests;  // by rank
  std::vector<std::string> extras;    // by rank: what each sent alongside its request
  std::vector<int> differing;         // the ranks whose request is not rank 0's
  bool agreed() const noexcept { return differing.empty(); }
};

// One all-gather of (request, extra) from every rank; compares the requests with rank 0's.
Agreement compare_requests(Group& group, std::string_view request, std::string_view extra = {});

// compare_requests, then on a mismatch every rank throws invalid_argument: "<operation> on group
// rank R of N (kind): rank(s) [..] asked for another operation than rank 0 (rank 0: ...; rank r:
// ...); no rank changed anything". Returns every rank's extra.
std::vector<std::string> agree(Group& group, std::string_view operation, std::string_view request,
                               std::string_view extra = {});

// The error types an outcome travels as, so every rank can raise the failed rank's type.
enum class Failure : std::uint8_t {
  none = 0,
  error,
  invalid_argument,
  invalid_state,
  out_of_memory,
  timeout,
  unavailable,
  driver,
};

struct Outcome {
  Failure failure = Failure::none;
  std::string message;
  bool ok() const noexcept { return failure == Failure::none; }
  static Outcome failed(std::string message, Failure failure = Failure::error) { return {failure, std::move(message)}; }
};

// The Failure an exception travels as (a driver_error that means out of memory travels as one).
Failure classify(const std::exception& e) noexcept;
// Throws the exception type `failure` stands for, with `text` (Failure::driver and error: error).
[[noreturn]] void raise(Failure failure, const std::string& text);

// One all-gather of every rank's outcome, indexed by rank.
std::vector<Outcome> gather_outcomes(Group& group, const Outcome& mine);

struct Outcomes {
  std::vector<Outcome> by_rank;
  std::exception_ptr local;      // this rank's own exception, when its action failed
  std::string rollback_failure;  // this rank's rollback error, when its rollback threw

  bool ok() const noexcept;
  // The failed ranks in rank order; -1 / empty when every rank succeeded.
  std::vector<int> failed_ranks() const;
  int first_failed() const noexcept;
  const Outcome& first() const;  // the first failed rank's outcome (ok() must be false)
  // "; rank r: <message>" for every failed rank.
  std::string details() const;
  // Throws the first failed rank's error type with `text`.
  [[noreturn]] void raise(const std::string& text) const;
};

// Runs action (a std::exception it throws becomes this rank's outcome, never escapes past the
// all-gather), all-gathers every rank's outcome, and when any rank failed runs rollback on
// every rank (an exception from it is kept in rollback_failure). If the all-gather itself
// fails, the group's error propagates and rollback does not run.
Outcomes run_all_or_none(Group& group, const std::function<void()>& action, const std::function<void()>& rollback = {});

}  // namespace torpor::consensus
