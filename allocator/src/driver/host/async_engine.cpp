// HostAsyncEngine; the design note and invariants are in async_engine.hpp.
#include "driver/host/async_engine.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <vector>

#include "torpor/error.hpp"

namespace torpor {

namespace {

constexpr int k_invalid = static_cast<int>(driver_status::invalid_value);

}  // namespace

HostAsyncEngine::HostAsyncEngine(std::uint64_t seed, std::chrono::microseconds max_delay)
    : seed_(seed), max_delay_(max_delay) {}

HostAsyncEngine::~HostAsyncEngine() {
  std::vector<std::uint64_t> ids;
  {
    std::lock_guard lock(mu_);
    for (auto& [id, st] : streams_) ids.push_back(id);
  }
  for (std::uint64_t id : ids) remove_stream(id);
}

HostAsyncEngine::StreamState& HostAsyncEngine::stream(std::uint64_t id) {
  auto it = streams_.find(id);
  if (it == streams_.end()) throw_driver_error(k_invalid, "HostDriver async", fmt::format("unknown stream {}", id));
  return *it->second;
}

std::shared_ptr<HostAsyncEngine::EventState> HostAsyncEngine::event(std::uint64_t id) {
  auto it = events_.find(id);
  if (it == events_.end()) throw_driver_error(k_invalid, "HostDriver async", fmt::format("unknown event {}", id));
  return it->second;
}

void HostAsyncEngine::add_stream(std::uint64_t id, int device) {
  // A generator per stream: the delays of one stream do not depend on how the threads that
  // submit to the others interleave.
  auto st = std::make_unique<StreamState>(device, seed_ ^ (id * 0x9E3779B97F4A7C15ULL));
  StreamState& ref = *st;
  std::lock_guard lock(mu_);
  streams_[id] = std::move(st);
  ref.worker = std::thread([this, &ref] { run_worker(ref); });
}

void HostAsyncEngine::remove_stream(std::uint64_t id) {
  std::unique_ptr<StreamState> st;
  {
    std::unique_lock lock(mu_);
    StreamState& s = stream(id);
    wait_done(lock, s, s.submitted);
    s.stop = true;
    s.has_work.notify_all();
    st = std::move(streams_[id]);
    streams_.erase(id);
  }
  st->worker.join();
}

std::chrono::microseconds HostAsyncEngine::draw_delay(StreamState& st) {
  if (max_delay_.count() <= 0) return std::chrono::microseconds{0};
  std::uint64_t r = st.rng();
  // Half the operations run at once, the others after up to max_delay: both orders of any two
  // operations on different streams happen.
  if ((r & 1) == 0) return std::chrono::microseconds{0};
  return std::chrono::microseconds{
      static_cast<std::int64_t>((r >> 1) % static_cast<std::uint64_t>(max_delay_.count() + 1))};
}

std::uint64_t HostAsyncEngine::submit(std::uint64_t id, std::function<void()> work, std::chrono::microseconds pause) {
  std::lock_guard lock(mu_);
  StreamState& st = stream(id);
  st.queue.push_back(Op{std::move(work), draw_delay(st) + pause});
  st.has_work.notify_one();
  return ++st.submitted;
}

void HostAsyncEngine::run_worker(StreamState& st) {
  std::unique_lock lock(mu_);
  for (;;) {
    st.has_work.wait(lock, [&] { return st.stop || !st.queue.empty(); });
    if (st.queue.empty()) return;  // stopped, and drained
    Op op = std::move(st.queue.front());
    st.queue.pop_front();
    lock.unlock();
    if (op.delay.count() > 0) std::this_thread::sleep_for(op.delay);
    op.work();  // never throws: HostDriver validates everything when the work is queued
    lock.lock();
    ++st.completed;
    done_.notify_all();
  }
}

void HostAsyncEngine::wait_done(std::unique_lock<std::mutex>& lock, const StreamState& st, std::uint64_t ticket) {
  done_.wait(lock, [&] { return st.completed >= ticket; });
}

void HostAsyncEngine::wait(std::uint64_t id, std::uint64_t ticket) {
  std::unique_lock lock(mu_);
  wait_done(lock, stream(id), ticket);
}

void HostAsyncEngine::synchronize_stream(std::uint64_t id) {
  std::unique_lock lock(mu_);
  StreamState& st = stream(id);
  wait_done(lock, st, st.submitted);
}

void HostAsyncEngine::synchronize_device(int device) {
  std::unique_lock lock(mu_);
  // Snapshot the tickets first: work queued after this call is not waited for.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> targets;
  for (auto& [id, st] : streams_)
    if (st->device == device) targets.emplace_back(id, st->submitted);
  for (const auto& target : targets) {
    const std::uint64_t id = target.first, ticket = target.second;
    auto it = streams_.find(id);
    if (it == streams_.end()) continue;  // destroyed meanwhile: it drained first
    const StreamState* st = it->second.get();
    done_.wait(lock, [&] { return !streams_.count(id) || st->completed >= ticket; });
  }
}

void HostAsyncEngine::add_event(std::uint64_t id) {
  std::lock_guard lock(mu_);
  events_[id] = std::make_shared<EventState>();
}

void HostAsyncEngine::remove_event(std::uint64_t id) {
  // As cuEventDestroy: a record still queued completes on its own (it holds the state).
  std::lock_guard lock(mu_);
  events_.erase(id);
}

void HostAsyncEngine::record(std::uint64_t event_id, std::uint64_t stream_id) {
  std::lock_guard lock(mu_);
  std::shared_ptr<EventState> ev = event(event_id);
  StreamState& st = stream(stream_id);
  std::uint64_t generation = ++ev->recorded;
  st.queue.push_back(Op{[this, ev, generation] {
                          std::lock_guard inner(mu_);
                          ev->completed = std::max(ev->completed, generation);
                          done_.notify_all();
                        },
                        draw_delay(st)});
  ++st.submitted;
  st.has_work.notify_one();
}

void HostAsyncEngine::stream_wait_event(std::uint64_t stream_id, std::uint64_t event_id) {
  std::lock_guard lock(mu_);
  std::shared_ptr<EventState> ev = event(event_id);
  StreamState& st = stream(stream_id);
  std::uint64_t target = ev->recorded;  // never recorded: nothing to wait for
  st.queue.push_back(Op{[this, ev, target] {
                          std::unique_lock inner(mu_);
                          done_.wait(inner, [&] { return ev->completed >= target; });
                        },
                        draw_delay(st)});
  ++st.submitted;
  st.has_work.notify_one();
}

void HostAsyncEngine::synchronize_event(std::uint64_t event_id) {
  std::unique_lock lock(mu_);
  std::shared_ptr<EventState> ev = event(event_id);
  std::uint64_t target = ev->recorded;
  done_.wait(lock, [&] { return ev->completed >= target; });
}

std::size_t HostAsyncEngine::pending() const {
  std::lock_guard lock(mu_);
  std::size_t n = 0;
  for (auto& [id, st] : streams_) n += st->submitted - st->completed;
  return n;
}

}  // namespace torpor
