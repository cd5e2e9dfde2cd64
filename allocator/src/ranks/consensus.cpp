// Consensus over a Group (consensus.hpp): the wire forms of a request and of an outcome, written
// once for every collective in torpor.
//
// Invariants: every function makes exactly one group call (run_all_or_none: one all-gather, then
// the rollback), whatever happens locally, so ranks stay matched call for call; a local failure
// is caught and reported through the outcome all-gather, never thrown past a collective other
// ranks wait in. Wire forms: a request is encode_fields({request, extra}); an outcome is one byte
// of Failure followed by the message.
#include "torpor/consensus.hpp"

#include <fmt/core.h>

#include <charconv>
#include <new>

#include "common/error_kind.hpp"
#include "torpor/error.hpp"

namespace torpor::consensus {

std::vector<std::byte> to_bytes(std::string_view text) {
  auto b = std::as_bytes(std::span(text.data(), text.size()));
  return {b.begin(), b.end()};
}

std::string from_bytes(std::span<const std::byte> bytes) {
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

std::string encode_fields(std::initializer_list<std::string_view> fields) {
  std::string out;
  for (std::string_view f : fields) out += fmt::format("{}:{}", f.size(), f);
  return out;
}

std::string encode_fields(const std::vector<std::string>& fields) {
  std::string out;
  for (const std::string& f : fields) out += fmt::format("{}:{}", f.size(), f);
  return out;
}

std::vector<std::string> decode_fields(std::string_view text, std::size_t count, std::string_view what) {
  std::vector<std::string> out;
  while (!text.empty()) {
    std::size_t length = 0;
    auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), length);
    const auto digits = static_cast<std::size_t>(end - text.data());
    if (ec != std::errc() || digits == text.size() || *end != ':' || length > text.size() - digits - 1)
      throw error(fmt::format("{}: malformed (a field's length is missing or too long)", what));
    out.emplace_back(text.substr(digits + 1, length));
    text.remove_prefix(digits + 1 + length);
  }
  if (out.size() != count) throw error(fmt::format("{}: malformed ({} fields, expected {})", what, out.size(), count));
  return out;
}

std::vector<std::string> gather_text(Group& group, std::string_view mine) {
  auto all = group.all_gather(to_bytes(mine));
  std::vector<std::string> out;
  out.reserve(all.size());
  for (const auto& b : all) out.push_back(from_bytes(b));
  return out;
}

Agreement compare_requests(Group& group, std::string_view request, std::string_view extra) {
  auto all = gather_text(group, encode_fields({request, extra}));
  Agreement a;
  for (std::size_t r = 0; r < all.size(); ++r) {
    auto f = decode_fields(all[r], 2, fmt::format("the request of group rank {}", r));
    a.requests.push_back(std::move(f[0]));
    a.extras.push_back(std::move(f[1]));
    if (r > 0 && a.requests[r] != a.requests[0]) a.differing.push_back(static_cast<int>(r));
  }
  return a;
}

std::vector<std::string> agree(Group& group, std::string_view operation, std::string_view request,
                               std::string_view extra) {
  Agreement a = compare_requests(group, request, extra);
  if (a.agreed()) return std::move(a.extras);
  std::string theirs;
  for (int r : a.differing) theirs += fmt::format("; rank {}: {}", r, a.requests[static_cast<std::size_t>(r)]);
  throw invalid_argument(fmt::format("{} on group rank {} of {} ({}): rank(s) {} asked for another operation than "
                                     "rank 0 (rank 0: {}{}); no rank changed anything",
                                     operation, group.rank(), group.size(), group.kind(), format_ranks(a.differing),
                                     a.requests[0], theirs));
}

// A Failure is the ErrorKind it travels as (common/error_kind.hpp): the same values.
Failure classify(const std::exception& e) noexcept {
  static_assert(static_cast<int>(Failure::none) == static_cast<int>(ErrorKind::none) &&
                static_cast<int>(Failure::error) == static_cast<int>(ErrorKind::internal) &&
                static_cast<int>(Failure::invalid_argument) == static_cast<int>(ErrorKind::invalid_argument) &&
                static_cast<int>(Failure::invalid_state) == static_cast<int>(ErrorKind::invalid_state) &&
                static_cast<int>(Failure::out_of_memory) == static_cast<int>(ErrorKind::out_of_memory) &&
                static_cast<int>(Failure::timeout) == static_cast<int>(ErrorKind::timeout) &&
                static_cast<int>(Failure::unavailable) == static_cast<int>(ErrorKind::unavailable) &&
                static_cast<int>(Failure::driver) == static_cast<int>(ErrorKind::driver));
  return static_cast<Failure>(error_kind_of(e));  // never invalid_handle: no exception is
}

void raise(Failure failure, const std::string& text) { raise_error_kind(static_cast<ErrorKind>(failure), text); }

std::vector<Outcome> gather_outcomes(Group& group, const Outcome& mine) {
  std::string wire(1, static_cast<char>(mine.failure));
  wire += mine.message;
  auto all = gather_text(group, wire);
  std::vector<Outcome> out;
  out.reserve(all.size());
  for (const std::string& s : all) {
    if (s.empty()) {
      out.push_back(Outcome::failed("sent an empty outcome"));
      continue;
    }
    auto f = static_cast<std::uint8_t>(s[0]);
    out.push_back(
        {f <= static_cast<std::uint8_t>(Failure::driver) ? static_cast<Failure>(f) : Failure::error, s.substr(1)});
  }
  return out;
}

bool Outcomes::ok() const noexcept { return first_failed() < 0; }

std::vector<int> Outcomes::failed_ranks() const {
  std::vector<int> out;
  for (std::size_t r = 0; r < by_rank.size(); ++r)
    if (!by_rank[r].ok()) out.push_back(static_cast<int>(r));
  return out;
}

int Outcomes::first_failed() const noexcept {
  for (std::size_t r = 0; r < by_rank.size(); ++r)
    if (!by_rank[r].ok()) return static_cast<int>(r);
  return -1;
}

const Outcome& Outcomes::first() const {
  const int r = first_failed();
  if (r < 0) throw invalid_state("consensus: Outcomes::first() when every rank succeeded");
  return by_rank[static_cast<std::size_t>(r)];
}

std::string Outcomes::details() const {
  std::string out;
  for (int r : failed_ranks()) out += fmt::format("; rank {}: {}", r, by_rank[static_cast<std::size_t>(r)].message);
  return out;
}

void Outcomes::raise(const std::string& text) const { consensus::raise(first().failure, text); }

Outcomes run_all_or_none(Group& group, const std::function<void()>& action, const std::function<void()>& rollback) {
  Outcomes o;
  Outcome mine;
  try {
    action();
  } catch (const std::exception& e) {
    o.local = std::current_exception();
    mine = {classify(e), e.what()};
  }
  o.by_rank = gather_outcomes(group, mine);
  if (o.ok() || !rollback) return o;
  try {
    rollback();
  } catch (const std::exception& e) {
    o.rollback_failure = e.what();
  }
  return o;
}

}  // namespace torpor::consensus
