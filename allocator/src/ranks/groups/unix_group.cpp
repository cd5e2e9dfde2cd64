// UnixSocketGroup: ranks in separate processes meeting at a Unix socket that rank 0 serves.
//
// Security (exported GPU memory must never reach a foreign process):
//   - the socket lives in a directory that must be owned by this user with mode 0700; both ends
//     check it, and the hub creates the socket 0600;
//   - the hub checks every connection's peer credentials (SO_PEERCRED): another uid is closed
//     at once; a connection of this uid must then present the group's secret (compared in
//     constant time), a rank in range and the group size, in one fixed-size hello within a
//     short deadline (hub_protocol.hpp);
//   - every rank checks the hub's credentials too before sending anything;
//   - refusals are logged with the peer's pid and uid and counted; they never touch the Hub;
//   - one rank 0 per rendezvous: the hub holds an flock on group.lock in the directory for its
//     life and only then replaces a socket left there (by a hub that died).
//
// A stranger never delays the group: the hub runs in one thread of rank 0's process and polls
// the listening socket, the strangers and the ranks' connections; every read is one datagram
// that is already there (MSG_DONTWAIT), a stranger gets one read of a hello of a fixed size,
// and at most max_strangers wait to say hello (the oldest is dropped for a newcomer). A rank's
// messages are reassembled as their frames arrive; a rank that stops halfway through one is
// dropped after continuation_wait. A rank whose connection closes has left the group
// (Hub::leave). Replies to ranks are sent blocking, bounded by SO_SNDTIMEO: a rank that stops
// reading is dropped.
//
// Rendezvous directories hold group.sock, group.lock and owner (the creating process's pid and
// start time); Rendezvous::create() removes those of this user whose creator is dead and whose
// lock is free (a crashed run's), and every path out of a group removes its own.
#include <dirent.h>
#include <fcntl.h>
#include <fmt/core.h>
#include <poll.h>
#include <signal.h>  // NOLINT(modernize-deprecated-headers): kill() is POSIX, not in <csignal>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>

#include "common/options.hpp"
#include "ranks/groups/hub/group_client.hpp"
#include "ranks/groups/hub/group_wire.hpp"
#include "ranks/groups/hub/hub_protocol.hpp"
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

std::span<const std::byte> as_bytes(const std::vector<std::byte>& v) { return {v.data(), v.size()}; }

// --- the hub's server -------------------------------------------------------------------------

// The rendezvous directory's lock: whoever holds it serves the socket. flock locks die with their
// process, so a crashed hub's socket may be replaced, a live one never.
constexpr const char* lock_name = "group.lock";
constexpr const char* owner_name = "owner";

class HubServer {
 public:
  HubServer(const Rendezvous& rv, int size)
      : path_(rv.socket_path()),
        dir_(rv.directory),
        protocol_(size, rv.secret, ::getpid()),
        ranks_(static_cast<std::size_t>(size)),
        rank_deadlines_(static_cast<std::size_t>(size)) {
    check_private_directory(dir_);
    try {
      start();
    } catch (...) {
      remove_files();
      throw;
    }
  }

  ~HubServer() {
    if (thread_.joinable()) {
      std::uint64_t one = 1;
      if (::write(wake_.get(), &one, sizeof one) < 0)
        log::error("group hub: could not signal the server thread to stop");
      thread_.join();
    }
    remove_files();
  }

  HubServer(const HubServer&) = delete;
  HubServer& operator=(const HubServer&) = delete;

  std::size_t refused() const noexcept { return refused_.load(); }

 private:
  // A connection that has not presented the secret yet.
  struct Stranger {
    UniqueFd sock;
    ucred cred{};
    clock_type::time_point deadline;
  };

  // The socket first, then the lock: whoever takes the lock next finds no socket of ours.
  void remove_files() noexcept {
    if (bound_) ::unlink(path_.c_str());
    if (lock_) ::unlink((dir_ + "/" + lock_name).c_str());
  }

  void start() {
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
    wake_.reset(::eventfd(0, EFD_CLOEXEC));
    if (!wake_) throw error(fmt::format("eventfd failed: {}", errno_text()));
    thread_ = std::thread([this] { run(); });
  }

  void take_lock() {
    const std::string lock_path = dir_ + "/" + lock_name;
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

  void run() noexcept {
    try {
      loop();
    } catch (const std::exception& e) {
      log::error("group hub at '{}' stopped: {}; every rank will see the group fail", path_, e.what());
    }
    for (auto& r : ranks_) r.reset();
  }

  // One poll over everything; then the ranks' traffic, the strangers' hellos, new connections.
  // Nothing here waits on one connection: every read is one datagram that is already there.
  void loop() {
    std::vector<pollfd> fds;
    for (;;) {
      fds.clear();
      fds.push_back({wake_.get(), POLLIN, 0});
      fds.push_back({listen_.get(), POLLIN, 0});
      for (auto& r : ranks_) fds.push_back({r.get(), POLLIN, 0});  // -1 is ignored by poll
      for (auto& s : strangers_) fds.push_back({s.sock.get(), POLLIN, 0});
      int n = ::poll(fds.data(), fds.size(), poll_timeout_ms());
      if (n < 0) {
        if (errno == EINTR) continue;
        throw error(fmt::format("poll failed: {}", errno_text()));
      }
      if (fds[0].revents != 0) return;
      std::size_t at = 2;
      for (int r = 0; r < size(); ++r, ++at)
        if (fds[at].fd >= 0 && fds[at].revents != 0 && ranks_[static_cast<std::size_t>(r)].get() == fds[at].fd)
          serve(r);
      drop_stalled_ranks();
      // Strangers as they were when polled; accepting below only appends.
      const std::size_t polled = strangers_.size();
      std::vector<bool> done(polled, false);
      for (std::size_t i = 0; i < polled; ++i, ++at) {
        if (fds[at].revents != 0) {
          admit(strangers_[i]);
          done[i] = true;
        } else if (clock_type::now() >= strangers_[i].deadline) {
          refuse(strangers_[i], "no hello within the deadline");
          done[i] = true;
        }
      }
      for (std::size_t i = polled; i-- > 0;)
        if (done[i]) strangers_.erase(strangers_.begin() + static_cast<std::ptrdiff_t>(i));
      if (fds[1].revents & POLLIN) accept_some();
    }
  }

  int size() const noexcept { return protocol_.size(); }

  int poll_timeout_ms() const {
    std::optional<clock_type::time_point> next;
    for (auto& s : strangers_)
      if (!next || s.deadline < *next) next = s.deadline;
    for (auto& d : rank_deadlines_)
      if (d && (!next || *d < *next)) next = *d;
    if (!next) return -1;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(*next - clock_type::now()).count();
    return static_cast<int>(std::clamp<long long>(left + 1, 0, 1 << 30));
  }

  void accept_some() {
    for (int k = 0; k < accept_batch; ++k) {
      // Blocking sends (bounded by SO_SNDTIMEO) for the ranks' replies; reads never wait
      // (MSG_DONTWAIT).
      UniqueFd s(::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC));
      if (!s) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ECONNABORTED)
          log::warn("group hub at '{}': accept failed: {}", path_, errno_text());
        return;
      }
      ucred c{};
      try {
        c = peer_credentials(s.get());
      } catch (const std::exception& e) {
        ++refused_;
        log::warn("group hub at '{}': refused a connection: {}", path_, e.what());
        continue;
      }
      if (c.uid != ::geteuid()) {
        ++refused_;
        log::warn("group hub at '{}': refused a connection from pid {} of uid {} (only uid {} may join)", path_, c.pid,
                  c.uid, ::geteuid());
        continue;
      }
      // A rank that stops reading must not stall the hub: its sends time out and it is dropped.
      timeval tv{send_timeout_seconds, 0};
      if (::setsockopt(s.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv) != 0)
        log::warn("group hub at '{}': SO_SNDTIMEO failed ({}); a stuck rank could stall the hub", path_, errno_text());
      strangers_.push_back({std::move(s), c, clock_type::now() + hello_deadline});
      // The cap: the oldest stranger makes room (a rank says hello at once, so it is never the
      // oldest for long).
      if (strangers_.size() > max_strangers) {
        refuse(strangers_.front(), fmt::format("more than {} connections waiting to say hello", max_strangers),
               MessageType::busy);
        strangers_.erase(strangers_.begin());
      }
    }
  }

  void refuse(Stranger& s, const std::string& why, MessageType type = MessageType::refused) {
    // Logged, but a flood of strangers must not flood the log: the first few, then every
    // power of two.
    const std::size_t n = ++refused_;
    if (n <= 8 || (n & (n - 1)) == 0)
      log::warn("group hub at '{}': refused a connection from pid {} (uid {}): {} ({} refused so far)", path_,
                s.cred.pid, s.cred.uid, why, n);
    else
      log::debug("group hub at '{}': refused a connection from pid {} (uid {}): {}", path_, s.cred.pid, s.cred.uid,
                 why);
    try {
      Writer w;
      w.put_string(why.substr(0, 1024));
      auto body = w.take();
      (void)detail::try_send_datagram(s.sock.get(), detail::encode_frame(type, as_bytes(body)));
    } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): refused either way
    }
    s.sock.reset();
  }

  // The stranger's first datagram, read once: one hello of a fixed size, or a refusal.
  void admit(Stranger& s) {
    detail::Datagram d;
    detail::RecvStatus st;
    try {
      st = detail::recv_datagram(s.sock.get(), detail::hello_frame_bytes + 1, d);
    } catch (const std::exception& e) {
      return refuse(s, fmt::format("unreadable hello ({})", e.what()));
    }
    if (st == detail::RecvStatus::closed) return refuse(s, "closed the connection without a hello");
    if (st == detail::RecvStatus::would_block) return refuse(s, "no hello");
    detail::HubProtocol::Admission a = protocol_.admit(d, s.cred.pid);
    if (a.rank < 0) return refuse(s, a.refusal);
    if (!detail::try_send_datagram(s.sock.get(), detail::encode_frame(MessageType::welcome, {}))) {
      log::warn("group hub at '{}': rank {} vanished while joining", path_, a.rank);
      deliver(protocol_.leave(a.rank));
      return;
    }
    log::debug("group hub at '{}': rank {} joined (pid {})", path_, a.rank, s.cred.pid);
    ranks_[static_cast<std::size_t>(a.rank)] = std::move(s.sock);
  }

  // The datagrams a rank has sent, as many as are there (a bounded number per round, so one
  // busy rank cannot starve the others).
  void serve(int rank) {
    detail::Deliveries out;
    try {
      for (int k = 0; k < datagrams_per_round; ++k) {
        auto& sock = ranks_[static_cast<std::size_t>(rank)];
        if (!sock) return;
        detail::Datagram d;
        detail::RecvStatus st =
            detail::recv_datagram(sock.get(), sizeof(detail::FrameHeader) + detail::frame_data_limit, d);
        if (st == detail::RecvStatus::would_block) break;
        if (st == detail::RecvStatus::closed) throw error("the connection closed");
        detail::Deliveries more = protocol_.receive(rank, std::move(d));
        for (auto& m : more) out.push_back(std::move(m));
      }
      auto& deadline = rank_deadlines_[static_cast<std::size_t>(rank)];
      if (!protocol_.mid_message(rank))
        deadline.reset();
      else if (!deadline)
        deadline = clock_type::now() + continuation_wait;
    } catch (const std::exception& e) {
      // End of stream is how a rank leaves; anything else is a broken peer. Either way it is out.
      log::debug("group hub at '{}': rank {} disconnected: {}", path_, rank, e.what());
      drop(rank, out);
    }
    deliver(std::move(out));
  }

  // A rank that started a message and stopped sending it is stuck or hostile: it leaves.
  void drop_stalled_ranks() {
    const auto now = clock_type::now();
    for (int r = 0; r < size(); ++r) {
      auto& d = rank_deadlines_[static_cast<std::size_t>(r)];
      if (!d || now < *d) continue;
      log::warn("group hub at '{}': rank {} sent part of a message and nothing more for {} s; it leaves the group",
                path_, r, std::chrono::duration_cast<std::chrono::seconds>(continuation_wait).count());
      detail::Deliveries out;
      drop(r, out);
      deliver(std::move(out));
    }
  }

  void drop(int rank, detail::Deliveries& out) {
    ranks_[static_cast<std::size_t>(rank)].reset();
    rank_deadlines_[static_cast<std::size_t>(rank)].reset();
    for (auto& d : protocol_.leave(rank)) out.push_back(std::move(d));
  }

  void deliver(detail::Deliveries out) {
    while (!out.empty()) {
      detail::Deliveries next;
      for (auto& [rank, reply] : out) {
        auto& sock = ranks_[static_cast<std::size_t>(rank)];
        if (!sock) continue;
        try {
          detail::EncodedReply e = detail::encode_reply(reply);
          detail::send_message(sock.get(), MessageType::reply, as_bytes(e.body), e.fds);
        } catch (const std::exception& e) {
          log::warn("group hub at '{}': rank {} cannot be reached ({}); it leaves the group", path_, rank, e.what());
          drop(rank, next);
        }
      }
      out = std::move(next);
    }
  }

  static constexpr std::size_t max_strangers = 64;
  static constexpr int accept_batch = 16;
  static constexpr int datagrams_per_round = 256;
  static constexpr auto continuation_wait = std::chrono::seconds(5);

  std::string path_;
  std::string dir_;
  detail::HubProtocol protocol_;
  UniqueFd lock_;
  bool bound_ = false;
  UniqueFd listen_;
  UniqueFd wake_;
  std::deque<Stranger> strangers_;  // oldest first
  std::vector<UniqueFd> ranks_;     // by rank; empty until joined, again after leaving
  std::vector<std::optional<clock_type::time_point>> rank_deadlines_;  // set while a message is half received
  std::atomic<std::size_t> refused_{0};
  std::thread thread_;  // last: starts after everything above exists
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Rendezvous

namespace {

constexpr std::string_view rendezvous_prefix = "torpor-group-";

// The start time of a process (clock ticks since boot, /proc/PID/stat field 22): with the pid
// it names one process, even after the pid is reused.
std::optional<unsigned long long> process_start_time(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!f || !std::getline(f, line)) return std::nullopt;
  auto paren = line.rfind(')');
  if (paren == std::string::npos) return std::nullopt;
  std::istringstream rest(line.substr(paren + 1));
  std::string field;
  for (int i = 3; i <= 22; ++i)
    if (!(rest >> field)) return std::nullopt;
  try {
    return std::stoull(field);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

std::string owner_text() {
  auto start = process_start_time(::getpid());
  return fmt::format("{} {}\n", ::getpid(), start ? *start : 0ULL);
}

// Whether the process recorded in an owner file ("pid start") is gone; false when unsure.
bool owner_dead(int dir) {
  UniqueFd f(::openat(dir, owner_name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
  if (!f) return false;
  char buf[64] = {};
  ssize_t n = ::read(f.get(), buf, sizeof buf - 1);
  if (n <= 0) return false;
  // "pid start" (owner_text()); anything else is not ours to judge.
  const char* end = buf + n;
  long long pid = 0;
  unsigned long long start = 0;
  auto [after_pid, pid_error] = std::from_chars(buf, end, pid);
  if (pid_error != std::errc() || pid <= 0 || after_pid == end || *after_pid != ' ') return false;
  if (std::from_chars(after_pid + 1, end, start).ec != std::errc()) return false;
  if (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return true;
  auto now = process_start_time(static_cast<pid_t>(pid));
  return now && start != 0 && *now != start;  // the pid belongs to another process now
}

// Removes base/name when it is a rendezvous of a crashed run: a directory of this user, mode
// 0700, whose creator is dead and whose lock no hub holds. Only the files torpor puts there
// are removed; a directory holding anything else stays.
void remove_if_stale(int base, const char* name) {
  struct stat st {};
  if (::fstatat(base, name, &st, AT_SYMLINK_NOFOLLOW) != 0) return;
  if (!S_ISDIR(st.st_mode) || st.st_uid != ::geteuid() || (st.st_mode & 0077) != 0) return;
  UniqueFd dir(::openat(base, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!dir || !owner_dead(dir.get())) return;
  UniqueFd lock(::openat(dir.get(), lock_name, O_RDWR | O_NOFOLLOW | O_CLOEXEC));
  if (lock && ::flock(lock.get(), LOCK_EX | LOCK_NB) != 0) return;  // a hub still serves it
  for (const char* f : {"group.sock", lock_name, owner_name}) ::unlinkat(dir.get(), f, 0);
  if (::unlinkat(base, name, AT_REMOVEDIR) == 0)
    log::info("removed the rendezvous directory '{}' of a run that ended without cleaning up", name);
}

void remove_stale_rendezvous(const std::string& base) noexcept {
  DIR* d = ::opendir(base.c_str());
  if (d == nullptr) return;
  std::vector<std::string> names;
  while (dirent* e = ::readdir(d))
    if (std::string_view(e->d_name).starts_with(rendezvous_prefix)) names.emplace_back(e->d_name);
  for (const auto& n : names) remove_if_stale(::dirfd(d), n.c_str());
  ::closedir(d);
}

}  // namespace

Rendezvous Rendezvous::create() {
  std::string base = options::tmpdir();
  remove_stale_rendezvous(base);
  std::string templ = base + "/" + std::string(rendezvous_prefix) + "XXXXXX";
  std::vector<char> buf(templ.begin(), templ.end());
  buf.push_back('\0');
  if (::mkdtemp(buf.data()) == nullptr)
    throw error(
        fmt::format("could not create a private rendezvous directory under '{}': {} (set TMPDIR)", base, errno_text()));
  Rendezvous rv;
  rv.directory = buf.data();
  try {
    (void)socket_address(rv.socket_path());  // fail now, not in every rank, when the path is too long
    const std::string owner = owner_text();
    UniqueFd f(::open((rv.directory + "/" + owner_name).c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
    if (!f || ::write(f.get(), owner.data(), owner.size()) != static_cast<ssize_t>(owner.size()))
      throw error(
          fmt::format("could not write the owner of the rendezvous directory '{}': {}", rv.directory, errno_text()));
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
  } catch (...) {
    rv.remove();
    throw;
  }
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
  ::unlink((directory + "/" + lock_name).c_str());
  ::unlink((directory + "/" + owner_name).c_str());
  ::rmdir(directory.c_str());
}

// ---------------------------------------------------------------------------------------------
// The rank's side

struct UnixSocketGroup::Impl final : detail::HubClientGroup {
  Impl(const Rendezvous& rv, int rank, int size, const GroupOptions& options)
      : HubClientGroup(rank, size, options), rendezvous_(rv) {
    (void)Rendezvous::parse(rv.to_string());  // validates the secret's form
    if (rank == 0) server_ = std::make_unique<HubServer>(rv, size);
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

  void send(MessageType t, const std::vector<std::byte>& body, std::span<const int> fds = {}) {
    try {
      detail::send_message(sock_.get(), t, as_bytes(body), fds);
    } catch (const std::exception& e) {
      throw invalid_state(fmt::format("{}: lost the rendezvous hosted by rank 0 ({}); rank 0 exited or destroyed its "
                                      "group; build a new group",
                                      who(), e.what()));
    }
  }

  void post_contribution(std::uint64_t g, std::uint64_t s, detail::CollectiveKind k, detail::Part p) override {
    std::vector<int> fds;
    fds.reserve(p.fds.size());
    for (auto& f : p.fds) fds.push_back(f.get());
    // the kernel duplicates the descriptors into the hub's process
    send(MessageType::contribute, detail::encode_contribution(g, s, k, p.bytes), fds);
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
      m = detail::recv_message(sock_.get(), deadline);
    } catch (const std::exception& e) {
      throw invalid_state(fmt::format("{}: lost the rendezvous hosted by rank 0 ({}); rank 0 exited or destroyed its "
                                      "group; build a new group",
                                      who(), e.what()));
    }
    if (!m) return std::nullopt;
    if (m->type != MessageType::reply) throw error(fmt::format("{}: unexpected message from the rendezvous", who()));
    return detail::decode_reply(*m);
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
