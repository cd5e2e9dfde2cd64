// The in-process group (make_thread_group): ranks are threads of one process. One Hub behind a
// mutex, a mailbox per rank; each rank is a HubClientGroup (group_client.hpp) whose requests are
// Hub calls and whose replies come from its mailbox. Nothing leaves the process.
#include <fmt/core.h>

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>

#include "ranks/groups/hub/group_client.hpp"
#include "ranks/groups/hub/group_hub.hpp"
#include "torpor/group.hpp"

namespace torpor {

namespace detail {

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
