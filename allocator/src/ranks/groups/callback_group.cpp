// CallbackGroup: bytes through the embedder's collectives, fds through a Unix group it
// bootstraps over them. See callback_group.hpp for the contract.
//
// Invariants: a callback's reply is checked for length before anything reads it; after any
// failure broken_ holds the reason and every collective refuses until recover(); the fd
// subgroup is created inside a collective (all_gather_fds), so every rank creates it at the
// same point of the collective order.
#include "torpor/callback_group.hpp"

#include <fmt/core.h>

#include <string_view>

#include "torpor/log.hpp"

namespace torpor {

CallbackGroup::CallbackGroup(int rank, int size, GroupCallbacks callbacks, const GroupOptions& options)
    : Group(options), rank_(rank), size_(size), callbacks_(std::move(callbacks)), options_(options) {
  if (size < 1) throw invalid_argument(fmt::format("callback group: size {} must be at least 1", size));
  if (rank < 0 || rank >= size)
    throw invalid_argument(fmt::format("callback group: rank {} is outside [0, {}) (size {})", rank, size, size));
  if (!callbacks_.all_gather || !callbacks_.barrier)
    throw invalid_argument("callback group: both the all_gather and the barrier callbacks must be set");
}

CallbackGroup::~CallbackGroup() {
  fd_group_.reset();  // rank 0: stops serving the socket before the directory goes
  if (rendezvous_) rendezvous_->remove();
}

std::string CallbackGroup::who() const { return fmt::format("group rank {} of {} ({})", rank_, size_, kind()); }

void CallbackGroup::check_usable() const {
  if (!broken_.empty())
    throw invalid_state(
        fmt::format("{}: the group is unusable after a failed collective ({}); call recover() on every rank", who(),
                    broken_));
}

void CallbackGroup::fail(const std::string& what, bool malformed) {
  broken_ = what;
  std::string text = fmt::format("{}: {}", who(), what);
  if (malformed) throw invalid_state(text);
  throw error(text);
}

std::vector<std::vector<std::byte>> CallbackGroup::call_all_gather(std::span<const std::byte> mine) {
  check_usable();
  std::vector<std::vector<std::byte>> out;
  try {
    out = callbacks_.all_gather(mine);
  } catch (const std::exception& e) {
    fail(fmt::format("the all_gather callback failed: {}", e.what()), false);
  } catch (...) {
    fail("the all_gather callback failed with an unknown exception", false);
  }
  if (out.size() != static_cast<std::size_t>(size_))
    fail(fmt::format("the all_gather callback returned {} entries for {} ranks", out.size(), size_), true);
  if (out[static_cast<std::size_t>(rank_)].size() != mine.size() ||
      !std::equal(mine.begin(), mine.end(), out[static_cast<std::size_t>(rank_)].begin()))
    fail(fmt::format("the all_gather callback returned other bytes at this rank's index {} than it contributed", rank_),
         true);
  return out;
}

std::vector<std::vector<std::byte>> CallbackGroup::all_gather(std::span<const std::byte> mine) {
  return call_all_gather(mine);
}

void CallbackGroup::barrier() {
  check_usable();
  try {
    callbacks_.barrier();
  } catch (const std::exception& e) {
    fail(fmt::format("the barrier callback failed: {}", e.what()), false);
  } catch (...) {
    fail("the barrier callback failed with an unknown exception", false);
  }
}

Group& CallbackGroup::fds() {
  if (fd_group_) return *fd_group_;
  std::string mine;
  if (rank_ == 0) {
    rendezvous_ = std::make_unique<Rendezvous>(Rendezvous::create());
    mine = rendezvous_->to_string();
  }
  auto all = call_all_gather(std::as_bytes(std::span(mine)));
  const auto& zero = all[0];
  std::string text(reinterpret_cast<const char*>(zero.data()), zero.size());
  Rendezvous rv;
  try {
    rv = Rendezvous::parse(text);
  } catch (const std::exception& e) {
    fail(fmt::format("rank 0 sent no usable rendezvous for the fd group: {}", e.what()), true);
  }
  try {
    fd_group_ = std::make_unique<UnixSocketGroup>(rv, rank_, size_, options_);
  } catch (const std::exception& e) {
    fail(fmt::format("could not join the fd group at '{}' (CallbackGroup passes fds on one node only: every rank "
                     "must see rank 0's directory): {}",
                     rv.directory, e.what()),
         false);
  }
  log::info("{}: fd group ready at '{}'", who(), rv.directory);
  return *fd_group_;
}

std::vector<std::vector<UniqueFd>> CallbackGroup::all_gather_fds(std::span<const int> mine) {
  check_usable();
  for (int fd : mine)
    if (fd < 0) throw invalid_argument(fmt::format("{}: all_gather_fds given an invalid descriptor {}", who(), fd));
  return fds().all_gather_fds(mine);
}

void CallbackGroup::recover() {
  broken_.clear();
  if (fd_group_) fd_group_->recover();
}

}  // namespace torpor
