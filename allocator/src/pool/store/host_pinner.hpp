// HostPinner: page-locks host memory in the background, the fast way.
//
// cuMemHostAlloc is far slower than the copies the host store backs, whatever the thread count.
// Anonymous memory advised for transparent huge pages, first touched by several threads, then
// registered (Driver::host_register), is page-locked an order of magnitude faster (DESIGN.md's
// performance table). The host store maps a block, advises it and submits it here; workers touch
// the blocks' slices in submission order, and the worker that touches a block's last slice
// registers it. So block k is registered while the workers touch block k + 1, and a sleep copies
// into block k while block k + 1 is touched and registered (sleep_plan.hpp, host_pin_overlap).
//
// Invariants:
//   - a PinJob's status goes pending -> ready (registered) | refused (registration failed: the
//     memory is touched ordinary pageable memory) | cancelled (never registered), and never
//     changes after leaving pending; wait() returns only once it left pending;
//   - nothing touches or registers a job's memory after it left pending, so its owner may unmap
//     it then (after host_unregister when ready);
//   - worker threads exist only while there is work (at most `threads`); the destructor cancels
//     whatever is still queued and joins them;
//   - in a forked child the parent's workers do not exist: the child's copy forgets them at the
//     fork (their std::thread objects are leaked, never joined: joining a thread of another
//     process fails) and starts its own. A fork waits for no worker to hold the pinner's mutex
//     (pthread_atfork). Slices a parent worker was touching at the fork are lost with it, so a
//     job they belong to never settles in the child: fork only when no pinning is in flight.
// Thread-safe.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "torpor/driver.hpp"

namespace torpor {

class PinJob {
 public:
  enum class Status : int { pending, ready, refused, cancelled };

  PinJob(std::byte* base, std::size_t bytes) : base_(base), bytes_(bytes) {}
  std::byte* base() const noexcept { return base_; }
  std::size_t bytes() const noexcept { return bytes_; }
  Status status() const noexcept { return static_cast<Status>(status_.load(std::memory_order_acquire)); }
  bool settled() const noexcept { return status() != Status::pending; }
  // Why registration was refused (set before the status leaves pending).
  const std::string& refusal() const noexcept { return refusal_; }

 private:
  friend class HostPinner;
  std::byte* base_;
  std::size_t bytes_;
  std::atomic<int> status_{static_cast<int>(Status::pending)};
  std::atomic<bool> cancel_{false};
  std::atomic<std::size_t> slices_left_{0};
  std::string refusal_;
};

class HostPinner {
 public:
  static constexpr std::size_t slice_bytes = std::size_t{16} << 20;

  // threads 0 = min(16, hardware threads). `device` is the context registration runs in.
  HostPinner(Driver& driver, int device, int threads);
  ~HostPinner();
  HostPinner(const HostPinner&) = delete;
  HostPinner& operator=(const HostPinner&) = delete;

  // Queue [base, base + bytes) (page-aligned, a multiple of the page size, mapped read-write and
  // never touched by anyone else until the job settles) to be first-touched and registered.
  std::shared_ptr<PinJob> submit(std::byte* base, std::size_t bytes);
  // Blocks until the job left pending; returns its final status.
  PinJob::Status wait(const PinJob& job);
  // The job settles soon: as cancelled unless its registration already started.
  static void cancel(PinJob& job) noexcept { job.cancel_ = true; }
  // Blocks until every submitted job settled.
  void wait_all();
  int threads() const noexcept { return threads_; }

 private:
  struct Slice {
    std::shared_ptr<PinJob> job;
    std::size_t offset = 0;
    std::size_t bytes = 0;
  };
  void work(int id);
  void touch(std::byte* p, std::size_t bytes);
  void finish(PinJob& job);
  void settle(PinJob& job, PinJob::Status status);
  void reap_locked();
  void forget_parent_workers_locked();
  // pthread_atfork handlers over every live HostPinner (see host_pinner.cpp).
  static void before_fork() noexcept;
  static void after_fork_in_parent() noexcept;
  static void after_fork_in_child() noexcept;

  Driver& driver_;
  int device_;
  int threads_;
  std::mutex mu_;
  std::condition_variable settled_;
  std::deque<Slice> queue_;
  std::size_t unsettled_ = 0;  // jobs submitted and not settled
  std::map<int, std::thread> workers_;
  std::vector<int> exited_;  // ids of workers that returned, to join
  int running_ = 0;
  int next_id_ = 0;
  pid_t owner_;                             // the process the workers belong to
  std::atomic<bool> populate_works_{true};  // MADV_POPULATE_WRITE accepted so far
};

}  // namespace torpor
