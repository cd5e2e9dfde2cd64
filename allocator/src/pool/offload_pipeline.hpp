// The offload pipeline of a sleep: release_threads workers unmap and release each chunk
// (Chunk::unmap_and_release) as soon as nothing of the sleep still reads it, while the calling
// thread works through the plan. start() queues the chunks with nothing to copy (no piece
// survives the level) before anything else: they need no hash and no host span, so they are
// released while the caller places the host copies and the first chunks are hashed. finish()
// then goes through the other chunks by hash group (sleep_plan.hpp, step 3): hashes the group,
// issues each of its chunks' copies that are not skipped (its pieces, device -> host store) on
// copy_streams streams in rotation, records the chunk's event behind them and queues it; the
// next group is hashed while the copies and releases of the earlier ones run. Copies go to the
// host span's tier (host_copies.hpp): a pinned span once its block is page-locked (pinning runs
// in the background, ahead of the copies), pageable and spilled spans through the staging ring.
// Releasing costs a driver call per chunk that grows with its size, so a few workers overlap
// them.
//
// Invariants:
//   - a chunk is unmapped only after its own copies completed (its event), and its pieces'
//     host copies are sampled (HostCopy) in between, by the worker that releases it;
//   - a chunk with pieces is queued only after its group was hashed and matched, so no hash
//     reads memory a worker may unmap; chunks with pieces are queued in plan order;
//   - a failure (placing the host copies, a hash, an issue) stops queuing at a chunk boundary,
//     and a worker failure stops both queuing and unmapping (the other workers drain the
//     queue);
//   - released(k) is true exactly for the chunks whose memory is gone (released, or deferred in
//     ChunkMemory), and only those may be marked asleep; every other chunk is still mapped
//     with its handle;
//   - the report's copy and hash counters are written by the calling thread alone;
//   - a chunk with nothing to copy (no piece, or every piece unchanged) records no event and
//     its worker waits for none: no device work of the sleep touches it, so an unchanged or
//     level-2 sleep costs no event call per chunk.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "pool/index_queue.hpp"
#include "pool/sleep_plan.hpp"

namespace torpor {

class OffloadPipeline {
 public:
  OffloadPipeline(Pool::State& s, SleepPlan& plan, TransitionReport& r)
      : s_(s), plan_(plan), r_(r), released_(plan.chunks.size(), 0), recorded_(plan.chunks.size(), 0) {}

  // Joins the workers if finish() was not reached. Never throws.
  ~OffloadPipeline();
  OffloadPipeline(const OffloadPipeline&) = delete;
  OffloadPipeline& operator=(const OffloadPipeline&) = delete;

  // Starts the workers and queues the chunks without pieces.
  void start();
  // Hashes, issues and queues the other chunks, to the end or to the first failure, which
  // error() then holds; `placing_failed` (placing the host copies failed, or null) stops it
  // before any of them. Returns after every worker joined. Records the "hash" phase (the sum
  // of the groups' hash calls) and, when nothing failed, "offload_and_release".
  void finish(std::exception_ptr placing_failed);

  bool released(std::size_t k) const noexcept { return released_[k] != 0; }
  // The issue failure first, else the first worker failure; null when nothing failed.
  std::exception_ptr error() const noexcept { return issue_error_ ? issue_error_ : worker_error_; }

 private:
  void issue(std::size_t k, Stream stream);  // chunk k's copies and event
  void issue_groups();                       // finish()'s hash, issue and queue loop
  void join_workers() noexcept;
  void release_loop();                // a worker
  void sample_copies(std::size_t k);  // chunk k's copies landed: take their samples

  Pool::State& s_;
  SleepPlan& plan_;
  TransitionReport& r_;
  std::chrono::steady_clock::time_point started_;
  std::vector<std::thread> workers_;
  IndexQueue issued_;
  std::vector<char> released_;  // written by the worker that released chunk k, read after join
  std::vector<char> recorded_;  // chunk k's event was recorded (written before k is queued)
  std::exception_ptr issue_error_;
  std::mutex worker_mu_;  // guards worker_error_
  std::exception_ptr worker_error_;
  std::atomic<bool> worker_failed_{false};
};

}  // namespace torpor
