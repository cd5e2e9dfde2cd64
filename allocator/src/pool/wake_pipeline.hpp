// The wake's plan and pipeline. The plan groups the asleep chunks of the tags into runs of
// VA-contiguous chunks of at most map_group_bytes: one set_access call each; the groups with a
// backup to restore come first (in VA order, then the others in VA order), so their copies run
// while the rest is mapped. The pipeline: a
// map thread creates and maps each group's chunks (Chunk::remap) and sets access once for the
// group; the calling thread enqueues each ready group's restores (host store -> device, pageable
// and spilled backups through the staging ring) and fills (FillOnWake) on the copy streams in rotation while
// the next group is mapped (restores from spilled backups read the spill file into the ring,
// host_copies.hpp). One synchronize at the end of every copy stream this wake queued work on (a
// wake with nothing to restore, the level-2 wake of a cache, synchronizes none).
//
// Invariants:
//   - a group reaches the calling thread only once all its chunks are mapped with access set;
//     a map failure rolls its own group back (Chunk::drop_mapping) and ends the map thread;
//   - an issue failure stops the map thread after its current group; groups mapped but not
//     restored stay mapped for the caller to roll back (mapped(g) && !restored(g)); a chunk the
//     map thread's own rollback could not unmap keeps its handle for the caller too;
//   - restored(g): every restore and fill of group g was enqueued and every stream synchronized
//     without an error; only such groups may be marked awake;
//   - the map thread writes only its groups' chunk handles and mapped(g); the calling thread
//     reads a group only after the queue handed it over, the rest after the join.
#pragma once

#include <atomic>
#include <cstddef>
#include <exception>
#include <string>
#include <vector>

#include "pool/index_queue.hpp"
#include "pool/pool_state.hpp"

namespace torpor {

using WakeGroup = std::vector<Chunk*>;

// The asleep chunks of `tags` grouped for one set_access call per group: the groups with
// restores first, each part in VA order.
std::vector<WakeGroup> plan_wake_groups(const Pool::State& s, const std::vector<std::string>& tags);

class WakePipeline {
 public:
  WakePipeline(Pool::State& s, const std::vector<WakeGroup>& groups, TransitionReport& r)
      : s_(s),
        groups_(groups),
        r_(r),
        mapped_(groups.size(), 0),
        issued_(groups.size(), 0),
        used_(s.streams.size(), 0) {}

  // Runs to the end or to the first failure, which error() then holds.
  void run();

  bool mapped(std::size_t g) const noexcept { return mapped_[g] != 0; }
  // After run(): finish waking one chunk that holds a mapping but whose group was not restored
  // (its rollback could not unmap it): access, restores and fills on the first stream, then
  // that stream synchronized. False (logged) when any step fails. Never throws.
  bool restore_now(Chunk& c) noexcept;
  bool restored(std::size_t g) const noexcept { return issued_[g] != 0 && synced_; }
  // The map failure first, else the issue failure, else the synchronize failure.
  std::exception_ptr error() const noexcept {
    return map_error_ ? map_error_ : issue_error_ ? issue_error_ : sync_error_;
  }
  double map_seconds() const noexcept { return map_seconds_; }

 private:
  void map_loop();                // the map thread
  void map_group(std::size_t g);  // throws after rolling the group back
  void issue_restores(std::size_t g, Stream stream);
  void issue_chunk_restores(const Chunk& c, Stream stream);
  void fill_discarded(const Chunk& c, Stream stream);
  void synchronize_streams();
  void mark_used(Stream stream);  // the calling thread queued work on `stream`

  Pool::State& s_;
  const std::vector<WakeGroup>& groups_;
  TransitionReport& r_;
  IndexQueue ready_;
  std::atomic<bool> stop_{false};
  // Written by the map thread, read after the join (mapped_ of a group also after its hand-over).
  std::vector<char> mapped_;
  std::exception_ptr map_error_;
  double map_seconds_ = 0;
  // The calling thread's.
  std::vector<char> issued_;
  std::vector<char> used_;  // per copy stream: this wake queued work there
  std::exception_ptr issue_error_;
  bool synced_ = true;
  std::exception_ptr sync_error_;
};

}  // namespace torpor
