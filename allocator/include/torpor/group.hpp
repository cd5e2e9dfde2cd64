// Group: the ranks that share symmetric memory, and the few collectives the symmetric layer
// needs: all-gather of bytes, all-gather of file descriptors, barrier.
//
// Implementations:
//   - make_thread_group(n): ranks are threads of one process (one device each).
//   - UnixSocketGroup: ranks are processes of one node (the vLLM layout, one process per GPU);
//     they meet at a Unix socket in a private 0700 directory, rank 0 hosts it. Only processes
//     of the same user (SO_PEERCRED) that present the group's random secret get in; a refused
//     connection is logged and does not disturb the group. File descriptors travel with
//     SCM_RIGHTS.
//   - NcclGroup (nccl_group.hpp): bytes over NCCL (fabric handles across nodes); fds over a
//     node-local bootstrap group, since fds cannot travel over NCCL.
//   - TcpGroup (tcp_group.hpp): ranks that share no Unix socket (several nodes) meet over TCP;
//     bytes only (carries_fds() is false), so a symmetric heap over it shares fabric handles.
//
// Every collective waits at most timeout() (GroupOptions, default TORPOR_GROUP_TIMEOUT_MS or
// 60 s), then asks the rendezvous to give the collective up (it answers at once; should it not,
// the wait ends after a second, bounded wait). A rank that does not arrive in time makes every waiting
// rank throw group_timeout
// (a timeout_error) naming the rank(s) that did not arrive; a rank that arrives after the others
// gave up gets the same error at once, not a hang. Collectives are matched by order: every rank
// must call the same collectives in the same order (a barrier on one rank against an all_gather
// on another is an invalid_state naming both).
//
// Recovery after a failed collective (timeout, mismatch, a rank that arrived late): the group is
// "broken" on every rank that saw the failure, and every collective there throws invalid_state
// until recover(). recover() must be called on every rank, the late or missing rank included
// (the application's control plane tells it, as it told it to sleep); it is itself a collective
// with the same timeout. It discards every half-finished collective and resets the order, after
// which the group is as new. A failed recover() can be repeated. A rank whose process exited
// cannot rejoin: every rank waiting in (or later calling) a collective gets group_rank_left
// naming it, at once; build a new group.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "torpor/error.hpp"

namespace torpor {

// An owned file descriptor (closed on destruction).
class UniqueFd {
 public:
  UniqueFd() noexcept = default;
  explicit UniqueFd(int fd) noexcept : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept {
    if (this != &o) reset(o.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }
  int get() const noexcept { return fd_; }
  int release() noexcept {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset(int fd = -1) noexcept;
  explicit operator bool() const noexcept { return fd_ >= 0; }
  // A new descriptor for the same open file; throws error when dup fails.
  UniqueFd duplicate() const { return dup_of(fd_); }
  static UniqueFd dup_of(int fd);

 private:
  int fd_ = -1;
};

// A collective ran out of time. missing() lists the ranks that did not arrive (for a late rank:
// the ranks that had already given up are not listed; the message says what happened).
class group_timeout : public timeout_error {
 public:
  group_timeout(const std::string& message, std::vector<int> missing)
      : timeout_error(message), missing_(std::move(missing)) {}
  const std::vector<int>& missing() const noexcept { return missing_; }

 private:
  std::vector<int> missing_;
};

// A rank left the group (its process exited, or it destroyed its Group) while the others needed
// it. ranks() names it; a group with a departed rank cannot be recovered: build a new one.
class group_rank_left : public invalid_state {
 public:
  group_rank_left(const std::string& message, std::vector<int> ranks)
      : invalid_state(message), ranks_(std::move(ranks)) {}
  const std::vector<int>& ranks() const noexcept { return ranks_; }

 private:
  std::vector<int> ranks_;
};

struct GroupOptions {
  // Bound on every wait: 0 = the default (TORPOR_GROUP_TIMEOUT_MS, else 60 s), else 1 ms to
  // 24 h; anything else is an invalid_argument naming that range.
  std::chrono::milliseconds timeout{0};
};

// TORPOR_GROUP_TIMEOUT_MS, or 60 s when unset. Throws invalid_argument on a malformed value
// or one outside [1, 86400000] ms (24 h).
std::chrono::milliseconds default_group_timeout();
// The longest timeout a group accepts (24 h: no deadline arithmetic can overflow).
inline constexpr std::chrono::milliseconds max_group_timeout{std::int64_t{24} * 60 * 60 * 1000};
// "[1, 3]" for messages.
std::string format_ranks(const std::vector<int>& ranks);

class Group {
 public:
  virtual ~Group() = default;

  virtual int rank() const noexcept = 0;
  virtual int size() const noexcept = 0;
  // "threads", "unix", "nccl", "torch" or "tcp".
  virtual std::string_view kind() const noexcept = 0;
  // Whether all_gather_fds works: false for a group whose ranks share no Unix socket (TcpGroup),
  // where memory must travel as fabric handles (bytes). Groups that bootstrap a node-local Unix
  // subgroup for descriptors say true: they work within one node.
  virtual bool carries_fds() const noexcept { return true; }

  // Every rank contributes `mine` (any length); the result holds every rank's bytes, indexed
  // by rank, own included.
  virtual std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> mine) = 0;
  // Every rank contributes zero or more fds (they stay owned by the caller); the result holds,
  // for every rank, new descriptors owned by the caller for the same open files (own included).
  virtual std::vector<std::vector<UniqueFd>> all_gather_fds(std::span<const int> mine) = 0;
  virtual void barrier() = 0;
  // See the recovery note at the top of this header.
  virtual void recover() = 0;

  std::chrono::milliseconds timeout() const noexcept { return timeout_; }

 protected:
  explicit Group(const GroupOptions& options);
  std::chrono::milliseconds timeout_;
};

// `size` ranks in this process, one Group per rank (hand each to its thread). They share one
// in-process rendezvous; nothing leaves the process.
std::vector<std::unique_ptr<Group>> make_thread_group(int size, const GroupOptions& options = {});

// Where the ranks of a UnixSocketGroup meet: a private directory holding the socket, and the
// secret every member presents.
struct Rendezvous {
  std::string directory;
  std::string secret;  // 64 hex digits (32 random bytes)

  // A new private directory (mode 0700, under $TMPDIR or /tmp) and a fresh secret.
  static Rendezvous create();
  // "<directory>#<secret>", the form TORPOR_GROUP_RENDEZVOUS holds; parse() reverses it.
  std::string to_string() const;
  static Rendezvous parse(std::string_view text);
  std::string socket_path() const { return directory + "/group.sock"; }
  // Removes the socket and the directory (best effort, for a launcher cleaning up).
  void remove() const noexcept;
};

// Ranks in separate processes of one node. Rank 0 hosts the rendezvous (a thread serving the
// socket); every rank, rank 0 included, connects to it. The constructor returns once every rank
// has joined (or throws group_timeout naming the ranks that never came). Destroy the group only
// after a final barrier: the others see rank 0's departure as an error.
class UnixSocketGroup final : public Group {
 public:
  UnixSocketGroup(const Rendezvous& rendezvous, int rank, int size, const GroupOptions& options = {});
  ~UnixSocketGroup() override;
  UnixSocketGroup(const UnixSocketGroup&) = delete;
  UnixSocketGroup& operator=(const UnixSocketGroup&) = delete;

  int rank() const noexcept override;
  int size() const noexcept override;
  std::string_view kind() const noexcept override { return "unix"; }
  std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> mine) override;
  std::vector<std::vector<UniqueFd>> all_gather_fds(std::span<const int> mine) override;
  void barrier() override;
  void recover() override;

  // Rank 0 only: connections refused so far (wrong user, wrong secret, bad rank, ...).
  std::size_t refused_connections() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// A UnixSocketGroup from the environment: TORPOR_GROUP_RENDEZVOUS (Rendezvous::to_string()),
// TORPOR_RANK and TORPOR_WORLD_SIZE. Throws invalid_argument naming a missing variable.
std::unique_ptr<Group> unix_group_from_env(const GroupOptions& options = {});

}  // namespace torpor
