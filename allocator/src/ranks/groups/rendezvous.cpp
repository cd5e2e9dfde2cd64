// Rendezvous: the private directory and secret of a Unix socket group; see rendezvous.hpp.
#include "ranks/groups/rendezvous.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/core.h>
#include <signal.h>  // NOLINT(modernize-deprecated-headers): kill() is POSIX, not in <csignal>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <vector>

#include "common/options.hpp"
#include "torpor/group.hpp"
#include "torpor/log.hpp"

namespace torpor {

namespace {

std::string errno_text() { return std::strerror(errno); }

}  // namespace

namespace detail {

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

}  // namespace detail

using detail::rendezvous_lock_name;
using detail::rendezvous_owner_name;
using detail::socket_address;

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
  UniqueFd f(::openat(dir, rendezvous_owner_name, O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
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
  UniqueFd lock(::openat(dir.get(), rendezvous_lock_name, O_RDWR | O_NOFOLLOW | O_CLOEXEC));
  if (lock && ::flock(lock.get(), LOCK_EX | LOCK_NB) != 0) return;  // a hub still serves it
  for (const char* f : {"group.sock", rendezvous_lock_name, rendezvous_owner_name}) ::unlinkat(dir.get(), f, 0);
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
    UniqueFd f(
        ::open((rv.directory + "/" + rendezvous_owner_name).c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
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
  ::unlink((directory + "/" + rendezvous_lock_name).c_str());
  ::unlink((directory + "/" + rendezvous_owner_name).c_str());
  ::rmdir(directory.c_str());
}

}  // namespace torpor
