// The offload pipeline of a sleep: the calling thread issues each planned chunk's copies (its
// pieces, device -> host store) on copy_streams streams in rotation and records the chunk's
// event behind them; release_threads workers wait for each chunk's event, then unmap and
// release it (Chunk::unmap_and_release) while the copies of later chunks still run. Copies
// go to the host span's tier (host_copies.hpp): a pinned span once its block is page-locked
// (pinning runs in the background, ahead of the copies), pageable and spilled spans through
// the staging ring. Releasing costs a driver call per chunk that grows with its size, so a few
// workers overlap them.
//
// Invariants:
//   - a chunk is unmapped only after its own copies completed (its event), and its pieces'
//     host copies are sampled (HostCopy) in between, by the worker that releases it;
//   - chunks are issued in plan order; an issue failure stops issuing at a chunk boundary and a
//     worker failure stops both issuing and unmapping (the other workers drain the queue);
//   - released(k) is true exactly for the chunks whose memory is gone (released, or deferred in
//     ChunkMemory), and only those may be marked asleep; every other chunk is still mapped
//     with its handle;
//   - the report's copy counters are written by the issuing thread alone;
//   - a chunk with nothing to copy (every piece unchanged, or none survives the level) records
//     no event and its worker waits for none: no device work of the sleep touches it (the hash
//     of its pieces returned before the pipeline starts), so an unchanged or level-2 sleep costs
//     no event call per chunk.
#pragma once

#include <atomic>
#include <cstddef>
#include <exception>
#include <mutex>
#include <vector>

#include "pool/index_queue.hpp"
#include "pool/sleep_plan.hpp"

namespace torpor {

class OffloadPipeline {
 public:
  OffloadPipeline(Pool::State& s, SleepPlan& plan, TransitionReport& r)
      : s_(s), plan_(plan), r_(r), released_(plan.chunks.size(), 0), recorded_(plan.chunks.size(), 0) {}

  // Runs to the end or to the first failure, which error() then holds; returns after every
  // worker joined. Records the "offload_and_release" phase when nothing failed.
  void run();

  bool released(std::size_t k) const noexcept { return released_[k] != 0; }
  // The issue failure first, else the first worker failure; null when nothing failed.
  std::exception_ptr error() const noexcept { return issue_error_ ? issue_error_ : worker_error_; }

 private:
  void issue(std::size_t k, Stream stream);  // chunk k's copies and event
  void release_loop();                       // a worker
  void sample_copies(std::size_t k);         // chunk k's copies landed: take their samples

  Pool::State& s_;
  SleepPlan& plan_;
  TransitionReport& r_;
  IndexQueue issued_;
  std::vector<char> released_;  // written by the worker that released chunk k, read after join
  std::vector<char> recorded_;  // chunk k's event was recorded (written before k is queued)
  std::exception_ptr issue_error_;
  std::mutex worker_mu_;  // guards worker_error_
  std::exception_ptr worker_error_;
  std::atomic<bool> worker_failed_{false};
};

}  // namespace torpor
