// HostPinner; the design note and invariants are in host_pinner.hpp.
#include "pool/store/host_pinner.hpp"

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <exception>
#include <set>

#include "torpor/error.hpp"
#include "torpor/log.hpp"

namespace torpor {

namespace {

// Every live HostPinner, so that a fork never copies one whose mutex a worker holds: the child
// would wait on it forever. pthread_atfork takes every pinner's mutex before the fork and gives
// it back on both sides after it (the child's copy forgets the parent's workers first).
struct Pinners {
  std::mutex mu;
  std::set<HostPinner*> live;
};

Pinners& pinners() {
  static Pinners* p = new Pinners;  // never destroyed: a fork may happen during exit
  return *p;
}

}  // namespace

void HostPinner::before_fork() noexcept {
  Pinners& p = pinners();
  p.mu.lock();
  for (HostPinner* h : p.live) h->mu_.lock();
}

void HostPinner::after_fork_in_parent() noexcept {
  Pinners& p = pinners();
  for (HostPinner* h : p.live) h->mu_.unlock();
  p.mu.unlock();
}

void HostPinner::after_fork_in_child() noexcept {
  Pinners& p = pinners();
  for (HostPinner* h : p.live) {
    h->forget_parent_workers_locked();
    h->mu_.unlock();
  }
  p.mu.unlock();
}

HostPinner::HostPinner(Driver& driver, int device, int threads) : driver_(driver), device_(device), owner_(::getpid()) {
  if (threads <= 0) {
    unsigned hw = std::thread::hardware_concurrency();
    threads = static_cast<int>(std::clamp(hw == 0 ? 4U : hw, 1U, 16U));
  }
  threads_ = threads;
  static const int registered = ::pthread_atfork(&before_fork, &after_fork_in_parent, &after_fork_in_child);
  (void)registered;  // on failure the first call in a child still forgets the parent's workers
  Pinners& p = pinners();
  std::lock_guard lock(p.mu);
  p.live.insert(this);
}

HostPinner::~HostPinner() {
  {
    Pinners& p = pinners();
    std::lock_guard lock(p.mu);
    p.live.erase(this);
  }
  std::unique_lock lock(mu_);
  forget_parent_workers_locked();
  for (Slice& s : queue_) s.job->cancel_ = true;
  settled_.wait(lock, [&] { return running_ == 0; });
  reap_locked();
  for (auto& [id, t] : workers_)
    if (t.joinable()) t.join();
}

std::shared_ptr<PinJob> HostPinner::submit(std::byte* base, std::size_t bytes) {
  if (base == nullptr || bytes == 0) throw error("internal: HostPinner::submit of an empty range");
  auto job = std::make_shared<PinJob>(base, bytes);
  job->slices_left_ = (bytes + slice_bytes - 1) / slice_bytes;
  std::lock_guard lock(mu_);
  reap_locked();
  for (std::size_t off = 0; off < bytes; off += slice_bytes)
    queue_.push_back(Slice{job, off, std::min(slice_bytes, bytes - off)});
  ++unsettled_;
  int wanted = static_cast<int>(std::min<std::size_t>(static_cast<std::size_t>(threads_), queue_.size()));
  while (running_ < wanted) {
    int id = next_id_++;
    ++running_;
    workers_.emplace(id, std::thread([this, id] { work(id); }));
  }
  return job;
}

PinJob::Status HostPinner::wait(const PinJob& job) {
  if (job.settled()) return job.status();
  std::unique_lock lock(mu_);
  settled_.wait(lock, [&] { return job.settled(); });
  return job.status();
}

void HostPinner::wait_all() {
  std::unique_lock lock(mu_);
  settled_.wait(lock, [&] { return unsettled_ == 0; });
}

void HostPinner::forget_parent_workers_locked() {
  if (::getpid() == owner_) return;
  owner_ = ::getpid();
  if (!workers_.empty()) new std::map<int, std::thread>(std::move(workers_));  // leaked on purpose
  workers_.clear();
  exited_.clear();
  running_ = 0;
}

void HostPinner::reap_locked() {
  forget_parent_workers_locked();
  for (int id : exited_) {
    auto it = workers_.find(id);
    if (it == workers_.end()) continue;
    it->second.join();  // it returned from work() right after recording itself
    workers_.erase(it);
  }
  exited_.clear();
}

void HostPinner::work(int id) {
  for (;;) {
    Slice s;
    {
      std::lock_guard lock(mu_);
      if (queue_.empty()) {
        --running_;
        exited_.push_back(id);
        settled_.notify_all();
        return;
      }
      s = std::move(queue_.front());
      queue_.pop_front();
    }
    if (!s.job->cancel_) touch(s.job->base_ + s.offset, s.bytes);
    if (s.job->slices_left_.fetch_sub(1) == 1) finish(*s.job);
  }
}

// First touch: the kernel allocates (huge) pages here, on many threads, instead of inside the
// single-threaded registration.
void HostPinner::touch(std::byte* p, std::size_t bytes) {
#ifdef MADV_POPULATE_WRITE
  if (populate_works_.load(std::memory_order_relaxed)) {
    if (::madvise(p, bytes, MADV_POPULATE_WRITE) == 0) return;
    populate_works_ = false;  // an older kernel: touch page by page from now on
  }
#endif
  static const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  for (std::size_t off = 0; off < bytes; off += page) static_cast<volatile std::byte*>(p)[off] = std::byte{0};
}

void HostPinner::finish(PinJob& job) {
  if (job.cancel_) {
    settle(job, PinJob::Status::cancelled);
    return;
  }
  try {
    driver_.host_register(job.base_, job.bytes_, device_);
  } catch (const std::exception& e) {
    job.refusal_ = e.what();
    settle(job, PinJob::Status::refused);
    return;
  }
  settle(job, PinJob::Status::ready);
}

void HostPinner::settle(PinJob& job, PinJob::Status status) {
  std::lock_guard lock(mu_);
  job.status_.store(static_cast<int>(status), std::memory_order_release);
  --unsettled_;
  settled_.notify_all();
}

}  // namespace torpor
