// UnixSocketGroup: ranks in separate processes of one node meeting at a Unix socket that rank 0
// serves; what is Unix about it: the transport under the hub (hub_server.hpp), the rank's
// connection, and the rendezvous directory (rendezvous.hpp).
//
// Security (exported GPU memory must never reach a foreign process):
//   - the socket lives in a directory that must be owned by this user with mode 0700; both ends
//     check it, and the hub creates the socket 0600;
//   - the hub checks every connection's peer credentials (SO_PEERCRED): another uid is closed
//     at once; a connection of this uid must then present the group's secret (compared in
//     constant time), a rank in range and the group size, in one fixed-size hello within a
//     short deadline (hub_protocol.hpp); rank 0 must be the hub's own process;
//   - every rank checks the hub's credentials too before sending anything;
//   - refusals are logged with the peer's pid and uid and counted; they never touch the Hub;
//   - one rank 0 per rendezvous: the hub holds an flock on group.lock in the directory for its
//     life and only then replaces a socket left there (by a hub that died).
//
// The wire is SOCK_SEQPACKET: one datagram per frame, descriptors with SCM_RIGHTS beside the
// frame they belong to (group_wire.hpp). The hub reads a stranger's hello with one datagram read
// of a hello's size plus one byte, so a longer one arrives truncated and is refused.
#include <fcntl.h>
#include <fmt/core.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <thread>

#include "common/options.hpp"
#include "ranks/groups/hub/group_client.hpp"
#include "ranks/groups/hub/group_wire.hpp"
#include "ranks/groups/hub/hub_protocol.hpp"
#include "ranks/groups/hub/hub_server.hpp"
#include "ranks/groups/rendezvous.hpp"
#include "torpor/group.hpp"
#include "torpor/log.hpp"

namespace torpor {

namespace {

using detail::check_private_directory;
using detail::MessageType;
using detail::Reader;
using detail::socket_address;

std::string errno_text() { return std::strerror(errno); }

ucred peer_credentials(int sock) {
  ucred c{};
  socklen_t n = sizeof c;
  if (::getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &c, &n) != 0)
    throw error(fmt::format("SO_PEERCRED failed: {}", errno_text()));
  return c;
}

// --- the hub's transport ------------------------------------------------------------------------

// One connection: a datagram is a frame, and its descriptors come with it.
class UnixLink final : public detail::HubLink {
 public:
  UnixLink(UniqueFd sock, const ucred& cred) : sock_(std::move(sock)), cred_(cred) {}

  int fd() const noexcept override { return sock_.get(); }
  std::string peer() const override { return fmt::format("pid {} (uid {})", cred_.pid, cred_.uid); }
  pid_t pid() const noexcept override { return cred_.pid; }

  detail::RecvStatus receive(std::vector<detail::Datagram>& frames, bool hello) override {
    const std::size_t limit =
        hello ? detail::hello_frame_bytes + 1 : sizeof(detail::FrameHeader) + detail::frame_data_limit;
    detail::Datagram d;
    detail::RecvStatus st = detail::recv_datagram(sock_.get(), limit, d);
    if (st == detail::RecvStatus::ok) frames.push_back(std::move(d));
    return st;
  }
  void send(MessageType type, std::span<const std::byte> body, std::span<const int> fds) override {
    detail::send_message(sock_.get(), type, body, fds);
  }
  bool try_send(MessageType type, std::span<const std::byte> body) noexcept override {
    try {
      return detail::try_send_datagram(sock_.get(), detail::encode_frame(type, body));
    } catch (const std::exception&) {
      return false;
    }
  }

 private:
  UniqueFd sock_;
  ucred cred_;
};

// The socket in the rendezvous directory, and the lock that makes its holder the one hub.
class UnixTransport final : public detail::HubTransport {
 public:
  explicit UnixTransport(const Rendezvous& rv) : path_(rv.socket_path()), dir_(rv.directory) {
    check_private_directory(dir_);
    try {
      listen();
    } catch (...) {
      remove_files();
      throw;
    }
  }
  ~UnixTransport() override { remove_files(); }
  UnixTransport(const UnixTransport&) = delete;
  UnixTransport& operator=(const UnixTransport&) = delete;

  std::string name() const override { return fmt::format("group hub at '{}'", path_); }
  int listening_fd() const noexcept override { return listen_.get(); }

  std::optional<Arrival> accept() override {
    // Blocking sends (bounded by SO_SNDTIMEO) for the ranks' replies; reads never wait
    // (MSG_DONTWAIT).
    UniqueFd s(::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!s) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED)
        log::warn("{}: accept failed: {}", name(), errno_text());
      return std::nullopt;
    }
    ucred c{};
    try {
      c = peer_credentials(s.get());
    } catch (const std::exception& e) {
      return Arrival{nullptr, e.what()};
    }
    if (c.uid != ::geteuid())
      return Arrival{nullptr, fmt::format("pid {} of uid {} (only uid {} may join)", c.pid, c.uid, ::geteuid())};
    // A rank that stops reading must not stall the hub: its sends time out and it is dropped.
    timeval tv{detail::send_timeout_seconds, 0};
    if (::setsockopt(s.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) != 0)
      log::warn("{}: SO_SNDTIMEO failed ({}); a stuck rank could stall the hub", name(), errno_text());
    return Arrival{std::make_unique<UnixLink>(std::move(s), c), {}};
  }

 private:
  // The socket first, then the lock: whoever takes the lock next finds no socket of ours.
  void remove_files() noexcept {
    if (bound_) ::unlink(path_.c_str());
    if (lock_) ::unlink((dir_ + "/" + detail::rendezvous_lock_name).c_str());
  }

  void listen() {
    sockaddr_un addr = socket_address(path_);
    take_lock();
    struct stat st {};
    if (::lstat(path_.c_str(), &st) == 0) {
      // A socket left by a hub that died (we hold the lock, so none is serving it).
      if (!S_ISSOCK(st.st_mode) || st.st_uid != ::geteuid())
        throw error(fmt::format("'{}' exists and is not a socket of this user; refusing to replace it", path_));
      ::unlink(path_.c_str());
    }
    listen_.reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!listen_) throw error(fmt::format("socket(AF_UNIX, SOCK_SEQPACKET) failed: {}", errno_text()));
    if (::bind(listen_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
      throw error(fmt::format("bind of the rendezvous socket '{}' failed: {}", path_, errno_text()));
    bound_ = true;
    if (::chmod(path_.c_str(), 0600) != 0)
      throw error(fmt::format("chmod 0600 of the rendezvous socket '{}' failed: {}", path_, errno_text()));
    if (::listen(listen_.get(), 128) != 0) throw error(fmt::format("listen on '{}' failed: {}", path_, errno_text()));
  }

  void take_lock() {
    const std::string lock_path = dir_ + "/" + detail::rendezvous_lock_name;
    lock_.reset(::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (!lock_) throw error(fmt::format("could not open the rendezvous lock '{}': {}", lock_path, errno_text()));
    if (::flock(lock_.get(), LOCK_EX | LOCK_NB) != 0) {
      const int e = errno;
      char text[32] = {};
      ssize_t n = ::pread(lock_.get(), text, sizeof text - 1, 0);
      lock_.reset();
      if (e == EWOULDBLOCK)
        throw invalid_state(fmt::format("the rendezvous at '{}' is already served by a live rank 0 (pid {}); a group "
                                        "has one rank 0",
                                        dir_, n > 0 ? std::string(text, static_cast<std::size_t>(n)) : "?"));
      throw error(fmt::format("could not lock '{}': {}", lock_path, std::strerror(e)));
    }
    std::string pid = std::to_string(::getpid());
    if (::ftruncate(lock_.get(), 0) != 0 || ::pwrite(lock_.get(), pid.data(), pid.size(), 0) < 0)
      log::debug("group hub at '{}': could not record its pid in the lock file", dir_);
  }

  std::string path_;
  std::string dir_;
  UniqueFd lock_;
  bool bound_ = false;
  UniqueFd listen_;
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// The rank's side

struct UnixSocketGroup::Impl final : detail::WireClientGroup {
  Impl(const Rendezvous& rv, int rank, int size, const GroupOptions& options)
      : WireClientGroup(rank, size, options), rendezvous_(rv) {
    (void)Rendezvous::parse(rv.to_string());  // validates the secret's form
    if (rank == 0) server_ = std::make_unique<detail::HubServer>(std::make_unique<UnixTransport>(rv), size, rv.secret);
    try {
      connect();
      exchange(detail::CollectiveKind::formation, detail::Part{});
    } catch (...) {
      leave();
      throw;
    }
  }

  ~Impl() override { leave(); }

  // Rank 0 takes the rendezvous with it: the socket, its lock, the directory.
  void leave() noexcept {
    sock_.reset();  // leaving: the hub (ours or rank 0's) sees the connection close
    if (!server_) return;
    server_.reset();
    rendezvous_.remove();
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
        const std::vector<std::byte> hello = detail::encode_hello(rank(), size(), rendezvous_.secret);
        if (::send(s.get(), hello.data(), hello.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(hello.size())) {
          if ((errno == EPIPE || errno == ECONNRESET) && clock::now() < deadline) {
            // Closed at the door (the hub made room among waiting connections): knock again.
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
            continue;
          }
          throw error(
              fmt::format("{}: sending the hello to '{}' failed: {}", who(), rendezvous_.socket_path(), errno_text()));
        }
        std::optional<detail::Message> m = detail::recv_message(s.get(), deadline);
        if (!m)
          throw group_timeout(fmt::format("{}: the rendezvous at '{}' did not welcome this rank within {} ms", who(),
                                          rendezvous_.socket_path(), timeout_.count()),
                              {0});
        if (m->type == MessageType::busy && clock::now() < deadline) {
          // A crowd of connections at the door (a stranger's flood): knock again.
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
          continue;
        }
        if (m->type == MessageType::refused || m->type == MessageType::busy) {
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

  void send_to_hub(MessageType type, std::span<const std::byte> body, std::span<const int> fds) override {
    detail::send_message(sock_.get(), type, body, fds);
  }
  std::optional<detail::Message> receive_from_hub(clock::time_point deadline) override {
    return detail::recv_message(sock_.get(), deadline);
  }

  Rendezvous rendezvous_;
  std::unique_ptr<detail::HubServer> server_;
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
