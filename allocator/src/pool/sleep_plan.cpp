// The sleep plan's steps; the design note and invariants are in sleep_plan.hpp.
#include "pool/sleep_plan.hpp"

#include <algorithm>
#include <chrono>

#include "torpor/log.hpp"

namespace torpor {

namespace {

using clock_type = std::chrono::steady_clock;

// Step 1 for one chunk: the surviving runs, cut into pieces. With a spill file per allocation a
// run never crosses from one allocation into the next, so no file holds two allocations' bytes.
void split_into_pieces(const Pool::State& s, ChunkPlan& plan, SleepLevel level) {
  const std::size_t piece_bytes = s.options.copy_piece_bytes;
  const bool per_allocation = s.options.spill_file_per_allocation;
  std::size_t run_lo = 0, run_hi = 0;
  auto flush = [&] {
    for (std::size_t at = run_lo; at < run_hi; at += piece_bytes) {
      Piece piece;
      piece.offset = at;
      piece.bytes = std::min(piece_bytes, run_hi - at);
      plan.pieces.push_back(piece);
    }
    run_lo = run_hi = 0;
  };
  for (auto& [aoff, a] : plan.chunk->allocations) {
    bool first_of_allocation = true;
    for (auto& [segstart, seg] : a->segments) {
      std::size_t lo = a->offset + segstart, hi = a->offset + seg.end;
      if (!s.survives(seg, level)) {
        plan.discarded += hi - lo;
        continue;
      }
      bool new_allocation = per_allocation && first_of_allocation;
      first_of_allocation = false;
      // Contiguous surviving ranges merge into one run: fewer, larger copies.
      if (run_hi != lo || run_hi == 0 || new_allocation) {
        if (run_hi != 0) flush();
        run_lo = lo;
      }
      run_hi = hi;
    }
  }
  if (run_hi != 0) flush();
}

// One device hash call on `stream` for every piece of chunks [first, last) that `wanted` picks.
// Returns the seconds it took (0 when nothing was wanted).
template <typename Wanted>
double hash_pieces(Pool::State& s, SleepPlan& plan, std::size_t first, std::size_t last, Stream stream,
                   TransitionReport& r, Wanted wanted) {
  std::vector<HashRange> ranges;
  for (std::size_t k = first; k < last; ++k)
    for (auto& p : plan.chunks[k].pieces)
      if (wanted(p))
        ranges.push_back(HashRange{reinterpret_cast<const void*>(plan.chunks[k].chunk->va + p.offset), p.bytes});
  if (ranges.empty()) return 0;
  auto t = clock_type::now();
  std::vector<Hash128> hashes(ranges.size());
  s.driver.hash(ranges, hashes.data(), stream);
  std::size_t i = 0;
  for (std::size_t k = first; k < last; ++k)
    for (auto& p : plan.chunks[k].pieces)
      if (wanted(p)) {
        p.hash = hashes[i++];
        p.hashed = true;
        r.bytes_hashed += p.bytes;
      }
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

// Step 2 for one chunk: retained copies of exactly a piece's range lend it their span. Returns
// the host bytes its pieces without a span still need.
std::size_t lend_retained_copies(Pool::State& s, ChunkPlan& plan) {
  Chunk& c = *plan.chunk;
  for (auto& p : plan.pieces) {
    auto it = c.retained.find(p.offset);
    if (it == c.retained.end() || it->second.bytes != p.bytes) continue;
    const HostCopy& kept = it->second;
    if (s.host.writable(kept.span, p.bytes)) {
      p.span = kept.span;
      p.lent = kept;
    } else {
      s.free_span(kept.span);  // a span cut by drop_copies: the piece takes a fresh one below
    }
    c.retained.erase(it);
  }
  s.drop_all_copies(c.retained);
  std::size_t needed = 0;
  for (auto& p : plan.pieces)
    if (p.span.ptr == nullptr) needed += HostStore::reserved_size(p.bytes);
  return needed;
}

// Step 3 for one hashed chunk: a piece whose lent copy holds exactly its bytes is not copied.
void match_lent_copies(ChunkPlan& plan) {
  const Chunk& c = *plan.chunk;
  for (Piece& p : plan.pieces) {
    if (!p.lent) continue;
    const HostCopy& kept = *p.lent;
    p.skip = p.hashed && kept.hashed && kept.hash == p.hash;
    if (p.skip && kept.sampled && sample_of(kept.span.ptr, kept.bytes) != kept.sample) {
      // The host copy changed while it was kept: the device still has the bytes, copy them again.
      log::warn("sleep: the retained host copy of chunk {:#x} +{:#x} ({} bytes, tag '{}') changed since it was made; "
                "copying the bytes again",
                c.va, p.offset, p.bytes, c.tag);
      p.skip = false;
    }
    if (p.skip) {
      p.sample = kept.sample;
      p.sampled = kept.sampled;
    }
  }
}

// A span for every piece still without one; `needed` (what is left to place) sizes the blocks
// the store grows by.
void take_host_spans(Pool::State& s, SleepPlan& plan, std::size_t needed) {
  // Events first: creating one waits for the driver behind any registration of host memory in
  // flight, and the spans below start the pinning of new host store blocks.
  for (std::size_t k = 0; k < plan.chunks.size(); ++k) s.event(k);
  std::size_t spans = 0;
  for (auto& cp : plan.chunks)
    for (auto& p : cp.pieces) spans += p.span.ptr == nullptr ? 1 : 0;
  for (auto& cp : plan.chunks)
    for (auto& p : cp.pieces)
      if (p.span.ptr == nullptr) {
        p.span = s.host.allocate(p.bytes, needed, spans--);
        needed -= std::min(needed, HostStore::reserved_size(p.bytes));
      }
}

// When the store grew and host_pin_overlap is off, the pinning of the new blocks finishes before
// any copy starts. With it on nothing waits here: the pinner works through the new blocks in the
// order their spans were handed out (plan order), and the pipeline waits for each span's own
// block before the copy into it (host_copies.cpp), so block k's copies are queued while block
// k + 1 is still being touched and registered, and no copy waits for a later block.
void finish_pinning(Pool::State& s, std::size_t growths_before, TransitionReport& r) {
  if (s.host.growths() == growths_before || s.options.host_pin_overlap) return;
  auto t = clock_type::now();
  s.host.wait_pinning();
  r.phases.push_back({"host_pinning_wait", std::chrono::duration<double>(clock_type::now() - t).count()});
}

}  // namespace

void SleepPlan::free_spans(Pool::State& s) noexcept {
  for (auto& cp : chunks)
    for (auto& p : cp.pieces)
      if (p.span.ptr != nullptr) {
        s.free_span(p.span);
        p.span = {};
      }
}

SleepPlan select_chunks(const Pool::State& s, const std::vector<std::string>& tags, SleepLevel level) {
  SleepPlan plan;
  plan.level = level;
  for (auto& [va, c] : s.chunks) {
    if (!has_tag(tags, c->tag)) continue;
    if (c->awake)
      plan.chunks.push_back(ChunkPlan{c.get(), {}, 0});
    else if (c->level < level)
      plan.deepen.push_back(c.get());
  }
  return plan;
}

std::size_t sleep_host_bytes(const Pool::State& s, const std::vector<std::string>* tags, SleepLevel level) {
  std::size_t bytes = 0;
  if (level == SleepLevel::none) return 0;
  for (auto& [va, c] : s.chunks) {
    if (tags != nullptr && !has_tag(*tags, c->tag)) continue;
    if (c->awake) {
      ChunkPlan cp{c.get(), {}, 0};
      split_into_pieces(s, cp, level);
      for (const Piece& p : cp.pieces) bytes += HostStore::reserved_size(p.bytes);
    } else {
      // A backup already held; a deeper sleep would drop some of it, but the store holds it now.
      for (auto& [off, b] : c->backups) bytes += b.span.bytes;
    }
  }
  return bytes;
}

std::size_t level1_host_bytes(const Pool::State& s) { return sleep_host_bytes(s, nullptr, SleepLevel::offload); }

void plan_pieces(const Pool::State& s, SleepPlan& plan, TransitionReport& r) {
  for (auto& cp : plan.chunks) {
    split_into_pieces(s, cp, plan.level);
    r.pieces += cp.pieces.size();
  }
}

void place_host_copies(Pool::State& s, SleepPlan& plan, TransitionReport& r) {
  std::size_t needed = 0;
  for (auto& cp : plan.chunks) needed += lend_retained_copies(s, cp);
  const std::size_t growths = s.host.growths();
  take_host_spans(s, plan, needed);
  // Bytes bound for the disk are checked at wake against the hash of what left the device: a
  // file can change while it waits there (wake.cpp).
  if (!s.options.skip_unchanged && s.host.has_disk_tier()) {
    double seconds = hash_pieces(s, plan, 0, plan.chunks.size(), s.streams[0], r,
                                 [](const Piece& p) { return p.span.tier == HostTier::disk; });
    if (seconds > 0) r.phases.push_back({"hash", seconds});
  }
  finish_pinning(s, growths, r);
}

std::size_t hash_group_end(const Pool::State& s, const SleepPlan& plan, std::size_t first) {
  std::size_t bytes = 0, k = first;
  for (; k < plan.chunks.size(); ++k) {
    std::size_t chunk_bytes = 0;
    for (const Piece& p : plan.chunks[k].pieces) chunk_bytes += p.bytes;
    if (k > first && bytes + chunk_bytes > s.options.hash_group_bytes) break;
    bytes += chunk_bytes;
  }
  return k;
}

void hash_and_match(Pool::State& s, SleepPlan& plan, std::size_t first, std::size_t last, TransitionReport& r,
                    double* hash_seconds) {
  if (!s.hash_stream) return;  // created exactly when skip_unchanged is on
  *hash_seconds += hash_pieces(s, plan, first, last, *s.hash_stream, r, [](const Piece&) { return true; });
  for (std::size_t k = first; k < last; ++k) match_lent_copies(plan.chunks[k]);
}

}  // namespace torpor
