// The rank's side of a hub-based Group: numbering collectives, waiting with a deadline, giving
// up, turning failures into typed errors, recovery. The transport (in-process mailbox or Unix
// socket) only moves requests to the Hub and replies back.
//
// Invariants: seq_ counts this rank's collectives in generation gen_; broken_ is set by any
// failed collective and cleared only by a successful recover(); replies that do not belong to the
// collective being waited for are stale (an earlier collective's answer that raced a give-up) and
// are dropped.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>

#include "ranks/groups/hub/group_hub.hpp"
#include "torpor/group.hpp"

namespace torpor::detail {

// A reply as one rank receives it: its own copies of the parts.
struct Received {
  ReplyType type = ReplyType::result;
  FailReason reason = FailReason::timeout;
  std::uint64_t generation = 0;
  std::uint64_t sequence = 0;
  std::vector<Part> parts;
  std::vector<int> missing;
  std::string message;
};

class HubClientGroup : public Group {
 public:
  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }
  std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> mine) override;
  std::vector<std::vector<UniqueFd>> all_gather_fds(std::span<const int> mine) override;
  void barrier() override;
  void recover() override;

 protected:
  using clock = std::chrono::steady_clock;
  HubClientGroup(int rank, int size, const GroupOptions& options);

  // The collective machinery; `kind` guards against ranks calling different collectives.
  std::vector<Part> exchange(CollectiveKind kind, Part part);

  // --- transport ---------------------------------------------------------------------------
  virtual void post_contribution(std::uint64_t generation, std::uint64_t sequence, CollectiveKind kind, Part part) = 0;
  virtual void post_give_up(std::uint64_t generation, std::uint64_t sequence, double waited_seconds) = 0;
  virtual void post_recover(std::uint64_t generation) = 0;
  virtual void post_give_up_recovery(std::uint64_t generation) = 0;
  // The next reply for this rank, or nothing when the deadline passes first.
  virtual std::optional<Received> next_reply(clock::time_point deadline) = 0;
  // How long to wait for the hub's answer to a give-up (it answers at once unless it is gone).
  virtual std::chrono::milliseconds give_up_grace() const { return timeout_; }

  std::string who() const;

 private:
  // One wait for the hub: until `deadline`, then (having given up) for the hub's answer to that.
  struct Wait {
    clock::time_point deadline;
    bool gave_up = false;
  };
  // The next reply before wait.deadline. At the first silence `give_up` tells the hub this rank
  // stops waiting, and the wait goes on give_up_grace() for its answer; nothing when that passes
  // too (the hub is gone).
  std::optional<Received> reply_or_give_up(Wait& wait, const std::function<void()>& give_up);
  [[noreturn]] void raise(const Received& r);

  int rank_;
  int size_;
  std::uint64_t gen_ = 0;
  std::uint64_t seq_ = 0;
  std::optional<std::string> broken_;
};

}  // namespace torpor::detail
