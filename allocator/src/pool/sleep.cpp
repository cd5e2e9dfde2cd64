// Sleep, the engine's top level: Pool::sleep and Pool::wake_up run the engine between the
// observers' before and after calls; sleep_tags runs plan -> offload pipeline -> apply or
// roll back, under the pool's lock for its whole duration:
//
//   1. wait for the device work that may touch the memory (device_synchronize);
//   2. plan (sleep_plan.hpp): what survives the level (sleep_policy.hpp), in pieces;
//   3. offload pipeline (offload_pipeline.hpp): release workers unmap the chunks with nothing to
//      keep at once, while this thread places the host spans (retained copies lent, host space
//      reserved), then hashes the other chunks group by group, matches them against their
//      retained copies and issues their copies in pieces on the copy streams; the workers unmap
//      each chunk once its copies are done;
//   4. apply: the released chunks are asleep with their backups; empty slabs are dropped rather
//      than re-created on wake; a chunk asleep at a shallower level drops the backups the deeper
//      level does not keep (level 2 asked of a chunk at level 1; 1 asked of 2 changes nothing).
//
// Roll back: a failure in 1-2 leaves every chunk awake as it was. A failure in the pipeline
// (placing the spans, a hash, a copy, an unmap) stops it at a chunk boundary: the chunks
// released so far are asleep with their backups (those with nothing to keep may be among
// them), the others stay awake with their bytes and their new spans go back to the store once
// no copy writes into them. A tag none of whose chunks fell asleep is as it was. The call throws
// and a repeat completes the sleep. Wake is in wake.cpp.
#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <map>

#include "pool/offload_pipeline.hpp"
#include "pool/pool_state.hpp"
#include "pool/sleep_plan.hpp"
#include "pool/tag_hooks.hpp"
#include "torpor/error.hpp"
#include "torpor/log.hpp"
#include "torpor/pool.hpp"

namespace torpor {

namespace {

using clock_type = std::chrono::steady_clock;

double since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }

SleepLevel checked_level(int level) {
  if (level < 0 || level > 2) throw invalid_argument(fmt::format("sleep: level {} is not 0, 1 or 2", level));
  return static_cast<SleepLevel>(level);
}

// Runs `op` between the observers' before and after calls (the rules are SleepObserver's).
// Every observer whose before call returned is told the outcome exactly once: after(false) when
// a before call or the operation threw, else after(true), every observer even when one of them
// throws (the first such exception is rethrown once all were told; the pool's own operation
// succeeded, so it is never reported as failed).
template <typename Before, typename Op, typename After>
TransitionReport observed(const std::vector<SleepObserver*>& observers, Before before, Op op, After after,
                          const char* operation, const char* noun) {
  std::size_t notified = 0;
  TransitionReport r;
  try {
    for (SleepObserver* o : observers) {
      before(*o);
      ++notified;
    }
    r = op();
  } catch (...) {
    for (std::size_t i = 0; i < notified; ++i) {
      try {
        after(*observers[i], false);
      } catch (const std::exception& e) {
        log::error("{}: an observer failed to recover after a failed {}: {}", operation, noun, e.what());
      }
    }
    throw;
  }
  std::exception_ptr first;
  for (SleepObserver* o : observers) {
    try {
      after(*o, true);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
  return r;
}

// The tags' state across one sleep: asleep from the start (allocating into them is refused);
// after a failure, a tag none of whose chunks fell asleep is as it was.
class SleepingTags {
 public:
  SleepingTags(Pool::State& s, const std::vector<std::string>& tags, SleepLevel level) : s_(s), tags_(tags) {
    for (const auto& t : tags) {
      previous_[t] = s.tags[t];
      TagState& ts = s.tags[t];
      ts.asleep = true;
      ts.level = std::max(ts.level, level);
    }
  }

  void settle_after_failure() {
    for (const auto& t : tags_) {
      bool any_asleep = false;
      for (auto& [va, c] : s_.chunks)
        if (c->tag == t && !c->awake) any_asleep = true;
      if (!any_asleep && !previous_[t].asleep) s_.tags[t] = previous_[t];
    }
  }

 private:
  Pool::State& s_;
  const std::vector<std::string>& tags_;
  std::map<std::string, TagState> previous_;
};

// Apply: the released chunks are asleep; the plan's spans move into their backups.
void put_released_to_sleep(SleepPlan& plan, const OffloadPipeline& pipeline, TransitionReport& r) {
  for (std::size_t k = 0; k < plan.chunks.size(); ++k) {
    if (!pipeline.released(k)) continue;
    ChunkPlan& cp = plan.chunks[k];
    Chunk& c = *cp.chunk;
    c.awake = false;
    c.level = plan.level;
    for (auto& p : cp.pieces) {
      c.backups[p.offset] = HostCopy{p.bytes, p.span, p.hash, p.hashed, p.sample, p.sampled, p.skip};
      p.span = {};
    }
    r.bytes_released += c.bytes;
    r.bytes_discarded += cp.discarded;
    ++r.chunks;
  }
}

// Roll back after a pipeline failure: the chunks that were not released stay awake. No copy
// may still write into the spans given back here, hence the synchronize first.
[[noreturn]] void roll_back_unreleased(Pool::State& s, SleepPlan& plan, const OffloadPipeline& pipeline,
                                       SleepingTags& tags) {
  for (Stream st : s.streams) {
    try {
      s.driver.stream_synchronize(st);
    } catch (const std::exception& e) {
      log::error("sleep: synchronize after a failure failed: {}", e.what());
    }
  }
  plan.free_spans(s);  // released chunks' spans already moved into their backups
  tags.settle_after_failure();
  std::size_t first_awake = 0;
  while (first_awake < plan.chunks.size() && pipeline.released(first_awake)) ++first_awake;
  log::warn("sleep: stopped at chunk {} of {}; earlier chunks are asleep, the rest awake", first_awake,
            plan.chunks.size());
  std::rethrow_exception(pipeline.error());
}

// Empty slabs have nothing to keep: drop them rather than re-create them on wake.
void dispose_empty_slabs(Pool::State& s, const SleepPlan& plan) {
  for (const ChunkPlan& cp : plan.chunks)
    if (cp.chunk->slab() && cp.chunk->allocations.empty()) s.dispose_chunk(*cp.chunk);
}

// Chunks asleep at a shallower level drop the backups the plan's level does not keep.
void deepen(Pool::State& s, const SleepPlan& plan, TransitionReport& r) {
  for (Chunk* c : plan.deepen) {
    for (auto& [aoff, a] : c->allocations) {
      for (auto& [segstart, seg] : a->segments) {
        if (s.survives(seg, plan.level)) continue;
        std::size_t lo = a->offset + segstart, hi = a->offset + seg.end;
        r.bytes_discarded += c->backed_bytes(lo, hi);
        s.drop_copies(c->backups, lo, hi);
      }
    }
    c->level = plan.level;
    ++r.chunks;
  }
}

// The hooked tags fully mapped now, with the snapshot of hooks they were taken from.
std::pair<TagHookRegistry::Snapshot, std::vector<std::string>> hooked_tags_mapped_now(Pool::State& s) {
  TagHookRegistry::Snapshot hooks = s.tag_hooks.snapshot();
  std::vector<std::string> mapped;
  {
    std::lock_guard lock(s.mu);
    for (const auto& t : TagHookRegistry::tags_of(hooks))
      if (s.fully_mapped(t)) mapped.push_back(t);
  }
  return {std::move(hooks), std::move(mapped)};
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Public entry points: tag hooks and observers around the engine (the rules are TagHooks' and
// SleepObserver's in pool.hpp).

TransitionReport Pool::sleep(int level, const std::vector<std::string>& requested) {
  return sleep(checked_level(level), requested);
}

TransitionReport Pool::sleep(SleepLevel level, const std::vector<std::string>& requested) {
  const int number = static_cast<int>(level);
  checked_level(number);  // a SleepLevel cast from a bad number
  std::vector<std::string> tags;
  std::vector<SleepObserver*> observers;
  TagHookRegistry::Snapshot hooks = state_->tag_hooks.snapshot();
  std::vector<std::string> unmapping;  // hooked tags this sleep unmaps: some chunk mapped now
  {
    std::lock_guard lock(state_->mu);
    tags = state_->resolve_tags(requested, "sleep");
    if (level != SleepLevel::none) {
      observers = state_->observers;
      for (const auto& t : TagHookRegistry::tags_of(hooks))
        if (has_tag(tags, t) && state_->has_mapped_chunk(t)) unmapping.push_back(t);
    }
  }
  unmapping = TagHookRegistry::before_unmap(hooks, unmapping);
  try {
    return observed(
        observers, [&](SleepObserver& o) { o.before_sleep(*this, number, tags); },
        [&] { return sleep_tags(level, tags); },
        [&](SleepObserver& o, bool ok) { o.after_sleep(*this, number, tags, ok); }, "sleep", "sleep");
  } catch (...) {
    std::vector<std::string> mapped_again;
    {
      std::lock_guard lock(state_->mu);
      for (const auto& t : unmapping)
        if (state_->fully_mapped(t)) mapped_again.push_back(t);
    }
    TagHookRegistry::after_map(hooks, mapped_again, false);
    throw;
  }
}

void Pool::run_after_map_hooks() {
  auto [hooks, mapped] = hooked_tags_mapped_now(*state_);
  TagHookRegistry::after_map(hooks, mapped, true);
}

TransitionReport Pool::wake_up(const std::vector<std::string>& requested) {
  std::vector<std::string> tags;
  std::vector<SleepObserver*> observers;
  {
    std::lock_guard lock(state_->mu);
    tags = state_->resolve_tags(requested, "wake_up");
    observers = state_->observers;
  }
  // after_map once per wake, for the hooked tags the wake (or a failed one) left fully mapped.
  TransitionReport r;
  try {
    r = observed(
        observers, [&](SleepObserver& o) { o.before_wake(*this, tags); }, [&] { return wake_tags(tags); },
        [&](SleepObserver& o, bool ok) { o.after_wake(*this, tags, ok); }, "wake_up", "wake");
  } catch (...) {
    auto [hooks, mapped] = hooked_tags_mapped_now(*state_);
    TagHookRegistry::after_map(hooks, mapped, false);  // the wake's own error is the one to raise
    throw;
  }
  run_after_map_hooks();
  return r;
}

// ---------------------------------------------------------------------------------------------
// The engine: plan -> offload pipeline -> apply or roll back.

TransitionReport Pool::sleep_tags(SleepLevel level, const std::vector<std::string>& tags) {
  State& s = *state_;
  std::lock_guard lock(s.mu);
  TransitionReport r;
  r.operation = "sleep";
  r.level = static_cast<int>(level);
  r.tags = tags;
  if (level == SleepLevel::none) return r;
  auto start = clock_type::now();
  s.retry_pending_releases();

  SleepPlan plan = select_chunks(s, tags, level);
  SleepingTags sleeping(s, tags, level);
  try {
    auto t = clock_type::now();
    s.driver.device_synchronize(options_.device);
    r.phases.push_back({"synchronize", since(t)});
    s.retry_stranded_mappings();  // after the synchronize: no restore of a failed wake still writes
    plan_pieces(s, plan, r);
  } catch (...) {
    sleeping.settle_after_failure();
    throw;
  }

  // The chunks with nothing to keep are released while the host copies are placed and hashed.
  OffloadPipeline pipeline(s, plan, r);
  std::exception_ptr placing_failed;
  try {
    pipeline.start();
    place_host_copies(s, plan, r);
  } catch (...) {
    placing_failed = std::current_exception();
  }
  pipeline.finish(placing_failed);
  put_released_to_sleep(plan, pipeline, r);
  if (pipeline.error()) roll_back_unreleased(s, plan, pipeline, sleeping);
  dispose_empty_slabs(s, plan);
  deepen(s, plan, r);

  r.seconds = since(start);
  log::info(
      "sleep level {}: {} chunks, {} bytes offloaded, {} skipped unchanged, {} discarded, {} released in {:.3f} s",
      r.level, r.chunks, r.bytes_offloaded, r.bytes_skipped, r.bytes_discarded, r.bytes_released, r.seconds);
  return r;
}

}  // namespace torpor
