// UnixSocketGroup: ranks in separate processes meeting at a Unix socket that rank 0 serves.
//
// Security (exported GPU memory must never reach a foreign process):
//   - the socket lives in a directory that must be owned by this user with mode 0700; both ends
//     check it, and the hub creates the socket 0600;
//   - the hub checks every connection's peer credentials (SO_PEERCRED): another uid is closed
//     at once; a connection of this uid must then present the group's secret (compared in
//     constant time), a rank in range and the group size, within a short hello deadline;
//   - every rank checks the hub's credentials too before sending anything;
//   - refusals are logged with the peer's pid and uid and counted; they never touch the Hub.
//
// The hub runs in one thread of rank 0's process: it polls the listening socket, connections
// still saying hello, and the ranks' connections, feeds requests to the Hub and sends back its
// replies. A rank whose connection closes has left the group (Hub::leave).
#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <set>
#include <thread>

#include "common/options.hpp"
#include "dist/group_client.hpp"
#include "dist/group_wire.hpp"
#include "torpor/group.hpp"
#include "torpor/log.hpp"

namespace torpor {

namespace {

using clock_type = std::chrono::steady_clock;
using detail::MessageType;
using detail::Reader;
using detail::Writer;

constexpr auto hello_deadline = std::chrono::seconds(2);
constexpr int send_timeout_seconds = 5;

std::string errno_text() { return std::strerror(errno); }

void check_private_directory(const std::string& dir) {
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0)
    throw error(fmt::format("rendezvous directory '{}' is not accessible: {} (create it with Rendezvous::create())",
                            dir, errno_text()));
  if (!S_ISDIR(st.st_mode) || st.st_uid != ::geteuid() || (st.st_mode & 0077) != 0)
    throw error(fmt::format("rendezvous directory '{}' must be a directory owned by uid {} with mode 0700 (found {} "
                            "owned by uid {}, mode {:o}); exported GPU memory must never reach another user",
                            dir, ::geteuid(), S_ISDIR(st.st_mode) ? "a directory" : "not a directory", st.st_uid,
                            st.st_mode & 07777));
}

sockaddr_un socket_address(const std::string& path) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  if (path.size() >= sizeof a.sun_path)
    throw invalid_argument(fmt::format("rendezvous socket path '{}' is longer than {} characters; use a shorter TMPDIR",
                                       path, sizeof a.sun_path - 1));
  std::memcpy(a.sun_path, path.c_str(), path.size() + 1);
  return a;
}

ucred peer_credentials(int sock) {
  ucred c{};
  socklen_t n = sizeof c;
  if (::getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &c, &n) != 0)
    throw error(fmt::format("SO_PEERCRED failed: {}", errno_text()));
  return c;
}

bool equal_constant_time(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

std::span<const std::byte> as_bytes(const std::vector<std::byte>& v) { return {v.data(), v.size()}; }

// --- reply encoding -------------------------------------------------------------------------

void send_reply(int sock, const detail::Reply& r) {
  Writer w;
  w.put<std::uint8_t>(static_cast<std::uint8_t>(r.type))
      .put<std::uint8_t>(static_cast<std::uint8_t>(r.reason))
      .put<std::uint64_t>(r.generation)
      .put<std::uint64_t>(r.sequence)
      .put<std::uint32_t>(static_cast<std::uint32_t>(r.missing.size()));
  for (int m : r.missing) w.put<std::int32_t>(m);
  w.put_string(r.message);
  std::vector<int> fds;
  std::uint32_t parts = r.parts ? static_cast<std::uint32_t>(r.parts->size()) : 0;
  w.put<std::uint32_t>(parts);
  if (r.parts) {
    for (const detail::Part& p : *r.parts) {
      w.put_bytes(p.bytes.data(), p.bytes.size());
      w.put<std::uint32_t>(static_cast<std::uint32_t>(p.fds.size()));
      for (const UniqueFd& f : p.fds) fds.push_back(f.get());
    }
  }
  auto body = w.take();
  detail::send_message(sock, MessageType::reply, as_bytes(body), fds);
}

detail::Received decode_reply(detail::Message& m) {
  Reader rd(m.body);
  detail::Received r;
  r.type = static_cast<detail::ReplyType>(rd.get<std::uint8_t>());
  r.reason = static_cast<detail::FailReason>(rd.get<std::uint8_t>());
  r.generation = rd.get<std::uint64_t>();
  r.sequence = rd.get<std::uint64_t>();
  auto nm = rd.get<std::uint32_t>();
  for (std::uint32_t i = 0; i < nm; ++i) r.missing.push_back(rd.get<std::int32_t>());
  r.message = rd.get_string();
  auto parts = rd.get<std::uint32_t>();
  std::size_t fd_at = 0;
  for (std::uint32_t i = 0; i < parts; ++i) {
    detail::Part p;
    p.bytes = rd.get_bytes();
    auto nf = rd.get<std::uint32_t>();
    if (fd_at + nf > m.fds.size()) throw error("group socket: reply names more descriptors than it carries");
    for (std::uint32_t k = 0; k < nf; ++k) p.fds.push_back(std::move(m.fds[fd_at++]));
    r.parts.push_back(std::move(p));
  }
  return r;
}

// --- the hub's server -------------------------------------------------------------------------

class HubServer {
 public:
  HubServer(const Rendezvous& rv, int size)
      : path_(rv.socket_path()),
        dir_(rv.directory),
        secret_(rv.secret),
        size_(size),
        hub_(size),
        ranks_(static_cast<std::size_t>(size)) {
    check_private_directory(dir_);
    sockaddr_un addr = socket_address(path_);
    struct stat st {};
    if (::lstat(path_.c_str(), &st) == 0) {
      // A socket left by an earlier group in our own private directory.
      if (!S_ISSOCK(st.st_mode) || st.st_uid != ::geteuid())
        throw error(fmt::format("'{}' exists and is not a socket of this user; refusing to replace it", path_));
      ::unlink(path_.c_str());
    }
    listen_.reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    if (!listen_) throw error(fmt::format("socket(AF_UNIX, SOCK_SEQPACKET) failed: {}", errno_text()));
    if (::bind(listen_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
      throw error(fmt::format("bind of the rendezvous socket '{}' failed: {}", path_, errno_text()));
    if (::chmod(path_.c_str(), 0600) != 0)
      throw error(fmt::format("chmod 0600 of the rendezvous socket '{}' failed: {}", path_, errno_text()));
    if (::listen(listen_.get(), 128) != 0) throw error(fmt::format("listen on '{}' failed: {}", path_, errno_text()));
    wake_.reset(::eventfd(0, EFD_CLOEXEC));
    if (!wake_) throw error(fmt::format("eventfd failed: {}", errno_text()));
    thread_ = std::thread([this] { run(); });
  }

  ~HubServer() {
    std::uint64_t one = 1;
    if (::write(wake_.get(), &one, sizeof one) < 0) log::error("group hub: could not signal the server thread to stop");
    if (thread_.joinable()) thread_.join();
    ::unlink(path_.c_str());
  }

  std::size_t refused() const noexcept { return refused_.load(); }

 private:
  struct Hello {
    UniqueFd sock;
    ucred cred{};
    clock_type::time_point deadline;
  };

  void run() noexcept {
    try {
      loop();
    } catch (const std::exception& e) {
      log::error("group hub at '{}' stopped: {}; every rank will see the group fail", path_, e.what());
    }
    for (auto& r : ranks_) r.reset();
  }

  void loop() {
    for (;;) {
      std::vector<pollfd> fds;
      fds.push_back({wake_.get(), POLLIN, 0});
      fds.push_back({listen_.get(), POLLIN, 0});
      for (auto& h : hellos_) fds.push_back({h.sock.get(), POLLIN, 0});
      for (auto& r : ranks_) fds.push_back({r.get(), POLLIN, 0});  // -1 is ignored by poll
      int wait_ms = -1;
      auto now = clock_type::now();
      for (auto& h : hellos_) {
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(h.deadline - now).count();
        wait_ms = wait_ms < 0 ? static_cast<int>(std::max<long long>(left, 0))
                              : std::min(wait_ms, static_cast<int>(std::max<long long>(left, 0)));
      }
      int n = ::poll(fds.data(), fds.size(), wait_ms);
      if (n < 0) {
        if (errno == EINTR) continue;
        throw error(fmt::format("poll failed: {}", errno_text()));
      }
      if (fds[0].revents != 0) return;
      // fds holds the hellos and ranks as they were when polled; new connections join the
      // poll set on the next round.
      const std::size_t polled_hellos = hellos_.size();
      std::size_t at = 2;
      std::vector<std::size_t> done;
      for (std::size_t i = 0; i < polled_hellos; ++i, ++at) {
        if (fds[at].revents != 0) {
          hello(hellos_[i]);
          done.push_back(i);
        } else if (clock_type::now() >= hellos_[i].deadline) {
          refuse(hellos_[i], "no hello within the deadline");
          done.push_back(i);
        }
      }
      for (std::size_t k = done.size(); k-- > 0;) hellos_.erase(hellos_.begin() + static_cast<std::ptrdiff_t>(done[k]));
      for (int r = 0; r < size_; ++r, ++at)
        if (fds[at].fd >= 0 && fds[at].revents != 0 && ranks_[static_cast<std::size_t>(r)].get() == fds[at].fd)
          serve(r);
      if (fds[1].revents & POLLIN) accept_one();
    }
  }

  void accept_one() {
    UniqueFd s(::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!s) {
      log::warn("group hub at '{}': accept failed: {}", path_, errno_text());
      return;
    }
    ucred c{};
    try {
      c = peer_credentials(s.get());
    } catch (const std::exception& e) {
      ++refused_;
      log::warn("group hub at '{}': refused a connection: {}", path_, e.what());
      return;
    }
    if (c.uid != ::geteuid()) {
      ++refused_;
      log::warn("group hub at '{}': refused a connection from pid {} of uid {} (only uid {} may join)", path_, c.pid,
                c.uid, ::geteuid());
      return;
    }
    // A rank that stops reading must not stall the hub: its sends time out and it is dropped.
    timeval tv{send_timeout_seconds, 0};
    if (::setsockopt(s.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) != 0)
      log::warn("group hub at '{}': SO_SNDTIMEO failed ({}); a stuck rank could stall the hub", path_, errno_text());
    hellos_.push_back({std::move(s), c, clock_type::now() + hello_deadline});
  }

  void refuse(Hello& h, const std::string& why) {
    ++refused_;
    log::warn("group hub at '{}': refused a connection from pid {} (uid {}): {}", path_, h.cred.pid, h.cred.uid, why);
    try {
      Writer w;
      w.put_string(why);
      auto body = w.take();
      detail::send_message(h.sock.get(), MessageType::refused, as_bytes(body));
    } catch (const std::exception&) {
      // The peer may be gone already; it is refused either way.
    }
    h.sock.reset();
  }

  void hello(Hello& h) {
    std::optional<detail::Message> m;
    try {
      m = detail::recv_message(h.sock.get(), clock_type::now() + std::chrono::seconds(1));
    } catch (const std::exception& e) {
      refuse(h, fmt::format("unreadable hello ({})", e.what()));
      return;
    }
    if (!m || m->type != MessageType::hello) return refuse(h, "the first message was not a hello");
    int rank = -1, size = -1;
    std::uint32_t version = 0;
    std::string secret;
    try {
      Reader rd(m->body);
      version = rd.get<std::uint32_t>();
      rank = rd.get<std::int32_t>();
      size = rd.get<std::int32_t>();
      secret = rd.get_string();
    } catch (const std::exception&) {
      return refuse(h, "malformed hello");
    }
    if (!m->fds.empty()) return refuse(h, "a hello must not carry descriptors");
    if (version != detail::wire_version)
      return refuse(h, fmt::format("protocol version {} (this hub speaks {})", version, detail::wire_version));
    if (!equal_constant_time(secret, secret_)) return refuse(h, "wrong secret");
    if (size != size_) return refuse(h, fmt::format("claims a group of {} ranks, this group has {}", size, size_));
    if (rank < 0 || rank >= size_) return refuse(h, fmt::format("rank {} is outside [0, {})", rank, size_));
    if (left_.count(rank)) return refuse(h, fmt::format("rank {} left this group and cannot rejoin", rank));
    if (ranks_[static_cast<std::size_t>(rank)]) return refuse(h, fmt::format("rank {} is already connected", rank));
    try {
      detail::send_message(h.sock.get(), MessageType::welcome, {});
    } catch (const std::exception& e) {
      log::warn("group hub at '{}': rank {} vanished while joining: {}", path_, rank, e.what());
      return;
    }
    log::debug("group hub at '{}': rank {} joined (pid {})", path_, rank, h.cred.pid);
    ranks_[static_cast<std::size_t>(rank)] = std::move(h.sock);
  }

  void serve(int rank) {
    auto& sock = ranks_[static_cast<std::size_t>(rank)];
    detail::Deliveries out;
    try {
      std::optional<detail::Message> m = detail::recv_message(sock.get(), clock_type::now() + std::chrono::seconds(1));
      if (!m) return;
      Reader rd(m->body);
      switch (m->type) {
        case MessageType::contribute: {
          auto g = rd.get<std::uint64_t>();
          auto s = rd.get<std::uint64_t>();
          auto k = static_cast<detail::CollectiveKind>(rd.get<std::uint8_t>());
          detail::Part p;
          p.bytes = rd.get_bytes();
          p.fds = std::move(m->fds);
          out = hub_.contribute(rank, g, s, k, std::move(p));
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
        default: throw error(fmt::format("unexpected message type {}", static_cast<int>(m->type)));
      }
    } catch (const std::exception& e) {
      // End of stream is how a rank leaves; anything else is a broken peer. Either way it is out.
      log::debug("group hub at '{}': rank {} disconnected: {}", path_, rank, e.what());
      drop(rank, out);
    }
    deliver(std::move(out));
  }

  void drop(int rank, detail::Deliveries& out) {
    ranks_[static_cast<std::size_t>(rank)].reset();
    left_.insert(rank);
    auto more = hub_.leave(rank);
    for (auto& d : more) out.push_back(std::move(d));
  }

  void deliver(detail::Deliveries out) {
    while (!out.empty()) {
      detail::Deliveries next;
      for (auto& [rank, reply] : out) {
        auto& sock = ranks_[static_cast<std::size_t>(rank)];
        if (!sock) continue;
        try {
          send_reply(sock.get(), reply);
        } catch (const std::exception& e) {
          log::warn("group hub at '{}': rank {} cannot be reached ({}); it leaves the group", path_, rank, e.what());
          drop(rank, next);
        }
      }
      out = std::move(next);
    }
  }

  std::string path_;
  std::string dir_;
  std::string secret_;
  int size_;
  detail::Hub hub_;
  UniqueFd listen_;
  UniqueFd wake_;
  std::vector<Hello> hellos_;
  std::vector<UniqueFd> ranks_;  // by rank; empty until joined, again after leaving
  std::set<int> left_;
  std::atomic<std::size_t> refused_{0};
  std::thread thread_;  // last: starts after everything above exists
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Rendezvous

Rendezvous Rendezvous::create() {
  std::string base = options::tmpdir();
  std::string templ = base + "/torpor-group-XXXXXX";
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr)
    throw error(
        fmt::format("could not create a private rendezvous directory under '{}': {} (set TMPDIR)", base, errno_text()));
  Rendezvous rv;
  rv.directory = buf.data();
  (void)socket_address(rv.socket_path());  // fail now, not in every rank, when the path is too long
  unsigned char raw[32];
  std::size_t got = 0;
  while (got < sizeof raw) {
    ssize_t n = ::getrandom(raw + got, sizeof raw - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw error(fmt::format("getrandom failed: {}", errno_text()));
    }
    got += static_cast<std::size_t>(n);
  }
  for (unsigned char c : raw) rv.secret += fmt::format("{:02x}", c);
  return rv;
}

std::string Rendezvous::to_string() const { return directory + "#" + secret; }

Rendezvous Rendezvous::parse(std::string_view text) {
  auto at = text.rfind('#');
  if (at == std::string_view::npos || at == 0)
    throw invalid_argument(fmt::format("'{}' is not a rendezvous (expected <directory>#<64 hex digits>)", text));
  Rendezvous rv;
  rv.directory = std::string(text.substr(0, at));
  rv.secret = std::string(text.substr(at + 1));
  bool hex = rv.secret.size() == 64 && std::all_of(rv.secret.begin(), rv.secret.end(),
                                                   [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); });
  if (!hex) throw invalid_argument("rendezvous secret must be 64 hex digits (from Rendezvous::create())");
  return rv;
}

void Rendezvous::remove() const noexcept {
  ::unlink(socket_path().c_str());
  ::rmdir(directory.c_str());
}

// ---------------------------------------------------------------------------------------------
// The rank's side

struct UnixSocketGroup::Impl final : detail::HubClientGroup {
  Impl(const Rendezvous& rv, int rank, int size, const GroupOptions& options)
      : HubClientGroup(rank, size, options), rendezvous_(rv) {
    (void)Rendezvous::parse(rv.to_string());  // validates the secret's form
    if (rank == 0) server_ = std::make_unique<HubServer>(rv, size);
    connect();
    exchange(detail::CollectiveKind::formation, detail::Part{});
  }

  ~Impl() override {
    sock_.reset();    // leaving: the hub (ours or rank 0's) sees the connection close
    server_.reset();  // rank 0: stop serving, remove the socket
    if (rank() == 0 && ::rmdir(rendezvous_.directory.c_str()) != 0)
      log::debug("{}: the rendezvous directory '{}' stays ({})", who(), rendezvous_.directory, errno_text());
  }

  std::string_view kind() const noexcept override { return "unix"; }

  void connect() {
    check_private_directory(rendezvous_.directory);
    sockaddr_un addr = socket_address(rendezvous_.socket_path());
    auto deadline = clock::now() + timeout_;
    for (;;) {
      UniqueFd s(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
      if (!s) throw error(fmt::format("{}: socket failed: {}", who(), errno_text()));
      if (::connect(s.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) {
        ucred c = peer_credentials(s.get());
        if (c.uid != ::geteuid())
          throw error(fmt::format("{}: the rendezvous socket '{}' is served by uid {}, not this user (uid {}); "
                                  "refusing to send memory handles there",
                                  who(), rendezvous_.socket_path(), c.uid, ::geteuid()));
        Writer w;
        w.put<std::uint32_t>(detail::wire_version)
            .put<std::int32_t>(rank())
            .put<std::int32_t>(size())
            .put_string(rendezvous_.secret);
        auto body = w.take();
        detail::send_message(s.get(), MessageType::hello, as_bytes(body));
        std::optional<detail::Message> m = detail::recv_message(s.get(), deadline);
        if (!m)
          throw group_timeout(fmt::format("{}: the rendezvous at '{}' did not welcome this rank within {} ms", who(),
                                          rendezvous_.socket_path(), timeout_.count()),
                              {0});
        if (m->type == MessageType::refused) {
          Reader rd(m->body);
          throw error(fmt::format("{}: the rendezvous at '{}' refused this rank: {}", who(), rendezvous_.socket_path(),
                                  rd.get_string()));
        }
        if (m->type != MessageType::welcome)
          throw error(fmt::format("{}: unexpected answer to hello from '{}'", who(), rendezvous_.socket_path()));
        sock_ = std::move(s);
        return;
      }
      if (errno != ENOENT && errno != ECONNREFUSED && errno != EAGAIN && errno != EINTR)
        throw error(fmt::format("{}: connect to '{}' failed: {}", who(), rendezvous_.socket_path(), errno_text()));
      if (clock::now() >= deadline)
        throw group_timeout(fmt::format("{}: could not reach the rendezvous socket '{}' within {} ms (rank 0 hosts "
                                        "it: is rank 0 running?)",
                                        who(), rendezvous_.socket_path(), timeout_.count()),
                            {0});
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

  void send(MessageType t, Writer& w, std::span<const int> fds = {}) {
    auto body = w.take();
    try {
      detail::send_message(sock_.get(), t, as_bytes(body), fds);
    } catch (const std::exception& e) {
      throw invalid_state(fmt::format("{}: lost the rendezvous hosted by rank 0 ({}); rank 0 exited or destroyed its "
                                      "group; build a new group",
                                      who(), e.what()));
    }
  }

  void post_contribution(std::uint64_t g, std::uint64_t s, detail::CollectiveKind k, detail::Part p) override {
    Writer w;
    w.put<std::uint64_t>(g).put<std::uint64_t>(s).put<std::uint8_t>(static_cast<std::uint8_t>(k));
    w.put_bytes(p.bytes.data(), p.bytes.size());
    std::vector<int> fds;
    for (auto& f : p.fds) fds.push_back(f.get());
    send(MessageType::contribute, w, fds);  // the kernel duplicates them into the hub's process
  }
  void post_give_up(std::uint64_t g, std::uint64_t s, double waited) override {
    Writer w;
    w.put<std::uint64_t>(g).put<std::uint64_t>(s).put<double>(waited);
    send(MessageType::give_up, w);
  }
  void post_recover(std::uint64_t g) override {
    Writer w;
    w.put<std::uint64_t>(g);
    send(MessageType::recover, w);
  }
  void post_give_up_recovery(std::uint64_t g) override {
    Writer w;
    w.put<std::uint64_t>(g);
    send(MessageType::give_up_recovery, w);
  }
  std::optional<detail::Received> next_reply(clock::time_point deadline) override {
    std::optional<detail::Message> m;
    try {
      m = detail::recv_message(sock_.get(), deadline);
    } catch (const std::exception& e) {
      throw invalid_state(fmt::format("{}: lost the rendezvous hosted by rank 0 ({}); rank 0 exited or destroyed its "
                                      "group; build a new group",
                                      who(), e.what()));
    }
    if (!m) return std::nullopt;
    if (m->type != MessageType::reply) throw error(fmt::format("{}: unexpected message from the rendezvous", who()));
    return decode_reply(*m);
  }

  Rendezvous rendezvous_;
  std::unique_ptr<HubServer> server_;
  UniqueFd sock_;
};

UnixSocketGroup::UnixSocketGroup(const Rendezvous& rendezvous, int rank, int size, const GroupOptions& options)
    : Group(options), impl_(std::make_unique<Impl>(rendezvous, rank, size, options)) {}

UnixSocketGroup::~UnixSocketGroup() = default;

int UnixSocketGroup::rank() const noexcept { return impl_->rank(); }
int UnixSocketGroup::size() const noexcept { return impl_->size(); }
std::vector<std::vector<std::byte>> UnixSocketGroup::all_gather(std::span<const std::byte> mine) {
  return impl_->all_gather(mine);
}
std::vector<std::vector<UniqueFd>> UnixSocketGroup::all_gather_fds(std::span<const int> mine) {
  return impl_->all_gather_fds(mine);
}
void UnixSocketGroup::barrier() { impl_->barrier(); }
void UnixSocketGroup::recover() { impl_->recover(); }
std::size_t UnixSocketGroup::refused_connections() const { return impl_->server_ ? impl_->server_->refused() : 0; }

std::unique_ptr<Group> unix_group_from_env(const GroupOptions& options) {
  auto need = [](options::id key, auto value) {
    if (!value)
      throw invalid_argument(fmt::format("{} is not set (a UnixSocketGroup from the environment needs "
                                         "TORPOR_GROUP_RENDEZVOUS, TORPOR_RANK and TORPOR_WORLD_SIZE)",
                                         options::option(key).name));
    return *value;
  };
  Rendezvous rv = Rendezvous::parse(need(options::id::group_rendezvous, options::group_rendezvous()));
  const int rank = need(options::id::rank, options::rank());
  const int size = need(options::id::world_size, options::world_size());
  return std::make_unique<UnixSocketGroup>(rv, rank, size, options);
}

}  // namespace torpor
