// TcpGroup: the hub of UnixSocketGroup (HubProtocol, HubClientGroup) over TCP streams.
//
// Design: the Unix group's wire is frames over SOCK_SEQPACKET (one datagram per frame). A TCP
// stream keeps no boundaries, so each frame travels as its FrameHeader followed by exactly
// frame_bytes of body, and the reader cuts the stream back into the same datagrams; the hub's
// admission, reassembly and bookkeeping are the Unix group's, unchanged. No descriptor ever
// travels (a contribution with fds is refused before it is sent).
//
// Invariants:
//   - the server (rank 0's thread) never blocks on one connection: reads are non-blocking into a
//     per-connection buffer of at most one frame (header + frame_data_limit); sends to a rank
//     have a bounded wait (SO_SNDTIMEO), after which that rank leaves the group;
//   - a connection that has not sent a valid hello within hello_deadline is closed; a hello's
//     frame must be exactly hello_frame_bytes, so a stranger costs a bounded amount of memory;
//   - a rank whose connection closes (its process exited or was killed) leaves: every rank
//     waiting in a collective gets group_rank_left naming it at once.
#include "torpor/tcp_group.hpp"

#include <fcntl.h>
#include <fmt/core.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <thread>

#include "common/options.hpp"
#include "ranks/groups/hub/group_client.hpp"
#include "ranks/groups/hub/group_wire.hpp"
#include "ranks/groups/hub/hub_protocol.hpp"
#include "torpor/log.hpp"

namespace torpor {

namespace {

using detail::FrameHeader;
using detail::MessageType;
using detail::Reader;
using detail::Writer;
using clock_type = std::chrono::steady_clock;

constexpr auto hello_deadline = std::chrono::seconds(2);
// A message's later frames follow its first at once; a peer that stops mid-message is stuck.
constexpr auto continuation_wait = std::chrono::seconds(5);
constexpr int send_timeout_ms = 5000;
constexpr std::size_t max_strangers = 64;

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

// Cuts a stream back into frames. add() appends what was read; next() pops one whole frame.
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

bool wait_readable(int fd, clock_type::time_point deadline) {
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock_type::now());
    int ms = static_cast<int>(std::clamp<long long>(left.count(), 0, 1 << 30));
    pollfd p{fd, POLLIN, 0};
    int n = ::poll(&p, 1, ms);
    if (n > 0) return true;
    if (n == 0) {
      if (clock_type::now() >= deadline) return false;
      continue;
    }
    if (errno != EINTR) throw error(fmt::format("tcp group: poll failed: {}", errno_text()));
  }
}

// The next whole message on a blocking client socket, or nothing when `deadline` passes first.
std::optional<detail::Message> recv_stream_message(int sock, FrameReader& reader, clock_type::time_point deadline) {
  detail::MessageAssembler assembler;
  for (;;) {
    while (auto d = reader.next())
      if (auto m = assembler.add(std::move(*d))) return m;
    const bool mid = assembler.in_progress() || reader.partial();
    if (!wait_readable(sock, mid ? clock_type::now() + continuation_wait : deadline)) {
      if (mid) throw error("tcp group: the rest of a message did not arrive");
      return std::nullopt;
    }
    if (reader.fill(sock) == detail::RecvStatus::closed) throw error("tcp group: the other end closed the connection");
  }
}

void set_send_timeout(int sock) {
  timeval tv{send_timeout_ms / 1000, static_cast<suseconds_t>(send_timeout_ms % 1000) * 1000};
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

// ---------------------------------------------------------------------------------------------
// Rank 0's server

class TcpHubServer {
 public:
  TcpHubServer(const TcpEndpoint& ep, int size) : protocol_(size, ep.secret, ::getpid()), ranks_(size) {
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
    int p[2];
    if (::pipe2(p, O_CLOEXEC | O_NONBLOCK) != 0) throw error(fmt::format("tcp group: pipe failed: {}", errno_text()));
    wake_read_.reset(p[0]);
    wake_write_.reset(p[1]);
    thread_ = std::thread([this] { run(); });
  }

  ~TcpHubServer() {
    stop_ = true;
    char c = 1;
    (void)!::write(wake_write_.get(), &c, 1);
    if (thread_.joinable()) thread_.join();
  }

  int port() const noexcept { return port_; }

 private:
  struct Conn {
    UniqueFd sock;
    FrameReader reader;
    int rank = -1;                                  // -1 until its hello was accepted
    clock_type::time_point since;                   // accepted at (strangers)
    std::optional<clock_type::time_point> stalled;  // mid-message since
  };

  void run() {
    try {
      loop();
    } catch (const std::exception& e) {
      log::error("tcp group hub: stopped: {}", e.what());
    }
  }

  void loop() {
    std::vector<pollfd> fds;
    while (!stop_) {
      fds.clear();
      fds.push_back({wake_read_.get(), POLLIN, 0});
      fds.push_back({listen_.get(), POLLIN, 0});
      for (auto& c : conns_) fds.push_back({c->sock.get(), POLLIN, 0});
      int n = ::poll(fds.data(), fds.size(), 100);
      if (n < 0 && errno != EINTR) throw error(fmt::format("poll failed: {}", errno_text()));
      if (stop_) return;
      if (n > 0 && (fds[1].revents & POLLIN)) accept_some();
      const std::size_t polled = fds.size() - 2;
      for (std::size_t i = 0; i < polled && i < conns_.size(); ++i)
        if (fds[i + 2].revents != 0) serve(*conns_[i]);
      expire();
      std::erase_if(conns_, [](const std::unique_ptr<Conn>& c) { return !c->sock; });
    }
  }

  void accept_some() {
    for (int k = 0; k < 16; ++k) {
      UniqueFd s(::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
      if (!s) return;
      std::size_t strangers = std::count_if(conns_.begin(), conns_.end(), [](auto& c) { return c->rank < 0; });
      if (strangers >= max_strangers) continue;  // closed at the door; a member knocks again
      set_send_timeout(s.get());
      auto c = std::make_unique<Conn>();
      c->sock = std::move(s);
      c->since = clock_type::now();
      conns_.push_back(std::move(c));
    }
  }

  void serve(Conn& c) {
    detail::Deliveries out;
    try {
      for (int round = 0; round < 64 && c.sock; ++round) {
        detail::RecvStatus st = c.reader.fill(c.sock.get());
        if (st == detail::RecvStatus::closed) throw error("the connection closed");
        bool progressed = false;
        while (auto d = c.reader.next()) {
          progressed = true;
          if (c.rank < 0) {
            if (!admit(c, *d)) return;
            continue;
          }
          auto more = protocol_.receive(c.rank, std::move(*d));
          for (auto& m : more) out.push_back(std::move(m));
        }
        if (st == detail::RecvStatus::would_block && !progressed) break;
      }
      if (c.rank >= 0) {
        const bool mid = protocol_.mid_message(c.rank) || c.reader.partial();
        if (!mid)
          c.stalled.reset();
        else if (!c.stalled)
          c.stalled = clock_type::now();
      }
    } catch (const std::exception& e) {
      if (c.rank >= 0) log::debug("tcp group hub: rank {} disconnected: {}", c.rank, e.what());
      drop(c, out);
    }
    deliver(std::move(out));
  }

  bool admit(Conn& c, const detail::Datagram& hello) {
    // A TCP peer's process cannot be told apart: the secret is the only credential.
    detail::HubProtocol::Admission a = protocol_.admit(hello, ::getpid());
    if (a.rank < 0) {
      Writer w;
      w.put_string(a.refusal);
      auto body = w.take();
      try {
        send_stream_message(c.sock.get(), MessageType::refused, body);
      } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): refused either way, and logged below
      }
      log::warn("tcp group hub: refused a connection: {}", a.refusal);
      c.sock.reset();
      return false;
    }
    try {
      send_stream_message(c.sock.get(), MessageType::welcome, {});
    } catch (const std::exception& e) {
      log::warn("tcp group hub: rank {} vanished while joining ({})", a.rank, e.what());
      deliver(protocol_.leave(a.rank));
      c.sock.reset();
      return false;
    }
    c.rank = a.rank;
    ranks_[static_cast<std::size_t>(a.rank)] = &c;
    log::debug("tcp group hub: rank {} joined", a.rank);
    return true;
  }

  void expire() {
    const auto now = clock_type::now();
    for (auto& c : conns_) {
      if (!c->sock) continue;
      if (c->rank < 0 && now - c->since > hello_deadline) {
        c->sock.reset();  // no hello in time
      } else if (c->rank >= 0 && c->stalled && now - *c->stalled > continuation_wait) {
        log::warn("tcp group hub: rank {} sent part of a message and nothing more; it leaves the group", c->rank);
        detail::Deliveries out;
        drop(*c, out);
        deliver(std::move(out));
      }
    }
  }

  void drop(Conn& c, detail::Deliveries& out) {
    c.sock.reset();
    if (c.rank < 0) return;
    ranks_[static_cast<std::size_t>(c.rank)] = nullptr;
    for (auto& d : protocol_.leave(c.rank)) out.push_back(std::move(d));
  }

  void deliver(detail::Deliveries out) {
    while (!out.empty()) {
      detail::Deliveries next;
      for (auto& [rank, reply] : out) {
        Conn* c = ranks_[static_cast<std::size_t>(rank)];
        if (c == nullptr || !c->sock) continue;
        try {
          detail::EncodedReply e = detail::encode_reply(reply);
          if (!e.fds.empty()) throw error("a reply with descriptors cannot travel over TCP");
          send_stream_message(c->sock.get(), MessageType::reply, e.body);
        } catch (const std::exception& e) {
          log::warn("tcp group hub: rank {} cannot be reached ({}); it leaves the group", rank, e.what());
          drop(*c, next);
        }
      }
      out = std::move(next);
    }
  }

  detail::HubProtocol protocol_;
  UniqueFd listen_;
  UniqueFd wake_read_, wake_write_;
  int port_ = 0;
  std::vector<std::unique_ptr<Conn>> conns_;
  std::vector<Conn*> ranks_;  // by rank, while connected
  std::atomic<bool> stop_{false};
  std::thread thread_;  // last: starts after everything above exists
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// The rank's side

struct TcpGroup::Impl final : detail::HubClientGroup {
  Impl(const TcpEndpoint& ep, int rank, int size, const GroupOptions& options)
      : HubClientGroup(rank, size, options), endpoint_(ep) {
    if (size < 1 || size > 65536) throw invalid_argument(fmt::format("TcpGroup: size {} is outside [1, 65536]", size));
    if (rank < 0 || rank >= size)
      throw invalid_argument(fmt::format("TcpGroup: rank {} is outside [0, {})", rank, size));
    if (ep.port < 0 || ep.port > 65535 || (ep.port == 0 && rank != 0))
      throw invalid_argument(
          fmt::format("TcpGroup: port {} is outside [1, 65535] (0, any free port, only on rank 0)", ep.port));
    if (endpoint_.secret.empty()) endpoint_.secret = zero_secret();
    validate_secret(endpoint_.secret);
    if (rank == 0) {
      server_ = std::make_unique<TcpHubServer>(endpoint_, size);
      endpoint_.port = server_->port();
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

  void send(MessageType t, const std::vector<std::byte>& body) {
    try {
      send_stream_message(sock_.get(), t, body);
    } catch (const std::exception& e) {
      throw invalid_state(fmt::format("{}: lost the rendezvous hosted by rank 0 at {} ({}); rank 0 exited or "
                                      "destroyed its group; build a new group",
                                      who(), where(), e.what()));
    }
  }

  void post_contribution(std::uint64_t g, std::uint64_t s, detail::CollectiveKind k, detail::Part p) override {
    if (!p.fds.empty()) throw invalid_state(fmt::format("{}: descriptors cannot travel over TCP", who()));
    send(MessageType::contribute, detail::encode_contribution(g, s, k, p.bytes));
  }
  void post_give_up(std::uint64_t g, std::uint64_t s, double waited) override {
    send(MessageType::give_up, detail::encode_give_up(g, s, waited));
  }
  void post_recover(std::uint64_t g) override { send(MessageType::recover, detail::encode_generation(g)); }
  void post_give_up_recovery(std::uint64_t g) override {
    send(MessageType::give_up_recovery, detail::encode_generation(g));
  }
  std::optional<detail::Received> next_reply(clock::time_point deadline) override {
    std::optional<detail::Message> m;
    try {
      m = recv_stream_message(sock_.get(), reader_, deadline);
    } catch (const std::exception& e) {
      throw invalid_state(fmt::format("{}: lost the rendezvous hosted by rank 0 at {} ({}); rank 0 exited or "
                                      "destroyed its group; build a new group",
                                      who(), where(), e.what()));
    }
    if (!m) return std::nullopt;
    if (m->type != MessageType::reply) throw error(fmt::format("{}: unexpected message from the rendezvous", who()));
    return detail::decode_reply(*m);
  }

  TcpEndpoint endpoint_;
  std::unique_ptr<TcpHubServer> server_;
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
