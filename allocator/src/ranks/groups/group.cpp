// Group basics and the in-process (threads) group. See group.hpp for the contract and
// group_client.hpp / group_hub.hpp for the shared machinery.
#include "torpor/group.hpp"

#include <fcntl.h>
#include <fmt/core.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>

#include "common/options.hpp"
#include "ranks/groups/hub/group_client.hpp"

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

namespace detail {

// ---------------------------------------------------------------------------------------------
// Threads: one Hub behind a mutex, a mailbox per rank.

namespace {

struct ThreadShared {
  explicit ThreadShared(int size) : hub(size), mailboxes(static_cast<std::size_t>(size)) {}
  std::mutex mu;
  std::condition_variable cv;
  Hub hub;
  std::vector<std::deque<Reply>> mailboxes;

  void deliver(Deliveries&& d) {  // caller holds mu
    for (auto& [r, reply] : d) mailboxes[static_cast<std::size_t>(r)].push_back(std::move(reply));
    if (!d.empty()) cv.notify_all();
  }
};

class ThreadGroup final : public HubClientGroup {
 public:
  ThreadGroup(std::shared_ptr<ThreadShared> shared, int rank, int size, const GroupOptions& options)
      : HubClientGroup(rank, size, options), shared_(std::move(shared)) {}
  ~ThreadGroup() override {
    std::lock_guard lock(shared_->mu);
    shared_->deliver(shared_->hub.leave(rank()));
  }
  std::string_view kind() const noexcept override { return "threads"; }

 protected:
  void post_contribution(std::uint64_t g, std::uint64_t s, CollectiveKind k, Part p) override {
    std::lock_guard lock(shared_->mu);
    shared_->deliver(shared_->hub.contribute(rank(), g, s, k, std::move(p)));
  }
  void post_give_up(std::uint64_t g, std::uint64_t s, double waited) override {
    std::lock_guard lock(shared_->mu);
    shared_->deliver(shared_->hub.give_up(rank(), g, s, waited));
  }
  void post_recover(std::uint64_t g) override {
    std::lock_guard lock(shared_->mu);
    shared_->deliver(shared_->hub.recover(rank(), g));
  }
  void post_give_up_recovery(std::uint64_t g) override {
    std::lock_guard lock(shared_->mu);
    shared_->deliver(shared_->hub.give_up_recovery(rank(), g));
  }
  std::optional<Received> next_reply(clock::time_point deadline) override {
    Reply reply;
    {
      std::unique_lock lock(shared_->mu);
      auto& box = shared_->mailboxes[static_cast<std::size_t>(rank())];
      if (!shared_->cv.wait_until(lock, deadline, [&] { return !box.empty(); })) return std::nullopt;
      reply = std::move(box.front());
      box.pop_front();
    }
    Received r;
    r.type = reply.type;
    r.reason = reply.reason;
    r.generation = reply.generation;
    r.sequence = reply.sequence;
    r.missing = std::move(reply.missing);
    r.message = std::move(reply.message);
    if (reply.parts) {
      // Every rank gets its own descriptors, as it would across processes.
      for (const Part& p : *reply.parts) {
        Part mine;
        mine.bytes = p.bytes;
        for (const UniqueFd& fd : p.fds) mine.fds.push_back(fd.duplicate());
        r.parts.push_back(std::move(mine));
      }
    }
    return r;
  }
  // The hub answers a give-up synchronously; no grace needed beyond scheduling.
  std::chrono::milliseconds give_up_grace() const override { return std::chrono::milliseconds(1000); }

 private:
  std::shared_ptr<ThreadShared> shared_;
};

}  // namespace
}  // namespace detail

std::vector<std::unique_ptr<Group>> make_thread_group(int size, const GroupOptions& options) {
  if (size < 1) throw invalid_argument(fmt::format("make_thread_group: size {} must be at least 1", size));
  auto shared = std::make_shared<detail::ThreadShared>(size);
  std::vector<std::unique_ptr<Group>> out;
  out.reserve(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) out.push_back(std::make_unique<detail::ThreadGroup>(shared, r, size, options));
  return out;
}

}  // namespace torpor
