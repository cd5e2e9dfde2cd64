// Group basics and the in-process (threads) group. See group.hpp for the contract and
// group_client.hpp / group_hub.hpp for the shared machinery.
#include "torpor/group.hpp"

#include <fcntl.h>
#include <fmt/core.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>

#include "common/options.hpp"
#include "ranks/groups/hub/group_client.hpp"
#include "torpor/log.hpp"

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
// HubClientGroup

HubClientGroup::HubClientGroup(int rank, int size, const GroupOptions& options)
    : Group(options), rank_(rank), size_(size) {
  if (size < 1) throw invalid_argument(fmt::format("group size {} must be at least 1", size));
  if (rank < 0 || rank >= size)
    throw invalid_argument(fmt::format("group rank {} is outside [0, {}) (size {})", rank, size, size));
}

std::string HubClientGroup::who() const { return fmt::format("group rank {} of {} ({})", rank_, size_, kind()); }

void HubClientGroup::raise(const Received& r) {
  std::string text = fmt::format("{}: {}", who(), r.message);
  switch (r.reason) {
    case FailReason::timeout:
    case FailReason::late:
      throw group_timeout(text + "; every rank must call recover() before the group is used again", r.missing);
    case FailReason::mismatch: throw invalid_state(text + "; then call recover() on every rank");
    case FailReason::left: throw group_rank_left(text, r.missing);
    case FailReason::recovery:
    case FailReason::stale: throw invalid_state(text);
  }
  throw invalid_state(text);
}

std::optional<Received> HubClientGroup::reply_or_give_up(Wait& wait, const std::function<void()>& give_up) {
  for (;;) {
    if (std::optional<Received> r = next_reply(wait.deadline)) return r;
    if (wait.gave_up) return std::nullopt;
    wait.gave_up = true;
    give_up();
    wait.deadline = clock::now() + give_up_grace();
  }
}

std::vector<Part> HubClientGroup::exchange(CollectiveKind kind, Part part) {
  if (broken_)
    throw invalid_state(fmt::format("{}: the group is unusable after a failed collective ({}); call recover() on "
                                    "every rank",
                                    who(), *broken_));
  const std::uint64_t seq = ++seq_;
  const auto start = clock::now();
  post_contribution(gen_, seq, kind, std::move(part));
  Wait wait{start + timeout_};
  for (;;) {
    std::optional<Received> r = reply_or_give_up(wait, [&] {
      post_give_up(gen_, seq, std::chrono::duration<double>(clock::now() - start).count());
    });
    if (!r) {
      broken_ = "the rendezvous did not answer";
      throw group_timeout(fmt::format("{}: collective #{} ({}) timed out and the rendezvous (hosted by rank 0) did not "
                                      "answer within {} ms",
                                      who(), seq, to_string(kind), give_up_grace().count()),
                          {0});
    }
    if (r->type != ReplyType::result && r->type != ReplyType::failed) continue;  // recovery leftovers
    if (r->generation != gen_ || r->sequence != seq) continue;                   // stale
    if (r->type == ReplyType::result) {
      if (r->parts.size() != static_cast<std::size_t>(size_))
        throw error(
            fmt::format("{}: collective #{} returned {} parts for {} ranks", who(), seq, r->parts.size(), size_));
      return std::move(r->parts);
    }
    broken_ = r->message;
    raise(*r);
  }
}

std::vector<std::vector<std::byte>> HubClientGroup::all_gather(std::span<const std::byte> mine) {
  Part p;
  p.bytes.assign(mine.begin(), mine.end());
  std::vector<Part> parts = exchange(CollectiveKind::all_gather, std::move(p));
  std::vector<std::vector<std::byte>> out;
  out.reserve(parts.size());
  for (auto& part : parts) out.push_back(std::move(part.bytes));
  return out;
}

std::vector<std::vector<UniqueFd>> HubClientGroup::all_gather_fds(std::span<const int> mine) {
  Part p;
  for (int fd : mine) {
    if (fd < 0) throw invalid_argument(fmt::format("{}: all_gather_fds given an invalid descriptor {}", who(), fd));
    p.fds.push_back(UniqueFd::dup_of(fd));  // the caller keeps its own descriptor
  }
  std::vector<Part> parts = exchange(CollectiveKind::all_gather_fds, std::move(p));
  std::vector<std::vector<UniqueFd>> out;
  out.reserve(parts.size());
  for (auto& part : parts) out.push_back(std::move(part.fds));
  return out;
}

void HubClientGroup::barrier() { exchange(CollectiveKind::barrier, Part{}); }

void HubClientGroup::recover() {
  post_recover(gen_);
  Wait wait{clock::now() + timeout_};
  for (;;) {
    std::optional<Received> r = reply_or_give_up(wait, [&] { post_give_up_recovery(gen_); });
    if (!r) {
      throw group_timeout(fmt::format("{}: recover() got no answer from the rendezvous (hosted by rank 0) within {} ms",
                                      who(), (timeout_ + give_up_grace()).count()),
                          {0});
    }
    if (r->type == ReplyType::recovered && r->generation > gen_) {  // older ones are leftovers
      gen_ = r->generation;
      seq_ = 0;
      broken_.reset();
      log::info("{}: recovered, generation {}", who(), gen_);
      return;
    }
    if (r->type == ReplyType::recover_pending && r->generation == gen_)
      throw group_timeout(fmt::format("{}: recover() timed out after {} ms: rank(s) {} have not called recover()",
                                      who(), timeout_.count(), format_ranks(r->missing)),
                          r->missing);
    if (r->type == ReplyType::failed && r->sequence == 0) raise(*r);  // recovery itself failed (a rank left)
    // Anything else is a leftover of the old generation.
  }
}

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
