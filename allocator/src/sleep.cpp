// Sleep and wake: plans per level, offload/restore through the host store, and the failure
// rules.
//
// sleep(level, tags):
//   1. wait for device work (cuCtxSynchronize): nothing may touch the memory while it goes;
//   2. plan: for every awake chunk, the ranges whose bytes survive at this level (state;
//      parameters at level 1 or matching a preserve glob); free space never travels;
//   3. offload: one host store reservation for the whole plan, async copies, one sync;
//   4. release: unmap and release chunk by chunk; each chunk becomes asleep with its backups.
//   A failure in 1-3 changes nothing. A failure in 4 leaves earlier chunks asleep and the
//   rest awake, their copies dropped. An asleep chunk at level 1 asked for level 2 drops the
//   backups of its non-preserved parameters (deepening); level 2 asked for 1 is a no-op.
//
// wake_up(tags): for each asleep chunk: create, map at the same VA, set access, enqueue the
//   restore (and the fill of discarded bytes); one sync at the end. Backups are freed only
//   after the sync. On failure, the chunks whose restore completed are awake, the others
//   (and the failing one) are unmapped again and stay asleep with their backups.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>

#include "pool_state.hpp"
#include "torpor/error.hpp"
#include "torpor/log.hpp"
#include "torpor/pool.hpp"

namespace torpor {

namespace {

using clock_type = std::chrono::steady_clock;

double since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }

struct Piece {
  std::size_t offset = 0;  // in the chunk
  std::size_t bytes = 0;
  std::byte* host = nullptr;
  std::size_t host_bytes = 0;
};

struct ChunkPlan {
  Chunk* chunk = nullptr;
  std::vector<Piece> pieces;
  std::size_t discarded = 0;  // allocated bytes that do not travel
};

bool contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

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

  std::vector<ChunkPlan> plans;     // awake chunks to put to sleep (empty slabs have no pieces)
  std::vector<Chunk*> deepen;       // asleep at a lower level
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
  auto free_pieces = [&](std::size_t from) noexcept {
    for (std::size_t i = from; i < plans.size(); ++i) {
      for (auto& p : plans[i].pieces) {
        if (p.host == nullptr) continue;
        try {
          s.host.free(p.host, p.host_bytes);
        } catch (const std::exception& e) {
          log::error("sleep: freeing a host piece failed: {}", e.what());
        }
        p.host = nullptr;
      }
    }
  };

  // 1-3: synchronize, plan, offload. Any failure here changes nothing.
  try {
    auto t = clock_type::now();
    s.driver.device_synchronize(options_.device);
    r.phases.push_back({"synchronize", since(t)});

    t = clock_type::now();
    std::size_t host_needed = 0;
    for (auto& plan : plans) {
      const Chunk& c = *plan.chunk;
      for (auto& [aoff, a] : c.allocations) {
        for (auto& [segstart, seg] : a->segments) {
          std::size_t lo = a->offset + segstart, hi = a->offset + seg.end;
          if (!s.survives(seg, level)) {
            plan.discarded += hi - lo;
            continue;
          }
          // Merge with the previous piece when contiguous: fewer, larger copies.
          if (!plan.pieces.empty() && plan.pieces.back().offset + plan.pieces.back().bytes == lo)
            plan.pieces.back().bytes += hi - lo;
          else
            plan.pieces.push_back(Piece{lo, hi - lo, nullptr, 0});
        }
      }
      for (auto& p : plan.pieces) host_needed += HostStore::reserved_size(p.bytes);
    }
    s.host.reserve(host_needed);
    for (auto& plan : plans) {
      for (auto& p : plan.pieces) {
        p.host = s.host.allocate(p.bytes);
        p.host_bytes = HostStore::reserved_size(p.bytes);
        s.driver.copy_async(p.host, reinterpret_cast<const void*>(plan.chunk->va + p.offset), p.bytes, s.stream);
        r.bytes_offloaded += p.bytes;
      }
    }
    s.driver.stream_synchronize(s.stream);
    r.phases.push_back({"offload", since(t)});
  } catch (...) {
    free_pieces(0);
    settle_tags();
    throw;
  }

  // 4: release chunk by chunk.
  auto t = clock_type::now();
  for (std::size_t i = 0; i < plans.size(); ++i) {
    Chunk& c = *plans[i].chunk;
    try {
      s.unmap_and_release(c);
    } catch (...) {
      free_pieces(i);
      settle_tags();
      throw;
    }
    c.awake = false;
    c.level = level;
    for (auto& p : plans[i].pieces) c.backups[p.offset] = Backup{p.bytes, p.host, p.host_bytes};
    r.bytes_released += c.bytes;
    r.bytes_discarded += plans[i].discarded;
    ++r.chunks;
    // An empty slab has nothing to keep: drop it entirely rather than re-create it on wake.
    if (c.slab && c.allocations.empty()) s.dispose_chunk(c);
  }
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
        s.drop_backups(*c, lo, hi);
        r.bytes_discarded += held;
      }
    }
    c->level = level;
    ++r.chunks;
  }
  r.phases.push_back({"release", since(t)});
  r.seconds = since(start);
  log::info("sleep level {}: {} chunks, {} bytes offloaded, {} discarded, {} released in {:.3f} s", level, r.chunks,
            r.bytes_offloaded, r.bytes_discarded, r.bytes_released, r.seconds);
  return r;
}

TransitionReport Pool::wake_tags(const std::vector<std::string>& tags) {
  State& s = *state_;
  std::lock_guard lock(s.mu);
  TransitionReport r;
  r.operation = "wake_up";
  r.tags = tags;
  auto start = clock_type::now();
  s.retry_pending_releases();

  std::vector<Chunk*> asleep;
  for (auto& [va, c] : s.chunks)
    if (!c->awake && contains(tags, c->tag)) asleep.push_back(c.get());

  std::vector<Chunk*> pending;  // mapped, restore enqueued, not yet synchronized
  Chunk* failing = nullptr;     // mapped, restore partly enqueued
  double map_seconds = 0;
  auto rollback = [&](Chunk& c) noexcept {
    try {
      s.driver.unmap(c.va, c.bytes);
    } catch (const std::exception& e) {
      log::error("wake_up: unmapping chunk {:#x} after a failure failed: {}", c.va, e.what());
    }
    s.release_or_defer(c.handle);
    c.handle = {};
    c.awake = false;
  };
  try {
    for (Chunk* c : asleep) {
      auto t = clock_type::now();
      c->handle = s.map_new_memory(c->va, c->bytes, c->tag);  // rolls itself back on failure
      map_seconds += since(t);
      failing = c;
      for (auto& [off, b] : c->backups) {
        s.driver.copy_async(reinterpret_cast<void*>(c->va + off), b.host, b.bytes, s.stream);
        r.bytes_restored += b.bytes;
      }
      if (options_.fill_on_wake != FillOnWake::none) {
        std::uint8_t v = options_.fill_on_wake == FillOnWake::zero ? 0 : poison_byte;
        for_each_discarded(*c, [&](std::size_t lo, std::size_t hi) {
          s.driver.fill_async(c->va + lo, v, hi - lo, s.stream);
          r.bytes_filled += hi - lo;
        });
      }
      failing = nullptr;
      pending.push_back(c);
      r.bytes_mapped += c->bytes;
    }
    s.driver.stream_synchronize(s.stream);
  } catch (...) {
    bool synced = false;
    try {
      s.driver.stream_synchronize(s.stream);
      synced = true;
    } catch (const std::exception& e) {
      log::error("wake_up: synchronize after a failure failed: {}", e.what());
    }
    if (failing != nullptr) rollback(*failing);
    for (Chunk* c : pending) {
      if (synced) {
        c->awake = true;
        s.drop_all_backups(*c);
      } else {
        rollback(*c);
      }
    }
    for (const auto& t : tags) {
      bool any_asleep = false;
      for (auto& [va, c] : s.chunks)
        if (c->tag == t && !c->awake) any_asleep = true;
      if (!any_asleep) s.tags[t] = TagState{};
    }
    throw;
  }
  for (Chunk* c : pending) {
    c->awake = true;
    s.drop_all_backups(*c);
    ++r.chunks;
  }
  for (const auto& t : tags) s.tags[t] = TagState{};
  r.seconds = since(start);
  r.phases.push_back({"map", map_seconds});
  r.phases.push_back({"restore", std::max(0.0, r.seconds - map_seconds)});
  log::info("wake_up: {} chunks, {} bytes mapped, {} restored in {:.3f} s", r.chunks, r.bytes_mapped, r.bytes_restored,
            r.seconds);
  return r;
}

}  // namespace torpor
