// HostAsyncEngine: the asynchronous mode of HostDriver (HostDriverOptions::async). Device work
// (copies, fills, hashes, host "kernels", event records, waits on events) is queued per stream
// and done later by one worker thread per stream, in the order it was queued, each operation
// after a random delay drawn from the stream's generator (seeded from the driver's seed and the
// stream's id, so a run can be repeated). Events and synchronisation are real: an event completes
// when the work queued before its record did; stream_synchronize, device_synchronize and
// event_synchronize block until then; a wait on an event holds back the stream's later work.
//
// This is what makes ordering bugs (unmapping memory a queued copy still reads, reading bytes a
// queued copy has not written yet) fail on a CPU machine. HostDriver keeps the memory side: it
// registers the ranges each queued operation touches and refuses to unmap or free them while the
// operation is pending (in_flight.cpp); the engine knows only streams, events and work.
//
// Invariants (under mu_):
//   - a stream's operations run one at a time on its worker, in submission order; completed
//     counts them, so "ticket t done" is completed >= t;
//   - an event's completed generation never passes its recorded generation, and a wait or
//     synchronize snapshots the recorded generation when it is called (CUDA's semantics: work
//     recorded later is not waited for);
//   - work runs without mu_ held, so it may take HostDriver's lock; nothing holds HostDriver's
//     lock while it calls into the engine;
//   - destroying a stream or the engine drains the queued work first, then joins the worker.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>

namespace torpor {

class HostAsyncEngine {
 public:
  HostAsyncEngine(std::uint64_t seed, std::chrono::microseconds max_delay);
  ~HostAsyncEngine();
  HostAsyncEngine(const HostAsyncEngine&) = delete;
  HostAsyncEngine& operator=(const HostAsyncEngine&) = delete;

  // `id`: a stream's id (add_stream, remove_stream, submit, wait, synchronize_stream) or an
  // event's (add_event, remove_event).
  void add_stream(std::uint64_t id, int device);
  // Drains the stream's queued work, then stops its worker.
  void remove_stream(std::uint64_t id);
  // Queues `work` on the stream after an extra pause of `pause` (beyond the random delay).
  // Returns its ticket for wait().
  std::uint64_t submit(std::uint64_t id, std::function<void()> work,
                       std::chrono::microseconds pause = std::chrono::microseconds{0});
  void wait(std::uint64_t id, std::uint64_t ticket);
  void synchronize_stream(std::uint64_t id);
  void synchronize_device(int device);

  void add_event(std::uint64_t id);
  void remove_event(std::uint64_t id);
  void record(std::uint64_t event, std::uint64_t stream);
  void stream_wait_event(std::uint64_t stream, std::uint64_t event);
  void synchronize_event(std::uint64_t event);

  // Operations queued and not yet completed, over every stream.
  std::size_t pending() const;

 private:
  struct Op {
    std::function<void()> work;
    std::chrono::microseconds delay{0};
  };
  struct StreamState {
    StreamState(int on_device, std::uint64_t seed) : device(on_device), rng(seed) {}
    int device = 0;
    std::deque<Op> queue;
    std::uint64_t submitted = 0;
    std::uint64_t completed = 0;
    bool stop = false;
    std::mt19937_64 rng;
    std::condition_variable has_work;
    std::thread worker;
  };
  struct EventState {
    std::uint64_t recorded = 0;
    std::uint64_t completed = 0;
  };

  void run_worker(StreamState& st);
  std::chrono::microseconds draw_delay(StreamState& st);
  StreamState& stream(std::uint64_t id);                // caller holds mu_
  std::shared_ptr<EventState> event(std::uint64_t id);  // caller holds mu_
  void wait_done(std::unique_lock<std::mutex>& lock, const StreamState& st, std::uint64_t ticket);

  std::uint64_t seed_;
  std::chrono::microseconds max_delay_;
  mutable std::mutex mu_;
  std::condition_variable done_;  // a completion or an event's progress
  std::unordered_map<std::uint64_t, std::unique_ptr<StreamState>> streams_;
  std::unordered_map<std::uint64_t, std::shared_ptr<EventState>> events_;
};

}  // namespace torpor
