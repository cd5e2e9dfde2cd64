// Sleep and wake: plans per level, a pipelined offload/restore through the host store, the
// skip-unchanged optimisation and the failure rules.
//
// sleep(level, tags):
//   1. wait for device work (cuCtxSynchronize): nothing may touch the memory while it goes;
//   2. plan: for every awake chunk, the ranges whose bytes survive at this level (state;
//      parameters at level 1 or matching a preserve glob), split into pieces of at most
//      copy_piece_bytes; free space never travels;
//   3. hash every piece on the device (skip_unchanged): a piece whose retained host copy has
//      the same hash is not copied again;
//   4. pipeline: this thread issues the copies chunk by chunk over copy_streams streams and
//      records one event per chunk; a release thread waits for each chunk's event, then
//      unmaps and releases it while later copies still run. Copies to pageable backups
//      (beyond host_store_limit) go through the pinned staging ring.
//   Each chunk ends asleep with its backups or awake (its new copies dropped): a failure
//   anywhere stops the pipeline at a chunk boundary. An asleep chunk at level 1 asked for
//   level 2 drops the backups of its non-preserved parameters; level 2 asked for 1 is a no-op.
//
// wake_up(tags): a map thread creates and maps the asleep chunks in groups of VA-contiguous
//   chunks (at most map_group_bytes) and sets access once per group; this thread enqueues
//   each ready group's restores and fills while the next group is mapped. One sync at the end;
//   backups become retained copies (or are freed) only after it. On failure the groups whose
//   restores completed are awake, the others are unmapped again and stay asleep with their
//   backups.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <optional>
#include <thread>

#include "pool/pool_state.hpp"
#include "torpor/error.hpp"
#include "torpor/log.hpp"
#include "torpor/pool.hpp"

namespace torpor {

namespace {

using clock_type = std::chrono::steady_clock;

double since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }

bool contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

struct Piece {
  std::size_t offset = 0;  // in the chunk
  std::size_t bytes = 0;
  HostSpan span;           // destination (null until assigned)
  Hash128 hash;
  bool hashed = false;
  bool skip = false;       // the retained copy holds exactly these bytes
};

struct ChunkPlan {
  Chunk* chunk = nullptr;
  std::vector<Piece> pieces;
  std::size_t discarded = 0;  // allocated bytes that do not travel
};

// A single-producer single-consumer hand-off of indices between this thread and a worker.
class IndexQueue {
 public:
  void push(std::size_t i) {
    {
      std::lock_guard lock(mu_);
      items_.push_back(i);
    }
    cv_.notify_one();
  }
  void close() {
    {
      std::lock_guard lock(mu_);
      closed_ = true;
    }
    cv_.notify_all();
  }
  // Next index, or nothing once closed and drained.
  std::optional<std::size_t> pop() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return closed_ || !items_.empty(); });
    if (items_.empty()) return std::nullopt;
    std::size_t i = items_.front();
    items_.pop_front();
    return i;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::size_t> items_;
  bool closed_ = false;
};

// Ranges of chunk offsets [lo, hi) not covered by the chunk's backups, restricted to the
// allocated bytes: what was discarded.
template <typename F>
void for_each_discarded(const Chunk& c, F&& f) {
  for (auto& [aoff, a] : c.allocations) {
    std::size_t at = a->offset, end = a->offset + a->bytes;
    auto b = c.backups.upper_bound(at);
    if (b != c.backups.begin()) --b;
    for (; b != c.backups.end() && b->first < end && at < end; ++b) {
      std::size_t blo = b->first, bhi = b->first + b->second.bytes;
      if (bhi <= at) continue;
      if (blo > at) f(at, std::min(blo, end));
      at = std::max(at, bhi);
    }
    if (at < end) f(at, end);
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Staging ring: pageable backups move through a few pinned slots.

void Pool::State::staged_to_host(std::byte* dst, device_ptr src, std::size_t bytes, Stream stream) {
  std::size_t slot_bytes = options.staging_slot_bytes;
  auto slots = static_cast<std::size_t>(options.staging_slots);
  if (staging == nullptr) staging = static_cast<std::byte*>(driver.host_alloc(slots * slot_bytes));
  while (staging_events.size() < slots) staging_events.push_back(driver.event_create(options.device));
  struct Pending {
    std::size_t slot, offset, bytes;
  };
  std::deque<Pending> pending;
  auto drain_one = [&] {
    Pending p = pending.front();
    pending.pop_front();
    driver.event_synchronize(staging_events[p.slot]);
    std::memcpy(dst + p.offset, staging + p.slot * slot_bytes, p.bytes);
  };
  std::size_t next = 0;
  for (std::size_t off = 0; off < bytes; off += slot_bytes) {
    if (pending.size() == slots) drain_one();
    std::size_t n = std::min(slot_bytes, bytes - off);
    std::size_t slot = next++ % slots;
    driver.copy_async(staging + slot * slot_bytes, reinterpret_cast<const void*>(src + off), n, stream);
    driver.event_record(staging_events[slot], stream);
    pending.push_back({slot, off, n});
  }
  while (!pending.empty()) drain_one();
}

void Pool::State::staged_to_device(device_ptr dst, const std::byte* src, std::size_t bytes, Stream stream) {
  std::size_t slot_bytes = options.staging_slot_bytes;
  auto slots = static_cast<std::size_t>(options.staging_slots);
  if (staging == nullptr) staging = static_cast<std::byte*>(driver.host_alloc(slots * slot_bytes));
  while (staging_events.size() < slots) staging_events.push_back(driver.event_create(options.device));
  std::size_t next = 0;
  std::vector<bool> used(slots, false);
  for (std::size_t off = 0; off < bytes; off += slot_bytes) {
    std::size_t n = std::min(slot_bytes, bytes - off);
    std::size_t slot = next++ % slots;
    // The slot's previous copy to the device must have read it before it is refilled.
    if (used[slot]) driver.event_synchronize(staging_events[slot]);
    std::memcpy(staging + slot * slot_bytes, src + off, n);
    driver.copy_async(reinterpret_cast<void*>(dst + off), staging + slot * slot_bytes, n, stream);
    driver.event_record(staging_events[slot], stream);
    used[slot] = true;
  }
  // The slots may be refilled by the next call as soon as these copies have read them.
  for (std::size_t i = 0; i < slots; ++i)
    if (used[i]) driver.event_synchronize(staging_events[i]);
}

// ---------------------------------------------------------------------------------------------
// Public entry points: observers around the engine.

TransitionReport Pool::sleep(int level, const std::vector<std::string>& requested) {
  if (level < 0 || level > 2)
    throw invalid_argument(fmt::format("sleep: level {} is not 0, 1 or 2", level));
  std::vector<std::string> tags;
  std::vector<SleepObserver*> observers;
  {
    std::lock_guard lock(state_->mu);
    tags = state_->resolve_tags(requested, "sleep");
    if (level > 0) observers = state_->observers;
  }
  std::size_t notified = 0;
  try {
    for (SleepObserver* o : observers) {
      o->before_sleep(*this, level, tags);
      ++notified;
    }
    TransitionReport r = sleep_tags(level, tags);
    for (SleepObserver* o : observers) o->after_sleep(*this, level, tags, true);
    return r;
  } catch (...) {
    for (std::size_t i = 0; i < notified; ++i) {
      try {
        observers[i]->after_sleep(*this, level, tags, false);
      } catch (const std::exception& e) {
        log::error("sleep: an observer failed to recover after a failed sleep: {}", e.what());
      }
    }
    throw;
  }
}

TransitionReport Pool::wake_up(const std::vector<std::string>& requested) {
  std::vector<std::string> tags;
  std::vector<SleepObserver*> observers;
  {
    std::lock_guard lock(state_->mu);
    tags = state_->resolve_tags(requested, "wake_up");
    observers = state_->observers;
  }
  std::size_t notified = 0;
  try {
    for (SleepObserver* o : observers) {
      o->before_wake(*this, tags);
      ++notified;
    }
    TransitionReport r = wake_tags(tags);
    for (SleepObserver* o : observers) o->after_wake(*this, tags, true);
    return r;
  } catch (...) {
    for (std::size_t i = 0; i < notified; ++i) {
      try {
        observers[i]->after_wake(*this, tags, false);
      } catch (const std::exception& e) {
        log::error("wake_up: an observer failed to recover after a failed wake: {}", e.what());
      }
    }
    throw;
  }
}

// ---------------------------------------------------------------------------------------------
// Sleep

TransitionReport Pool::sleep_tags(int level, const std::vector<std::string>& tags) {
  State& s = *state_;
  std::lock_guard lock(s.mu);
  TransitionReport r;
  r.operation = "sleep";
  r.level = level;
  r.tags = tags;
  if (level == 0) return r;
  auto start = clock_type::now();
  s.retry_pending_releases();

  std::vector<ChunkPlan> plans;  // awake chunks to put to sleep (empty slabs have no pieces)
  std::vector<Chunk*> deepen;    // asleep at a lower level
  for (auto& [va, c] : s.chunks) {
    if (!contains(tags, c->tag)) continue;
    if (c->awake) plans.push_back(ChunkPlan{c.get(), {}, 0});
    else if (c->level < level) deepen.push_back(c.get());
  }

  std::map<std::string, TagState> previous;
  for (const auto& t : tags) {
    previous[t] = s.tags[t];
    TagState& ts = s.tags[t];
    ts.asleep = true;
    ts.level = std::max(ts.level, level);
  }
  // After a failure, a tag none of whose chunks fell asleep is as it was.
  auto settle_tags = [&] {
    for (const auto& t : tags) {
      bool any_asleep = false;
      for (auto& [va, c] : s.chunks)
        if (c->tag == t && !c->awake) any_asleep = true;
      if (!any_asleep && !previous[t].asleep) s.tags[t] = previous[t];
    }
  };
  // Spans of chunks that stay awake go back to the store (a retained copy that was reused as
  // a destination may be half overwritten, so it is not kept either).
  auto free_pieces = [&](std::size_t from) noexcept {
    for (std::size_t i = from; i < plans.size(); ++i)
      for (auto& p : plans[i].pieces)
        if (p.span.ptr != nullptr) {
          s.free_span(p.span);
          p.span = {};
        }
  };

  // --- 1-3: synchronize, plan, hash, match retained copies, reserve host space -------------
  try {
    auto t = clock_type::now();
    s.driver.device_synchronize(options_.device);
    r.phases.push_back({"synchronize", since(t)});

    std::vector<HashRange> ranges;
    for (auto& plan : plans) {
      const Chunk& c = *plan.chunk;
      std::size_t run_lo = 0, run_hi = 0;
      auto flush = [&] {
        for (std::size_t at = run_lo; at < run_hi; at += options_.copy_piece_bytes)
          plan.pieces.push_back(Piece{at, std::min(options_.copy_piece_bytes, run_hi - at), {}, {}, false, false});
        run_lo = run_hi = 0;
      };
      for (auto& [aoff, a] : c.allocations) {
        for (auto& [segstart, seg] : a->segments) {
          std::size_t lo = a->offset + segstart, hi = a->offset + seg.end;
          if (!s.survives(seg, level)) {
            plan.discarded += hi - lo;
            continue;
          }
          // Contiguous surviving ranges merge into one run: fewer, larger copies.
          if (run_hi != lo || run_hi == 0) {
            if (run_hi != 0) flush();
            run_lo = lo;
          }
          run_hi = hi;
        }
      }
      if (run_hi != 0) flush();
      for (auto& p : plan.pieces) ranges.push_back(HashRange{reinterpret_cast<const void*>(c.va + p.offset), p.bytes});
      r.pieces += plan.pieces.size();
    }

    if (options_.skip_unchanged && !ranges.empty()) {
      t = clock_type::now();
      std::vector<Hash128> hashes(ranges.size());
      s.driver.hash(ranges, hashes.data(), s.streams[0]);
      std::size_t k = 0;
      for (auto& plan : plans)
        for (auto& p : plan.pieces) {
          p.hash = hashes[k++];
          p.hashed = true;
          r.bytes_hashed += p.bytes;
        }
      r.phases.push_back({"hash", since(t)});
    }

    // Retained copies: reuse the span of an identical range; skip the copy when the hash
    // matches. Copies that match no piece are stale and go back to the store first.
    std::size_t host_needed = 0;
    for (auto& plan : plans) {
      Chunk& c = *plan.chunk;
      for (auto& p : plan.pieces) {
        auto it = c.retained.find(p.offset);
        if (it == c.retained.end() || it->second.bytes != p.bytes) continue;
        p.span = it->second.span;
        p.skip = p.hashed && it->second.hashed && it->second.hash == p.hash;
        c.retained.erase(it);
      }
      s.drop_all_copies(c.retained);
      for (auto& p : plan.pieces)
        if (p.span.ptr == nullptr) host_needed += HostStore::reserved_size(p.bytes);
    }
    s.host.reserve(host_needed);
    for (auto& plan : plans)
      for (auto& p : plan.pieces)
        if (p.span.ptr == nullptr) p.span = s.host.allocate(p.bytes);
    for (std::size_t i = 0; i < plans.size(); ++i) s.event(i);  // create events before the pipeline
  } catch (...) {
    free_pieces(0);
    settle_tags();
    throw;
  }

  // --- 4: pipeline: issue copies here, release chunks on a worker as their copies finish ----
  auto t = clock_type::now();
  IndexQueue issued;
  std::vector<char> released(plans.size(), 0);  // 1: unmapped (release done or deferred)
  std::vector<PhysicalHandle> deferred;
  std::mutex worker_mu;  // guards worker_error and deferred
  std::exception_ptr worker_error;
  std::atomic<bool> worker_failed{false};
  auto release_loop = [&] {
    while (auto k = issued.pop()) {
      if (worker_failed) continue;  // drain after a failure
      Chunk& c = *plans[*k].chunk;
      try {
        s.driver.event_synchronize(s.events[*k]);
        s.driver.unmap(c.va, c.bytes);
      } catch (...) {
        std::lock_guard lock(worker_mu);
        if (!worker_error) worker_error = std::current_exception();
        worker_failed = true;
        continue;
      }
      try {
        s.driver.release(c.handle);
      } catch (const std::exception& e) {
        log::warn("sleep: releasing chunk {:#x} failed, will retry: {}", c.va, e.what());
        std::lock_guard lock(worker_mu);
        deferred.push_back(c.handle);
      }
      released[*k] = 1;
    }
  };
  // Releasing is a driver call per chunk whose cost grows with its size; a few threads
  // overlap them (the copies they wait for still complete in issue order).
  std::vector<std::thread> workers;
  workers.reserve(static_cast<std::size_t>(options_.release_threads));
  for (int i = 0; i < options_.release_threads; ++i) workers.emplace_back(release_loop);
  std::exception_ptr issue_error;
  double copy_seconds = 0;
  for (std::size_t k = 0; k < plans.size() && !worker_failed; ++k) {
    Stream stream = s.streams[k % s.streams.size()];
    try {
      for (auto& p : plans[k].pieces) {
        if (p.skip) {
          r.bytes_skipped += p.bytes;
          continue;
        }
        device_ptr src = plans[k].chunk->va + p.offset;
        if (p.span.pinned) {
          s.driver.copy_async(p.span.ptr, reinterpret_cast<const void*>(src), p.bytes, stream);
        } else {
          s.staged_to_host(p.span.ptr, src, p.bytes, stream);
          r.bytes_staged += p.bytes;
        }
        r.bytes_offloaded += p.bytes;
      }
      s.driver.event_record(s.events[k], stream);
    } catch (...) {
      issue_error = std::current_exception();
      break;
    }
    issued.push(k);
  }
  issued.close();
  for (auto& w : workers) w.join();
  copy_seconds = since(t);
  if (!issue_error && !worker_error) r.phases.push_back({"offload_and_release", copy_seconds});

  // Apply: released chunks are asleep with their backups, the others stay awake.
  for (PhysicalHandle h : deferred) s.pending_release.push_back(h);
  std::size_t first_awake = plans.size();
  for (std::size_t k = 0; k < plans.size(); ++k) {
    Chunk& c = *plans[k].chunk;
    if (!released[k]) {
      first_awake = std::min(first_awake, k);
      continue;
    }
    c.handle = {};
    c.awake = false;
    c.level = level;
    for (auto& p : plans[k].pieces) {
      c.backups[p.offset] = HostCopy{p.bytes, p.span, p.hash, p.hashed};
      p.span = {};
    }
    r.bytes_released += c.bytes;
    r.bytes_discarded += plans[k].discarded;
    ++r.chunks;
  }
  if (issue_error || worker_error) {
    // Not all chunks went to sleep. Make sure no copy still writes into spans we free.
    for (Stream st : s.streams) {
      try {
        s.driver.stream_synchronize(st);
      } catch (const std::exception& e) {
        log::error("sleep: synchronize after a failure failed: {}", e.what());
      }
    }
    for (std::size_t k = 0; k < plans.size(); ++k)
      if (!released[k])
        for (auto& p : plans[k].pieces)
          if (p.span.ptr != nullptr) {
            s.free_span(p.span);
            p.span = {};
          }
    settle_tags();
    log::warn("sleep: stopped at chunk {} of {}; earlier chunks are asleep, the rest awake", first_awake,
              plans.size());
    std::rethrow_exception(issue_error ? issue_error : worker_error);
  }
  // Empty slabs have nothing to keep: drop them rather than re-create them on wake.
  for (auto& plan : plans)
    if (plan.chunk->slab() && plan.chunk->allocations.empty()) s.dispose_chunk(*plan.chunk);

  for (Chunk* c : deepen) {
    for (auto& [aoff, a] : c->allocations) {
      for (auto& [segstart, seg] : a->segments) {
        if (s.survives(seg, level)) continue;
        std::size_t lo = a->offset + segstart, hi = a->offset + seg.end;
        std::size_t held = 0;
        for (auto& [bo, b] : c->backups) {
          std::size_t blo = std::max(lo, bo), bhi = std::min(hi, bo + b.bytes);
          if (bhi > blo) held += bhi - blo;
        }
        s.drop_copies(c->backups, lo, hi);
        r.bytes_discarded += held;
      }
    }
    c->level = level;
    ++r.chunks;
  }
  r.seconds = since(start);
  log::info("sleep level {}: {} chunks, {} bytes offloaded, {} skipped unchanged, {} discarded, {} released in {:.3f} s",
            level, r.chunks, r.bytes_offloaded, r.bytes_skipped, r.bytes_discarded, r.bytes_released, r.seconds);
  return r;
}

// ---------------------------------------------------------------------------------------------
// Wake

TransitionReport Pool::wake_tags(const std::vector<std::string>& tags) {
  State& s = *state_;
  std::lock_guard lock(s.mu);
  TransitionReport r;
  r.operation = "wake_up";
  r.tags = tags;
  auto start = clock_type::now();
  s.retry_pending_releases();

  // Groups of VA-contiguous asleep chunks: one set_access call each.
  std::vector<std::vector<Chunk*>> groups;
  device_ptr group_end = 0;
  std::size_t group_bytes = 0;
  for (auto& [va, c] : s.chunks) {
    if (c->awake || !contains(tags, c->tag)) continue;
    if (groups.empty() || c->va != group_end || group_bytes + c->bytes > options_.map_group_bytes) {
      groups.emplace_back();
      group_bytes = 0;
    }
    groups.back().push_back(c.get());
    group_end = c->va + c->bytes;
    group_bytes += c->bytes;
  }

  // The map thread: create + map each chunk of a group, one set_access for the group. On a
  // failure it rolls its group back and stops. Results are read after join or after the
  // group's index is handed over (the queue orders the accesses).
  std::vector<std::vector<PhysicalHandle>> handles(groups.size());
  IndexQueue ready;
  std::exception_ptr map_error;
  std::atomic<bool> stop{false};
  std::atomic<double> map_seconds{0};
  std::thread mapper([&] {
    for (std::size_t g = 0; g < groups.size() && !stop; ++g) {
      auto t = clock_type::now();
      std::vector<PhysicalHandle>& hs = handles[g];
      std::size_t mapped = 0;
      try {
        for (Chunk* c : groups[g]) {
          hs.push_back(s.create_memory(c->bytes, c->tag));
          s.driver.map(c->va, c->bytes, hs.back(), 0);
          ++mapped;
        }
        Chunk* first = groups[g].front();
        Chunk* last = groups[g].back();
        s.driver.set_access(first->va, last->va + last->bytes - first->va, s.access_devices);
      } catch (...) {
        for (std::size_t i = 0; i < hs.size(); ++i) {
          if (i < mapped) {
            try {
              s.driver.unmap(groups[g][i]->va, groups[g][i]->bytes);
            } catch (const std::exception& e) {
              log::error("wake_up: unmapping chunk {:#x} after a failure failed: {}", groups[g][i]->va, e.what());
            }
          }
          s.release_or_defer(hs[i]);
        }
        hs.clear();
        map_error = std::current_exception();
        break;
      }
      map_seconds = map_seconds + since(t);
      ready.push(g);
    }
    ready.close();
  });

  std::vector<char> consumed(groups.size(), 0);
  std::exception_ptr issue_error;
  while (auto g = ready.pop()) {
    if (issue_error) continue;  // drain
    Stream stream = s.streams[*g % s.streams.size()];
    try {
      for (std::size_t i = 0; i < groups[*g].size(); ++i) {
        Chunk& c = *groups[*g][i];
        for (auto& [off, b] : c.backups) {
          if (b.span.pinned) {
            s.driver.copy_async(reinterpret_cast<void*>(c.va + off), b.span.ptr, b.bytes, stream);
          } else {
            s.staged_to_device(c.va + off, b.span.ptr, b.bytes, stream);
            r.bytes_staged += b.bytes;
          }
          r.bytes_restored += b.bytes;
        }
        if (options_.fill_on_wake != FillOnWake::none) {
          std::uint8_t v = options_.fill_on_wake == FillOnWake::zero ? 0 : poison_byte;
          for_each_discarded(c, [&](std::size_t lo, std::size_t hi) {
            s.driver.fill_async(c.va + lo, v, hi - lo, stream);
            r.bytes_filled += hi - lo;
          });
        }
      }
      consumed[*g] = 1;
    } catch (...) {
      issue_error = std::current_exception();
      stop = true;
    }
  }
  mapper.join();
  bool synced = true;
  std::exception_ptr sync_error;
  for (Stream st : s.streams) {
    try {
      s.driver.stream_synchronize(st);
    } catch (...) {
      synced = false;
      if (!sync_error) sync_error = std::current_exception();
    }
  }

  // Apply: groups whose restores were enqueued and synchronized are awake; every other
  // mapped group is unmapped again and stays asleep with its backups.
  for (std::size_t g = 0; g < groups.size(); ++g) {
    if (handles[g].empty()) continue;  // never mapped (or rolled back by the map thread)
    bool awake = consumed[g] && synced;
    for (std::size_t i = 0; i < groups[g].size(); ++i) {
      Chunk& c = *groups[g][i];
      if (awake) {
        c.handle = handles[g][i];
        c.awake = true;
        // Backups become retained copies (checked by hash before any reuse) or go back.
        if (options_.skip_unchanged) {
          s.drop_all_copies(c.retained);
          c.retained = std::move(c.backups);
          c.backups.clear();
        } else {
          s.drop_all_copies(c.backups);
        }
        r.bytes_mapped += c.bytes;
        ++r.chunks;
      } else {
        try {
          s.driver.unmap(c.va, c.bytes);
        } catch (const std::exception& e) {
          log::error("wake_up: unmapping chunk {:#x} after a failure failed: {}", c.va, e.what());
        }
        s.release_or_defer(handles[g][i]);
      }
    }
  }
  for (const auto& t : tags) {
    bool any_asleep = false;
    for (auto& [va, c] : s.chunks)
      if (c->tag == t && !c->awake) any_asleep = true;
    if (!any_asleep) s.tags[t] = TagState{};
  }
  if (issue_error || map_error || sync_error) {
    std::size_t still_asleep = 0;
    for (auto& [va, c] : s.chunks)
      if (!c->awake && contains(tags, c->tag)) ++still_asleep;
    log::warn("wake_up: failed; {} chunks woke, {} stay asleep with their backups", r.chunks, still_asleep);
    std::rethrow_exception(map_error ? map_error : issue_error ? issue_error : sync_error);
  }
  r.seconds = since(start);
  r.phases.push_back({"map", map_seconds.load()});
  r.phases.push_back({"map_and_restore", r.seconds});
  log::info("wake_up: {} chunks, {} bytes mapped, {} restored in {:.3f} s", r.chunks, r.bytes_mapped, r.bytes_restored,
            r.seconds);
  return r;
}

}  // namespace torpor
