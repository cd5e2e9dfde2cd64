// The sleep plan: which chunks go to sleep, which of their bytes travel (in pieces), the host
// span each piece lands in, and which pieces are unchanged since their retained copy.
//
// On the thread that holds the pool's lock, after the device work that may touch the memory
// finished:
//   1. plan_pieces: for every awake chunk, the allocated ranges that survive the level
//      (sleep_policy.hpp), contiguous ranges merged into runs, runs cut into pieces of at most
//      copy_piece_bytes; free space never travels. A chunk without pieces needs nothing more: the
//      offload pipeline releases it while the steps below run;
//   2. place_host_copies: a retained copy of exactly a piece's range lends the piece its span
//      (and its hash and sample, for step 3); retained copies that match no piece are stale and
//      go back to the store first. Then one event per chunk for the pipeline, and a host span for
//      each of the other pieces (the store grows by blocks sized for what the sleep still needs;
//      a steady cycle allocates no host memory). When the store grew and host_pin_overlap is off
//      (the default), wait for its new blocks to be page-locked before any copy
//      ("host_pinning_wait" phase). With it on the copies overlap the pinning instead: the
//      pipeline waits for each span's own block before the copy into it (as it does for a block
//      that prepare() is still pinning), so copies into block k run while block k + 1 is pinned;
//      the waits are summed in the same phase;
//   3. hash_and_match, per group of chunks (hash_group_bytes of pieces, called by the pipeline
//      just before it issues the group's copies, so later groups are hashed while earlier ones
//      are copied and released): hash the group's pieces on the device (skip_unchanged), and
//      skip the copy of a piece whose lent copy has the same hash and whose sample still reads
//      the same (HostCopy; disk-tier copies are not sampled).
//
// A lent span that cannot take a new copy (a disk-tier span cut by a deeper sleep) is not lent:
// whether the piece is unchanged is known only at step 3, after every span was placed.
//
// Invariants once placed: every piece owns a host span; the planned chunks hold no retained
// copies; the plan owns its spans until apply moves them into the chunks' backups, and
// free_spans() gives back the ones it still holds (after a failure).
#pragma once

#include <cstddef>
#include <optional>
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
  std::optional<HostCopy> lent;  // the retained copy whose span this is (step 2)
  bool skip = false;             // the retained copy holds exactly these bytes (step 3)
  Hash128 sample;                // sample_of the host copy (chunk.hpp), once it holds the bytes
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
// Step 1; records r.pieces.
void plan_pieces(const Pool::State& s, SleepPlan& plan, TransitionReport& r);
// Step 2; records the "host_pinning_wait" phase, and with a disk tier but without
// skip_unchanged hashes the pieces bound for the disk (wake checks them). On failure the caller
// gives back the spans already taken (free_spans).
void place_host_copies(Pool::State& s, SleepPlan& plan, TransitionReport& r);
// Where the hash group that starts at chunk `first` ends (one past its last chunk): at least one
// chunk, then chunks while their pieces stay within hash_group_bytes. Chunks without pieces count
// nothing.
std::size_t hash_group_end(const Pool::State& s, const SleepPlan& plan, std::size_t first);
// Step 3 for the chunks [first, last): one hash call on the pool's hash stream (none when no
// piece needs one), then the skip decisions. Adds to r.bytes_hashed and to *hash_seconds.
void hash_and_match(Pool::State& s, SleepPlan& plan, std::size_t first, std::size_t last, TransitionReport& r,
                    double* hash_seconds);
// The host store bytes (reserved sizes) a sleep at `level` of the chunks of `tags` (nullptr: every
// chunk) would hold, with the classes marked now: the pieces of the awake chunks that survive the
// level and the backups of the asleep ones. What Pool::sleep_host_bytes reports.
std::size_t sleep_host_bytes(const Pool::State& s, const std::vector<std::string>* tags, SleepLevel level);
// sleep_host_bytes of every chunk at level 1: what prepare_host_store(0) pins.
std::size_t level1_host_bytes(const Pool::State& s);

}  // namespace torpor
