// Wake, the engine's top level: wake_tags runs plan groups -> map pipeline (wake_pipeline.hpp)
// -> apply or roll back, under the pool's lock for its whole duration.
//
// Apply: the groups whose restores were enqueued and synchronized are awake; their backups
// become retained copies (skip_unchanged; trusted again only after the next sleep hashes the
// device bytes) or go back to the store, and only after that one synchronize. Roll back: every
// other group the map thread mapped is unmapped again and stays asleep with its backups. A tag is
// awake once none of its chunks sleeps. After a failure the call throws; a repeat wakes the rest.
#include <chrono>
#include <exception>

#include "pool/pool_state.hpp"
#include "pool/wake_pipeline.hpp"
#include "torpor/log.hpp"
#include "torpor/pool.hpp"

namespace torpor {

namespace {

void wake_chunk(Pool::State& s, Chunk& c, TransitionReport& r) {
  c.awake = true;
  if (s.options.skip_unchanged) {
    s.drop_all_copies(c.retained);
    c.retained = std::move(c.backups);
    c.backups.clear();
  } else {
    s.drop_all_copies(c.backups);
  }
  r.bytes_mapped += c.bytes;
  ++r.chunks;
}

void apply_or_roll_back(Pool::State& s, const std::vector<WakeGroup>& groups, const WakePipeline& pipeline,
                        TransitionReport& r) {
  for (std::size_t g = 0; g < groups.size(); ++g) {
    if (!pipeline.mapped(g)) continue;  // never mapped, or rolled back by the map thread
    for (Chunk* c : groups[g]) {
      if (pipeline.restored(g))
        wake_chunk(s, *c, r);
      else
        c->drop_mapping(s.memory);
    }
  }
}

void settle_woken_tags(Pool::State& s, const std::vector<std::string>& tags) {
  for (const auto& t : tags) {
    bool any_asleep = false;
    for (auto& [va, c] : s.chunks)
      if (c->tag == t && !c->awake) any_asleep = true;
    if (!any_asleep) s.tags[t] = TagState{};
  }
}

[[noreturn]] void report_failure(const Pool::State& s, const std::vector<std::string>& tags,
                                 const WakePipeline& pipeline, const TransitionReport& r) {
  std::size_t still_asleep = 0;
  for (auto& [va, c] : s.chunks)
    if (!c->awake && has_tag(tags, c->tag)) ++still_asleep;
  log::warn("wake_up: failed; {} chunks woke, {} stay asleep with their backups", r.chunks, still_asleep);
  std::rethrow_exception(pipeline.error());
}

}  // namespace

TransitionReport Pool::wake_tags(const std::vector<std::string>& tags) {
  using clock_type = std::chrono::steady_clock;
  State& s = *state_;
  std::lock_guard lock(s.mu);
  TransitionReport r;
  r.operation = "wake_up";
  r.tags = tags;
  auto start = clock_type::now();
  s.retry_pending_releases();

  std::vector<WakeGroup> groups = plan_wake_groups(s, tags);
  WakePipeline pipeline(s, groups, r);
  pipeline.run();
  apply_or_roll_back(s, groups, pipeline, r);
  settle_woken_tags(s, tags);
  if (pipeline.error()) report_failure(s, tags, pipeline, r);

  r.seconds = std::chrono::duration<double>(clock_type::now() - start).count();
  r.phases.push_back({"map", pipeline.map_seconds()});
  r.phases.push_back({"map_and_restore", r.seconds});
  log::info("wake_up: {} chunks, {} bytes mapped, {} restored in {:.3f} s", r.chunks, r.bytes_mapped, r.bytes_restored,
            r.seconds);
  return r;
}

}  // namespace torpor
