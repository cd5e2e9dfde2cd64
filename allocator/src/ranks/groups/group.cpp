// Group basics: UniqueFd, the timeout every group checks, format_ranks. See group.hpp for the
// contract; the groups themselves live beside this file (thread_group.cpp, unix_group.cpp,
// tcp_group.cpp, callback_group.cpp, nccl/) and share the hub in hub/.
#include "torpor/group.hpp"

#include <fcntl.h>
#include <fmt/core.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/options.hpp"

namespace torpor {

void UniqueFd::reset(int fd) noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

UniqueFd UniqueFd::dup_of(int fd) {
  int d = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (d < 0) throw error(fmt::format("dup of file descriptor {} failed: {}", fd, std::strerror(errno)));
  return UniqueFd(d);
}

std::chrono::milliseconds default_group_timeout() { return options::group_timeout(); }

std::string format_ranks(const std::vector<int>& ranks) { return fmt::format("[{}]", fmt::join(ranks, ", ")); }

namespace {

std::chrono::milliseconds checked_timeout(std::chrono::milliseconds t) {
  if (t.count() == 0) return default_group_timeout();
  if (t.count() < 0 || t > max_group_timeout)
    throw invalid_argument(fmt::format("GroupOptions::timeout {} ms is outside [1, {}] ms (0 = the default: "
                                       "TORPOR_GROUP_TIMEOUT_MS, else 60 s)",
                                       t.count(), max_group_timeout.count()));
  return t;
}

}  // namespace

Group::Group(const GroupOptions& options) : timeout_(checked_timeout(options.timeout)) {}

}  // namespace torpor
