// HubProtocol: see hub_protocol.hpp for the invariants.
#include "ranks/groups/hub/hub_protocol.hpp"

#include <fmt/core.h>

namespace torpor::detail {

namespace {

bool equal_constant_time(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

bool known_kind(std::uint8_t k) {
  return k >= static_cast<std::uint8_t>(CollectiveKind::formation) &&
         k <= static_cast<std::uint8_t>(CollectiveKind::all_gather_fds);
}

}  // namespace

EncodedReply encode_reply(const Reply& r) {
  Writer w;
  w.put<std::uint8_t>(static_cast<std::uint8_t>(r.type))
      .put<std::uint8_t>(static_cast<std::uint8_t>(r.reason))
      .put<std::uint64_t>(r.generation)
      .put<std::uint64_t>(r.sequence)
      .put<std::uint32_t>(static_cast<std::uint32_t>(r.missing.size()));
  for (int m : r.missing) w.put<std::int32_t>(m);
  w.put_string(r.message);
  EncodedReply out;
  std::uint32_t parts = r.parts ? static_cast<std::uint32_t>(r.parts->size()) : 0;
  w.put<std::uint32_t>(parts);
  if (r.parts) {
    for (const Part& p : *r.parts) {
      w.put_bytes(p.bytes.data(), p.bytes.size());
      w.put<std::uint32_t>(static_cast<std::uint32_t>(p.fds.size()));
      for (const UniqueFd& f : p.fds) out.fds.push_back(f.get());
    }
  }
  out.body = w.take();
  return out;
}

Received decode_reply(Message& m) {
  Reader rd(m.body);
  Received r;
  r.type = static_cast<ReplyType>(rd.get<std::uint8_t>());
  r.reason = static_cast<FailReason>(rd.get<std::uint8_t>());
  r.generation = rd.get<std::uint64_t>();
  r.sequence = rd.get<std::uint64_t>();
  auto nm = rd.get<std::uint32_t>();
  if (nm > m.body.size()) throw error("group socket: reply names more missing ranks than it holds");
  for (std::uint32_t i = 0; i < nm; ++i) r.missing.push_back(rd.get<std::int32_t>());
  r.message = rd.get_string();
  auto parts = rd.get<std::uint32_t>();
  if (parts > m.body.size()) throw error("group socket: reply names more parts than it holds");
  std::size_t fd_at = 0;
  for (std::uint32_t i = 0; i < parts; ++i) {
    Part p;
    p.bytes = rd.get_bytes();
    auto nf = rd.get<std::uint32_t>();
    if (nf > m.fds.size() - fd_at) throw error("group socket: reply names more descriptors than it carries");
    for (std::uint32_t k = 0; k < nf; ++k) p.fds.push_back(std::move(m.fds[fd_at++]));
    r.parts.push_back(std::move(p));
  }
  return r;
}

HubProtocol::HubProtocol(int size, std::string secret, pid_t hub_pid)
    : secret_(std::move(secret)),
      hub_pid_(hub_pid),
      hub_(size),
      assemblers_(static_cast<std::size_t>(size)),
      connected_(static_cast<std::size_t>(size), false) {}

HubProtocol::Admission HubProtocol::admit(const Datagram& hello, pid_t peer_pid) {
  Admission a;
  std::string why;
  std::optional<HelloFields> h = parse_hello(hello, why);
  if (!h) {
    a.refusal = why;
    return a;
  }
  const int size = hub_.size();
  if (h->version != wire_version) {
    a.refusal = fmt::format("protocol version {} (this hub speaks {})", h->version, wire_version);
    return a;
  }
  if (!equal_constant_time(h->secret, secret_)) {
    a.refusal = "wrong secret";
    return a;
  }
  // Past the secret: a member of the group, told precisely what is wrong.
  if (h->size != size)
    a.refusal = fmt::format("claims a group of {} ranks, this group has {}", h->size, size);
  else if (h->rank < 0 || h->rank >= size)
    a.refusal = fmt::format("rank {} is outside [0, {})", h->rank, size);
  else if (h->rank == 0 && peer_pid != hub_pid_)
    a.refusal = fmt::format("rank 0 is the process hosting the rendezvous (pid {}), not pid {}", hub_pid_, peer_pid);
  else if (left_.count(h->rank))
    a.refusal = fmt::format("rank {} left this group and cannot rejoin", h->rank);
  else if (connected_[static_cast<std::size_t>(h->rank)])
    a.refusal = fmt::format("rank {} is already connected", h->rank);
  if (!a.refusal.empty()) return a;
  a.rank = h->rank;
  connected_[static_cast<std::size_t>(h->rank)] = true;
  return a;
}

bool HubProtocol::connected(int rank) const {
  return rank >= 0 && rank < hub_.size() && connected_[static_cast<std::size_t>(rank)];
}

bool HubProtocol::mid_message(int rank) const { return assemblers_[static_cast<std::size_t>(rank)].in_progress(); }

Deliveries HubProtocol::receive(int rank, Datagram d) {
  if (!connected(rank)) throw error(fmt::format("rank {} is not connected", rank));
  std::optional<Message> m = assemblers_[static_cast<std::size_t>(rank)].add(std::move(d));
  if (!m) return {};
  return handle(rank, *m);
}

std::vector<std::byte> encode_contribution(std::uint64_t generation, std::uint64_t sequence, CollectiveKind kind,
                                           std::span<const std::byte> bytes) {
  Writer w;
  w.put<std::uint64_t>(generation).put<std::uint64_t>(sequence).put<std::uint8_t>(static_cast<std::uint8_t>(kind));
  w.put_bytes(bytes.data(), bytes.size());
  return w.take();
}

std::vector<std::byte> encode_give_up(std::uint64_t generation, std::uint64_t sequence, double waited_seconds) {
  Writer w;
  w.put<std::uint64_t>(generation).put<std::uint64_t>(sequence).put<double>(waited_seconds);
  return w.take();
}

std::vector<std::byte> encode_generation(std::uint64_t generation) {
  Writer w;
  w.put<std::uint64_t>(generation);
  return w.take();
}

Deliveries HubProtocol::handle(int rank, Message& m) {
  Reader rd(m.body);
  Deliveries out;
  if (m.type != MessageType::contribute && !m.fds.empty())
    throw error(fmt::format("a message of type {} must not carry descriptors", static_cast<int>(m.type)));
  switch (m.type) {
    case MessageType::contribute: {
      auto g = rd.get<std::uint64_t>();
      auto s = rd.get<std::uint64_t>();
      auto k = rd.get<std::uint8_t>();
      if (!known_kind(k)) throw error(fmt::format("unknown collective kind {}", k));
      Part p;
      p.bytes = rd.get_bytes();
      p.fds = std::move(m.fds);
      if (!rd.done()) throw error("contribution longer than its fields");
      out = hub_.contribute(rank, g, s, static_cast<CollectiveKind>(k), std::move(p));
      break;
    }
    case MessageType::give_up: {
      auto g = rd.get<std::uint64_t>();
      auto s = rd.get<std::uint64_t>();
      auto waited = rd.get<double>();
      out = hub_.give_up(rank, g, s, waited);
      break;
    }
    case MessageType::recover: out = hub_.recover(rank, rd.get<std::uint64_t>()); break;
    case MessageType::give_up_recovery: out = hub_.give_up_recovery(rank, rd.get<std::uint64_t>()); break;
    default: throw error(fmt::format("unexpected message type {}", static_cast<int>(m.type)));
  }
  return out;
}

Deliveries HubProtocol::leave(int rank) {
  if (!connected(rank)) return {};
  connected_[static_cast<std::size_t>(rank)] = false;
  assemblers_[static_cast<std::size_t>(rank)] = MessageAssembler{};
  left_.insert(rank);
  return hub_.leave(rank);
}

}  // namespace torpor::detail
