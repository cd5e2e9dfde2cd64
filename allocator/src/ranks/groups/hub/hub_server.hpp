// The hub's server: one thread of rank 0's process that accepts connections, admits ranks by
// their hello, collects their parts, answers them, and drops whoever stalls or goes away. It is
// the same for every transport; a transport (HubTransport, HubLink) only listens, accepts, and
// moves frames: a Unix socket with descriptors (unix_group.cpp), a TCP stream (tcp_group.cpp).
//
// Invariants:
//   - a stranger never delays the group: nothing waits on one connection (every read takes what
//     is already there, a reply's send is bounded by the transport), a stranger's hello is read
//     once and must fit one fixed-size frame (HubProtocol::admit), at most max_strangers wait to
//     say hello (the oldest is told `busy` and closed for a newcomer), and one that has said
//     nothing within hello_deadline is refused;
//   - every refusal is counted (refused()), logged (the first few, then every power of two), and
//     never touches the Hub;
//   - a rank whose connection closes, breaks, stops reading, or stops halfway through a message
//     for continuation_wait has left the group (HubProtocol::leave): every rank waiting for it
//     is told at once;
//   - one datagram or stream read at a time, at most rounds_per_turn per rank per turn, so one
//     busy rank cannot starve the others.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <deque>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "ranks/groups/hub/group_wire.hpp"
#include "ranks/groups/hub/hub_protocol.hpp"

namespace torpor::detail {

// How long a connection may take to say hello (the rest of a message it started:
// continuation_wait, group_wire.hpp).
inline constexpr auto hello_deadline = std::chrono::seconds(2);
// The bound on one send to a rank (SO_SNDTIMEO): a rank that stops reading leaves the group.
inline constexpr int send_timeout_seconds = 5;

// One accepted connection, in its transport's framing.
class HubLink {
 public:
  virtual ~HubLink() = default;
  virtual int fd() const noexcept = 0;
  // Who is at the other end, for the log ("pid 12 (uid 1000)", "10.0.0.2:41000").
  virtual std::string peer() const = 0;
  // The process admission compares with the hub's own for rank 0 (HubProtocol::admit): the
  // peer's, where the transport can tell it.
  virtual pid_t pid() const noexcept = 0;
  // Whole frames that have arrived, appended to `frames`, from one read that does not wait.
  // Before the hello (`hello`), a transport reads no more than one hello can be. closed: the
  // other end is gone. Throws error on a broken connection or bytes that cannot be frames.
  virtual RecvStatus receive(std::vector<Datagram>& frames, bool hello) = 0;
  // Whether part of a frame is held back (a stream read ended inside one).
  virtual bool partial() const noexcept { return false; }
  // A whole message, waiting at most the transport's send bound. Throws error.
  virtual void send(MessageType type, std::span<const std::byte> body, std::span<const int> fds) = 0;
  // One frame of at most frame_data_limit bytes, without waiting; false when it did not leave.
  virtual bool try_send(MessageType type, std::span<const std::byte> body) noexcept = 0;
};

// Where connections arrive.
class HubTransport {
 public:
  virtual ~HubTransport() = default;
  // The hub as its log lines name it ("group hub at '/tmp/torpor-group-x/group.sock'").
  virtual std::string name() const = 0;
  virtual int listening_fd() const noexcept = 0;
  struct Arrival {
    std::unique_ptr<HubLink> link;  // a connection to admit, or
    std::string refusal;            // why it was closed at the door (another user, ...)
  };
  // The next waiting connection, or nothing when none waits. Never waits itself.
  virtual std::optional<Arrival> accept() = 0;
};

class HubServer {
 public:
  // Starts the server thread; the transport is listening already.
  HubServer(std::unique_ptr<HubTransport> transport, int size, std::string secret);
  ~HubServer();
  HubServer(const HubServer&) = delete;
  HubServer& operator=(const HubServer&) = delete;

  // Connections refused so far (at the door, or for their hello).
  std::size_t refused() const noexcept { return refused_.load(); }

 private:
  using clock_type = std::chrono::steady_clock;
  // A connection that has not presented the secret yet.
  struct Stranger {
    std::unique_ptr<HubLink> link;
    clock_type::time_point deadline;
  };

  void run() noexcept;
  void loop();
  int size() const noexcept { return protocol_.size(); }
  int poll_timeout_ms() const;
  void accept_some();
  void refuse(Stranger& s, const std::string& why, MessageType type = MessageType::refused);
  void admit(Stranger& s);
  // The rank's frames: into the protocol, whose replies go into `out`.
  void take(int rank, std::vector<Datagram>& frames, std::size_t from, Deliveries& out);
  void serve(int rank);
  void note_mid_message(int rank);
  void drop_stalled_ranks();
  void drop(int rank, Deliveries& out);
  void deliver(Deliveries out);

  static constexpr std::size_t max_strangers = 64;
  static constexpr int accept_batch = 16;
  static constexpr int rounds_per_turn = 256;

  std::unique_ptr<HubTransport> transport_;
  std::string name_;
  HubProtocol protocol_;
  UniqueFd wake_;
  std::deque<Stranger> strangers_;               // oldest first
  std::vector<std::unique_ptr<HubLink>> ranks_;  // by rank; empty until joined, again after leaving
  std::vector<std::optional<clock_type::time_point>> rank_deadlines_;  // set while a message is half received
  std::atomic<std::size_t> refused_{0};
  std::thread thread_;  // last: starts after everything above exists
};

}  // namespace torpor::detail
