// TcpGroup: the hub (hub_server.hpp, hub_protocol.hpp) and the rank's side (group_client.hpp)
// of UnixSocketGroup over TCP streams; what is TCP about it: the transport under the hub, the
// stream's framing, and the rank's connection.
//
// Design: the hub's wire is frames (group_wire.hpp). A TCP stream keeps no boundaries, so each
// frame travels as its FrameHeader followed by exactly frame_bytes of body, and the reader cuts
// the stream back into the same frames; the hub's admission, reassembly and bookkeeping are the
// Unix group's, unchanged. No descriptor ever travels (a contribution with fds is refused before
// it is sent, a reply with fds fails its rank).
//
// Invariants:
//   - a connection's reader buffers at most one frame (header + frame_data_limit) beyond what
//     was cut out of it, so a stranger costs a bounded amount of memory; reads never wait
//     (MSG_DONTWAIT), sends wait at most SO_SNDTIMEO;
//   - a TCP peer's process cannot be told apart: the secret is the only credential (rank 0 is
//     admitted as the hub's own process).
#include "torpor/tcp_group.hpp"

#include <arpa/inet.h>
#include <fmt/core.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "common/options.hpp"
#include "ranks/groups/hub/group_client.hpp"
#include "ranks/groups/hub/group_wire.hpp"
#include "ranks/groups/hub/hub_protocol.hpp"
#include "ranks/groups/hub/hub_server.hpp"
#include "torpor/log.hpp"

namespace torpor {

namespace {

using detail::FrameHeader;
using detail::MessageType;
using detail::Reader;
using clock_type = std::chrono::steady_clock;

std::string errno_text() { return std::strerror(errno); }

std::string zero_secret() { return std::string(64, '0'); }

void validate_secret(const std::string& s) {
  if (s.size() != 64 || !std::all_of(s.begin(), s.end(), [](char c) { return std::isxdigit(c) != 0; }))
    throw invalid_argument("TcpGroup: the secret must be 64 hex digits");
}

// Writes all of `data` (blocking, bounded by SO_SNDTIMEO). Throws error on failure.
void write_all(int sock, const std::byte* data, std::size_t n) {
  while (n > 0) {
    ssize_t w = ::send(sock, data, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) throw error(fmt::format("tcp group: send failed: {}", w < 0 ? errno_text() : "closed"));
    data += w;
    n -= static_cast<std::size_t>(w);
  }
}

// One message as frames on the stream (the Unix wire's framing, without descriptors).
void send_stream_message(int sock, MessageType type, std::span<const std::byte> body) {
  if (body.size() > detail::message_byte_limit)
    throw invalid_argument(fmt::format("tcp group: a message of {} bytes exceeds the protocol's limit of {} bytes",
                                       body.size(), detail::message_byte_limit));
  std::size_t sent = 0;
  std::vector<std::byte> frame;
  do {
    const std::size_t nb = std::min(detail::frame_data_limit, body.size() - sent);
    FrameHeader h{};
    h.magic = detail::frame_magic;
    h.type = static_cast<std::uint8_t>(type);
    h.frame_bytes = static_cast<std::uint32_t>(nb);
    h.total_bytes = body.size();
    frame.resize(sizeof h + nb);
    std::memcpy(frame.data(), &h, sizeof h);
    if (nb > 0) std::memcpy(frame.data() + sizeof h, body.data() + sent, nb);
    write_all(sock, frame.data(), frame.size());
    sent += nb;
  } while (sent < body.size());
}

// Cuts a stream back into frames. fill() appends what the socket has; next() pops one whole frame.
class FrameReader {
 public:
  // Throws error when the bytes cannot be a frame (bad magic, longer than a frame may be).
  std::optional<detail::Datagram> next() {
    if (buf_.size() < sizeof(FrameHeader)) return std::nullopt;
    FrameHeader h{};
    std::memcpy(&h, buf_.data(), sizeof h);
    if (h.magic != detail::frame_magic) throw error("tcp group: bad frame (not a torpor group peer?)");
    if (h.frame_bytes > detail::frame_data_limit || h.frame_fds != 0)
      throw error("tcp group: frame larger than the protocol allows");
    const std::size_t n = sizeof h + h.frame_bytes;
    if (buf_.size() < n) return std::nullopt;
    detail::Datagram d;
    d.bytes.assign(buf_.begin(), buf_.begin() + static_cast<std::ptrdiff_t>(n));
    buf_.erase(buf_.begin(), buf_.begin() + static_cast<std::ptrdiff_t>(n));
    return d;
  }
  // Reads what the socket has (non-blocking). closed: end of stream.
  detail::RecvStatus fill(int sock) {
    std::byte tmp[64 * 1024];
    // Never more than one frame buffered beyond what next() consumes.
    const std::size_t room = sizeof(FrameHeader) + detail::frame_data_limit;
    const std::size_t want = buf_.size() >= room ? 0 : std::min(sizeof tmp, room - buf_.size());
    if (want == 0) return detail::RecvStatus::ok;
    ssize_t n;
    do {
      n = ::recv(sock, tmp, want, MSG_DONTWAIT);
    } while (n < 0 && errno == EINTR);
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return detail::RecvStatus::would_block;
      if (errno == ECONNRESET) return detail::RecvStatus::closed;
      throw error(fmt::format("tcp group: recv failed: {}", errno_text()));
    }
    if (n == 0) return detail::RecvStatus::closed;
    buf_.insert(buf_.end(), tmp, tmp + n);
    return detail::RecvStatus::ok;
  }
  bool partial() const noexcept { return !buf_.empty(); }

 private:
  std::vector<std::byte> buf_;
};

// The next whole message on a blocking client socket, or nothing when `deadline` passes first.
std::optional<detail::Message> recv_stream_message(int sock, FrameReader& reader, clock_type::time_point deadline) {
  detail::MessageAssembler assembler;
  for (;;) {
    while (auto d = reader.next())
      if (auto m = assembler.add(std::move(*d))) return m;
    const bool mid = assembler.in_progress() || reader.partial();
    if (!detail::wait_readable(sock, mid ? clock_type::now() + detail::continuation_wait : deadline)) {
      if (mid) throw error("tcp group: the rest of a message did not arrive");
      return std::nullopt;
    }
    if (reader.fill(sock) == detail::RecvStatus::closed) throw error("tcp group: the other end closed the connection");
  }
}

void set_send_timeout(int sock) {
  timeval tv{detail::send_timeout_seconds, 0};
  ::setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  int one = 1;
  ::setsockopt(sock, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

struct AddrList {
  addrinfo* list = nullptr;
  ~AddrList() {
    if (list) ::freeaddrinfo(list);
  }
};

AddrList resolve(const std::string& host, int port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  AddrList out;
  const std::string service = std::to_string(port);
  int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &out.list);
  if (rc != 0)
    throw invalid_argument(fmt::format("tcp group: cannot resolve '{}' port {}: {}", host, port, ::gai_strerror(rc)));
  return out;
}

// --- the hub's transport ------------------------------------------------------------------------

// "host:port" of a socket address, for the log.
std::string address_text(const sockaddr_storage& a) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (a.ss_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(&a);
    ::inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof host);
    port = ntohs(in6->sin6_port);
  } else if (a.ss_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(&a);
    ::inet_ntop(AF_INET, &in->sin_addr, host, sizeof host);
    port = ntohs(in->sin_port);
  }
  return fmt::format("{}:{}", host, port);
}

// One connection: frames cut out of the stream, no descriptors.
class TcpLink final : public detail::HubLink {
 public:
  TcpLink(UniqueFd sock, std::string peer) : sock_(std::move(sock)), peer_(std::move(peer)) {}

  int fd() const noexcept override { return sock_.get(); }
  std::string peer() const override { return peer_; }
  pid_t pid() const noexcept override { return ::getpid(); }

  // The reader never holds more than one frame, so a hello needs no bound of its own.
  detail::RecvStatus receive(std::vector<detail::Datagram>& frames, bool) override {
    detail::RecvStatus st = reader_.fill(sock_.get());
    while (auto d = reader_.next()) frames.push_back(std::move(*d));
    return st;
  }
  bool partial() const noexcept override { return reader_.partial(); }
  void send(MessageType type, std::span<const std::byte> body, std::span<const int> fds) override {
    if (!fds.empty()) throw error("a reply with descriptors cannot travel over TCP");
    send_stream_message(sock_.get(), type, body);
  }
  bool try_send(MessageType type, std::span<const std::byte> body) noexcept override {
    try {
      const std::vector<std::byte> frame = detail::encode_frame(type, body);
      return ::send(sock_.get(), frame.data(), frame.size(), MSG_NOSIGNAL | MSG_DONTWAIT) ==
             static_cast<ssize_t>(frame.size());
    } catch (const std::exception&) {
      return false;
    }
  }

 private:
  UniqueFd sock_;
  std::string peer_;
  FrameReader reader_;
};

// Rank 0's listening socket on (host, port).
class TcpTransport final : public detail::HubTransport {
 public:
  explicit TcpTransport(const TcpEndpoint& ep) : host_(ep.host) {
    AddrList a = resolve(ep.host, ep.port, true);
    std::string last = "no address";
    for (addrinfo* ai = a.list; ai != nullptr && !listen_; ai = ai->ai_next) {
      UniqueFd s(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol));
      if (!s) {
        last = errno_text();
        continue;
      }
      int one = 1;
      ::setsockopt(s.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
      if (::bind(s.get(), ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(s.get(), 128) != 0) {
        last = errno_text();
        continue;
      }
      sockaddr_storage bound{};
      socklen_t len = sizeof bound;
      ::getsockname(s.get(), reinterpret_cast<sockaddr*>(&bound), &len);
      port_ = bound.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                                          : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
      listen_ = std::move(s);
    }
    if (!listen_)
      throw error(fmt::format("tcp group: rank 0 cannot listen on {} port {}: {} (is the port taken? MASTER_PORT + 1 "
                              "must be free on rank 0's node)",
                              ep.host, ep.port, last));
  }

  int port() const noexcept { return port_; }
  std::string name() const override { return fmt::format("tcp group hub at {}:{}", host_, port_); }
  int listening_fd() const noexcept override { return listen_.get(); }

  std::optional<Arrival> accept() override {
    sockaddr_storage from{};
    socklen_t len = sizeof from;
    // Blocking sends (bounded by SO_SNDTIMEO) for the ranks' replies; reads never wait
    // (MSG_DONTWAIT).
    UniqueFd s(::accept4(listen_.get(), reinterpret_cast<sockaddr*>(&from), &len, SOCK_CLOEXEC));
    if (!s) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED)
        log::warn("{}: accept failed: {}", name(), errno_text());
      return std::nullopt;
    }
    set_send_timeout(s.get());
    return Arrival{std::make_unique<TcpLink>(std::move(s), address_text(from)), {}};
  }

 private:
  std::string host_;
  int port_ = 0;
  UniqueFd listen_;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// The rank's side

struct TcpGroup::Impl final : detail::WireClientGroup {
  Impl(const TcpEndpoint& ep, int rank, int size, const GroupOptions& options)
      : WireClientGroup(rank, size, options), endpoint_(ep) {
    if (size < 1 || size > 65536) throw invalid_argument(fmt::format("TcpGroup: size {} is outside [1, 65536]", size));
    if (rank < 0 || rank >= size)
      throw invalid_argument(fmt::format("TcpGroup: rank {} is outside [0, {})", rank, size));
    if (ep.port < 0 || ep.port > 65535 || (ep.port == 0 && rank != 0))
      throw invalid_argument(
          fmt::format("TcpGroup: port {} is outside [1, 65535] (0, any free port, only on rank 0)", ep.port));
    if (endpoint_.secret.empty()) endpoint_.secret = zero_secret();
    validate_secret(endpoint_.secret);
    if (rank == 0) {
      auto transport = std::make_unique<TcpTransport>(endpoint_);
      endpoint_.port = transport->port();
      server_ = std::make_unique<detail::HubServer>(std::move(transport), size, endpoint_.secret);
    }
    connect();
    exchange(detail::CollectiveKind::formation, detail::Part{});
  }

  ~Impl() override {
    sock_.reset();  // leaving: the hub sees the connection close
    server_.reset();
  }

  std::string_view kind() const noexcept override { return "tcp"; }

  std::string where() const { return fmt::format("{}:{}", endpoint_.host, endpoint_.port); }

  void connect() {
    const auto deadline = clock::now() + timeout_;
    std::string last;
    for (;;) {
      AddrList a = resolve(endpoint_.host, endpoint_.port, false);
      for (addrinfo* ai = a.list; ai != nullptr; ai = ai->ai_next) {
        UniqueFd s(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
        if (!s) continue;
        if (::connect(s.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
          last = errno_text();
          continue;
        }
        set_send_timeout(s.get());
        try {
          const auto hello = detail::encode_hello(rank(), size(), endpoint_.secret);
          write_all(s.get(), hello.data(), hello.size());
          FrameReader reader;
          auto m = recv_stream_message(s.get(), reader, deadline);
          if (!m)
            throw group_timeout(fmt::format("{}: the rendezvous at {} did not welcome this rank within {} ms", who(),
                                            where(), timeout_.count()),
                                {0});
          if (m->type == MessageType::busy) {
            // A crowd of connections at the door (a stranger's flood): knock again.
            last = "the rendezvous had too many connections waiting to say hello";
            continue;
          }
          if (m->type == MessageType::refused) {
            Reader rd(m->body);
            throw error(fmt::format("{}: the rendezvous at {} refused this rank: {}", who(), where(), rd.get_string()));
          }
          if (m->type != MessageType::welcome)
            throw error(fmt::format("{}: unexpected answer to hello from {}", who(), where()));
          sock_ = std::move(s);
          reader_ = std::move(reader);
          return;
        } catch (const group_timeout&) {
          throw;
        } catch (const invalid_argument&) {
          throw;
        } catch (const error& e) {
          // Refusals are final; a connection closed at the door (the hub was full) is retried.
          if (std::string_view(e.what()).find("refused this rank") != std::string_view::npos) throw;
          last = e.what();
        }
      }
      if (clock::now() >= deadline)
        throw group_timeout(fmt::format("{}: could not reach the rendezvous at {} within {} ms (rank 0 hosts it: is "
                                        "rank 0 running? last error: {})",
                                        who(), where(), timeout_.count(), last),
                            {0});
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

  std::string rendezvous_address() const override { return " at " + where(); }
  void send_to_hub(MessageType type, std::span<const std::byte> body, std::span<const int>) override {
    send_stream_message(sock_.get(), type, body);
  }
  std::optional<detail::Message> receive_from_hub(clock::time_point deadline) override {
    return recv_stream_message(sock_.get(), reader_, deadline);
  }
  void post_contribution(std::uint64_t g, std::uint64_t s, detail::CollectiveKind k, detail::Part p) override {
    if (!p.fds.empty()) throw invalid_state(fmt::format("{}: descriptors cannot travel over TCP", who()));
    WireClientGroup::post_contribution(g, s, k, std::move(p));
  }

  TcpEndpoint endpoint_;
  std::unique_ptr<detail::HubServer> server_;
  UniqueFd sock_;
  FrameReader reader_;
};

TcpGroup::TcpGroup(const TcpEndpoint& endpoint, int rank, int size, const GroupOptions& options)
    : Group(options), impl_(std::make_unique<Impl>(endpoint, rank, size, options)) {}
TcpGroup::~TcpGroup() = default;
int TcpGroup::rank() const noexcept { return impl_->rank(); }
int TcpGroup::size() const noexcept { return impl_->size(); }
std::vector<std::vector<std::byte>> TcpGroup::all_gather(std::span<const std::byte> mine) {
  return impl_->all_gather(mine);
}
std::vector<std::vector<UniqueFd>> TcpGroup::all_gather_fds(std::span<const int>) {
  throw invalid_state(fmt::format("group rank {} of {} (tcp): descriptors cannot travel over TCP; share memory as "
                                  "fabric handles (all_gather of bytes)",
                                  rank(), size()));
}
void TcpGroup::barrier() { impl_->barrier(); }
void TcpGroup::recover() { impl_->recover(); }
int TcpGroup::port() const noexcept { return impl_->endpoint_.port; }

std::unique_ptr<LauncherLayout> launcher_layout_from_env() {
  auto rank = options::launcher_rank();
  auto world = options::launcher_world_size();
  if (!rank || !world) return nullptr;
  auto out = std::make_unique<LauncherLayout>();
  out->rank = *rank;
  out->world_size = *world;
  out->local_world_size = options::local_world_size().value_or(*world);
  out->local_rank = options::local_rank().value_or(*rank % out->local_world_size);
  if (out->rank >= out->world_size)
    throw invalid_argument(fmt::format("RANK={} is not below WORLD_SIZE={}", out->rank, out->world_size));
  if (out->local_world_size > out->world_size || out->world_size % out->local_world_size != 0)
    throw invalid_argument(fmt::format("WORLD_SIZE={} is not a whole number of nodes of LOCAL_WORLD_SIZE={}",
                                       out->world_size, out->local_world_size));
  if (out->local_rank >= out->local_world_size)
    throw invalid_argument(
        fmt::format("LOCAL_RANK={} is not below LOCAL_WORLD_SIZE={}", out->local_rank, out->local_world_size));
  if (out->rank % out->local_world_size != out->local_rank)
    throw invalid_argument(fmt::format("RANK={} with LOCAL_WORLD_SIZE={} is not LOCAL_RANK={} (ranks of a node must "
                                       "be consecutive)",
                                       out->rank, out->local_world_size, out->local_rank));
  return out;
}

std::unique_ptr<TcpGroup> tcp_group_from_env(const GroupOptions& options) {
  auto addr = options::master_addr();
  auto port = options::master_port();
  auto layout = launcher_layout_from_env();
  if (!addr) throw invalid_argument("tcp_group_from_env: MASTER_ADDR is not set");
  if (!port) throw invalid_argument("tcp_group_from_env: MASTER_PORT is not set");
  if (!layout) throw invalid_argument("tcp_group_from_env: RANK and WORLD_SIZE must both be set");
  if (*port >= 65535) throw invalid_argument(fmt::format("MASTER_PORT={} leaves no port above it for torpor", *port));
  TcpEndpoint ep;
  ep.host = *addr;
  ep.port = *port + 1;
  return std::make_unique<TcpGroup>(ep, layout->rank, layout->world_size, options);
}

}  // namespace torpor
