// What the hub does with the frames it receives, without the sockets: admission of a connection
// by its hello, reassembly of each rank's messages, their decoding into Hub calls, and the
// encoding of the Hub's replies. The server (hub_server.hpp) only moves frames; the fuzz target
// (tests/fuzz) drives this class with arbitrary bytes.
//
// Invariants:
//   - admission reads exactly one datagram of a fixed size: a connection that has not
//     presented the secret costs the hub a bounded amount of work and memory;
//   - rank 0 is the hub's own process (the peer's pid must be the hub's), so no other process
//     can take its place, and a rank is admitted at most once for the group's life;
//   - a rank's messages are reassembled per rank; a malformed one is an error that drops that
//     rank (Hub::leave), never the hub.
#pragma once

#include <sys/types.h>

#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "ranks/groups/hub/group_client.hpp"
#include "ranks/groups/hub/group_hub.hpp"
#include "ranks/groups/hub/group_wire.hpp"

namespace torpor::detail {

// A Reply as bytes for the wire plus the descriptors it carries, in order (borrowed from the
// reply's parts: they stay open while the reply lives).
struct EncodedReply {
  std::vector<std::byte> body;
  std::vector<int> fds;
};
EncodedReply encode_reply(const Reply& r);
// The rank's side: a received reply message into its parts. Throws error on a malformed body.
Received decode_reply(Message& m);

// The rank's side of its requests, as HubProtocol::receive decodes them: one encoder per request
// type, so that every transport sends the same bodies. A contribution's descriptors travel beside
// its body (the transport's business).
std::vector<std::byte> encode_contribution(std::uint64_t generation, std::uint64_t sequence, CollectiveKind kind,
                                           std::span<const std::byte> bytes);
std::vector<std::byte> encode_give_up(std::uint64_t generation, std::uint64_t sequence, double waited_seconds);
// The body of MessageType::recover and MessageType::give_up_recovery.
std::vector<std::byte> encode_generation(std::uint64_t generation);

class HubProtocol {
 public:
  HubProtocol(int size, std::string secret, pid_t hub_pid);

  struct Admission {
    int rank = -1;        // >= 0: welcome this connection as that rank
    std::string refusal;  // why not, otherwise
  };
  // A connection's first datagram, from a process with this pid. A welcomed rank counts as
  // connected from here on.
  Admission admit(const Datagram& hello, pid_t peer_pid);

  // One datagram from a connected rank: the deliveries of the request it completes (none while
  // a message is still arriving). Throws error when the rank broke the protocol; the caller
  // then calls leave(rank).
  Deliveries receive(int rank, Datagram d);
  // Whether a message of `rank` is partly received (the server bounds how long that may last).
  bool mid_message(int rank) const;
  // The rank's connection is gone (closed, broken, or unreachable); it cannot come back.
  Deliveries leave(int rank);
  bool connected(int rank) const;
  int size() const noexcept { return hub_.size(); }

 private:
  Deliveries handle(int rank, Message& m);

  std::string secret_;
  pid_t hub_pid_;
  Hub hub_;
  std::vector<MessageAssembler> assemblers_;
  std::vector<bool> connected_;
  std::set<int> left_;
};

}  // namespace torpor::detail
