// The rank's side of a hub-based Group: numbering collectives, waiting with a deadline, giving
// up, turning failures into typed errors, recovery. The transport (an in-process mailbox, or a
// connection to the hub server through WireClientGroup) only moves requests to the Hub and
// replies back.
//
// Invariants: seq_ counts this rank's collectives in generation gen_; broken_ is set by any
// failed collective and cleared only by a successful recover(); replies that do not belong to the
// collective being waited for are stale (an earlier collective's answer that raced a give-up) and
// are dropped.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <span>
#include <string>

#include "ranks/groups/hub/group_hub.hpp"
#include "ranks/groups/hub/group_wire.hpp"
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

// A HubClientGroup whose hub is a HubServer across a connection (Unix socket, TCP): requests and
// replies travel as wire messages (hub_protocol.hpp's encodings). The transport sends and
// receives whole messages; a failure of either means rank 0's rendezvous is gone.
class WireClientGroup : public HubClientGroup {
 protected:
  using HubClientGroup::HubClientGroup;

  // A whole message to the hub, with descriptors beside it. Throws on failure.
  virtual void send_to_hub(MessageType type, std::span<const std::byte> body, std::span<const int> fds) = 0;
  // The hub's next message, or nothing when `deadline` passes first. Throws when the connection
  // broke.
  virtual std::optional<Message> receive_from_hub(clock::time_point deadline) = 0;
  // Where the rendezvous is, for messages (" at host:port"), or "" when the kind says enough.
  virtual std::string rendezvous_address() const { return {}; }

  void post_contribution(std::uint64_t generation, std::uint64_t sequence, CollectiveKind kind, Part part) override;
  void post_give_up(std::uint64_t generation, std::uint64_t sequence, double waited_seconds) override;
  void post_recover(std::uint64_t generation) override;
  void post_give_up_recovery(std::uint64_t generation) override;
  std::optional<Received> next_reply(clock::time_point deadline) override;

 private:
  void send(MessageType type, const std::vector<std::byte>& body, std::span<const int> fds = {});
  [[noreturn]] void lost(const std::exception& e) const;
};

}  // namespace torpor::detail
