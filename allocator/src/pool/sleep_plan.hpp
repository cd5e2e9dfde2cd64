// The sleep plan: which chunks go to sleep, which of their bytes travel (in pieces), which
// pieces are unchanged since their retained copy, and the host span each piece lands in.
//
// plan_offload() runs these steps on the thread that holds the pool's lock, after the device
// work that may touch the memory finished:
//   1. pieces: for every awake chunk, the allocated ranges that survive the level
//      (sleep_policy.hpp), contiguous ranges merged into runs, runs cut into pieces of at most
//      copy_piece_bytes; free space never travels;
//   2. hash every piece on the device (skip_unchanged);
//   3. a retained copy of exactly a piece's range lends the piece its span, and the copy is
//      skipped when both hashes match and the copy's sample still reads the same (HostCopy;
//      disk-tier copies are not sampled); retained copies that match no piece are stale and go
//      back to the store first;
//   4. create one event per chunk for the pipeline, then take a host span for each of the other
//      pieces (the store grows by blocks sized for what the sleep still needs; a steady cycle
//      allocates no host memory);
//   5. when the store grew and host_pin_overlap is off (the default), wait for its new blocks to be
//      page-locked before any copy ("host_pinning_wait" phase). With it on the copies overlap
//      the pinning instead: the pipeline waits for each span's own block before the copy into it
//      (as it does for a block that prepare() is still pinning), so copies into block k run while
//      block k + 1 is pinned; the waits are summed in the same phase.
//
// Invariants once planned: every piece owns a host span; the planned chunks hold no retained
// copies; the plan owns its spans until apply moves them into the chunks' backups, and
// free_spans() gives back the ones it still holds (after a failure).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "pool/pool_state.hpp"

namespace torpor {

struct Piece {
  std::size_t offset = 0;  // in the chunk
  std::size_t bytes = 0;
  HostSpan span;  // destination (null until assigned)
  Hash128 hash;
  bool hashed = false;
  bool skip = false;  // the retained copy holds exactly these bytes
  Hash128 sample;     // sample_of the host copy (chunk.hpp), once it holds the bytes
  bool sampled = false;
};

struct ChunkPlan {
  Chunk* chunk = nullptr;
  std::vector<Piece> pieces;
  std::size_t discarded = 0;  // allocated bytes that do not travel
};

struct SleepPlan {
  SleepLevel level = SleepLevel::none;
  std::vector<ChunkPlan> chunks;  // awake chunks to put to sleep (empty slabs have no pieces)
  std::vector<Chunk*> deepen;     // asleep at a shallower level: they only drop backups

  // Gives back every span the plan still holds. Never throws.
  void free_spans(Pool::State& s) noexcept;
};

// The chunks of `tags` a sleep at `level` changes, in VA order.
SleepPlan select_chunks(const Pool::State& s, const std::vector<std::string>& tags, SleepLevel level);
// Steps 1-5 above; records r.pieces, r.bytes_hashed and the "hash" and "host_pinning_wait" phases. On failure the
// caller gives back the spans already taken (free_spans).
void plan_offload(Pool::State& s, SleepPlan& plan, TransitionReport& r);
// The host store bytes (reserved sizes) a sleep at `level` of the chunks of `tags` (nullptr: every
// chunk) would hold, with the classes marked now: the pieces of the awake chunks that survive the
// level and the backups of the asleep ones. What Pool::sleep_host_bytes reports.
std::size_t sleep_host_bytes(const Pool::State& s, const std::vector<std::string>* tags, SleepLevel level);
// sleep_host_bytes of every chunk at level 1: what prepare_host_store(0) pins.
std::size_t level1_host_bytes(const Pool::State& s);

}  // namespace torpor
