// Wake, the engine's top level: wake_tags runs plan groups -> map pipeline (wake_pipeline.hpp)
// -> apply or roll back, under the pool's lock for its whole duration.
//
// Verify: backups that were trusted at their sleep (retained copies not copied again) and every
// backup on disk (the spill file can change while it waits there) are hashed on the device once
// restored and compared with the hash of the bytes they were made from (HostCopy); a mismatch
// is filled with the poison pattern instead of handed back, its copy is dropped, and the call
// throws naming the allocations and the tag.
//
// Apply: the groups whose restores were enqueued and synchronized are awake; their backups
// become retained copies (skip_unchanged; trusted again only after the next sleep hashes the
// device bytes) or go back to the store, and only after that one synchronize. Roll back: every
// other group the map thread mapped is unmapped again and stays asleep with its backups; a chunk
// whose unmap fails there is woken instead, or left stranded (chunk.hpp). A tag is awake once
// none of its chunks sleeps. After a failure the call throws; a repeat wakes the rest.
#include <fmt/core.h>

#include <chrono>
#include <exception>
#include <optional>
#include <set>

#include "pool/pool_state.hpp"
#include "pool/wake_pipeline.hpp"
#include "torpor/error.hpp"
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

// A chunk that holds a mapping but whose group was not restored goes back to sleep: unmapped,
// asleep with its backups. If the unmap fails it must not be marked asleep as if nothing were
// mapped: it is woken instead (restored now from its backups, which are still there); if that
// fails too it stays asleep and stranded (still mapped, counted as mapped, its bytes in its
// backups), and the next wake reuses the mapping while the next sleep or trim retries the unmap.
// `drained`: the device finished every restore and fill queued on the chunk; without it the
// memory is not unmapped under queued work (the chunk stays stranded, as above).
void settle_unrestored(Pool::State& s, WakePipeline& pipeline, Chunk& c, bool drained, TransitionReport& r) {
  if (!drained) {
    log::error("wake_up: chunk {:#x} stays asleep but mapped: its queued restores could not be waited for", c.va);
    return;
  }
  if (c.drop_mapping(s.memory)) return;
  if (pipeline.restore_now(c)) {
    log::warn("wake_up: chunk {:#x} could not be unmapped in the rollback; it was woken instead", c.va);
    wake_chunk(s, c, r);
    return;
  }
  log::error("wake_up: chunk {:#x} stays asleep but mapped (its bytes are in its backups); the next wake reuses the "
             "mapping, the next sleep or trim unmaps it",
             c.va);
}

// What verify_trusted_restores found.
struct Verification {
  std::vector<std::string> corrupted;  // one line per bad copy: the range, its allocations, the tag
  std::set<const Chunk*> unfinished;   // bad copies whose poison fill failed: these chunks go back to sleep
  std::exception_ptr error;            // a driver call of the verification failed
};

std::string allocations_in(const Chunk& c, std::size_t lo, std::size_t hi) {
  std::string out;
  for (auto& [aoff, a] : c.allocations) {
    if (a->offset >= hi || a->offset + a->bytes <= lo) continue;
    std::string name = a->segments.begin()->second.name;
    out += fmt::format("{}{:#x}{}", out.empty() ? "" : ", ", a->base, name.empty() ? "" : fmt::format(" '{}'", name));
  }
  return out.empty() ? std::string("no live allocation") : "allocation(s) " + out;
}

void verify_trusted_restores(Pool::State& s, const std::vector<WakeGroup>& groups, const WakePipeline& pipeline,
                             TransitionReport& r, Verification& v) {
  struct Checked {
    Chunk* chunk;
    std::size_t offset;
  };
  std::vector<HashRange> ranges;
  std::vector<Checked> which;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    if (!pipeline.mapped(g) || !pipeline.restored(g)) continue;
    for (Chunk* c : groups[g])
      for (auto& [off, b] : c->backups)
        if (b.hashed && (b.trusted || b.span.tier == HostTier::disk)) {
          ranges.push_back(HashRange{reinterpret_cast<const void*>(c->va + off), b.bytes});
          which.push_back({c, off});
        }
  }
  if (ranges.empty()) return;
  std::vector<Hash128> hashes(ranges.size());
  std::vector<Checked> bad;
  try {
    s.driver.hash(ranges, hashes.data(), s.streams[0]);
    for (std::size_t i = 0; i < ranges.size(); ++i) {
      r.bytes_hashed += ranges[i].bytes;
      if (hashes[i] == which[i].chunk->backups.at(which[i].offset).hash) continue;
      bad.push_back(which[i]);
      s.driver.fill_async(which[i].chunk->va + which[i].offset, poison_byte, ranges[i].bytes, s.streams[0]);
    }
    if (!bad.empty()) s.driver.stream_synchronize(s.streams[0]);
  } catch (...) {
    v.error = std::current_exception();
    for (const Checked& b : bad) v.unfinished.insert(b.chunk);  // not known to be overwritten: back to sleep
  }
  for (const Checked& b : bad) {
    Chunk& c = *b.chunk;
    HostCopy& copy = c.backups.at(b.offset);
    std::string where = copy.span.tier == HostTier::disk && s.host.has_disk_tier()
                            ? fmt::format(", kept on disk in {}", s.host.spill_of(copy.span.ptr).path())
                            : std::string();
    v.corrupted.push_back(fmt::format("[{:#x}, +{}) of tag '{}' ({}){}", c.va + b.offset, copy.bytes, c.tag,
                                      allocations_in(c, b.offset, b.offset + copy.bytes), where));
    if (v.unfinished.count(&c)) continue;  // keeps the copy: the next wake checks it again
    s.free_span(copy.span);
    c.backups.erase(b.offset);
  }
}

// Before a rollback unmaps anything: restores and fills may still be queued after a failed
// issue or synchronize. False (logged) when the device could not be synchronized.
bool drain_device(Pool::State& s) noexcept {
  try {
    s.driver.device_synchronize(s.options.device);
    return true;
  } catch (const std::exception& e) {
    log::error("wake_up: synchronizing the device before the rollback failed: {}", e.what());
    return false;
  }
}

void apply_or_roll_back(Pool::State& s, const std::vector<WakeGroup>& groups, WakePipeline& pipeline,
                        const Verification& v, TransitionReport& r) {
  std::optional<bool> drained;  // asked once, when the first chunk needs a rollback
  for (std::size_t g = 0; g < groups.size(); ++g) {
    bool restored = pipeline.mapped(g) && pipeline.restored(g);
    for (Chunk* c : groups[g]) {
      if (restored && !v.unfinished.count(c))
        wake_chunk(s, *c, r);
      else if (c->handle) {  // mapped by the map thread, or left mapped by its own rollback
        if (!drained) drained = drain_device(s);
        settle_unrestored(s, pipeline, *c, *drained, r);
      }
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
  Verification verification;
  verify_trusted_restores(s, groups, pipeline, r, verification);
  apply_or_roll_back(s, groups, pipeline, verification, r);
  settle_woken_tags(s, tags);
  if (pipeline.error()) report_failure(s, tags, pipeline, r);
  if (verification.error) std::rethrow_exception(verification.error);
  if (!verification.corrupted.empty()) {
    std::string what;
    for (const auto& c : verification.corrupted) what += "; " + c;
    throw error(fmt::format("wake_up: {} host cop{} changed while kept (the restored bytes do not hash as the bytes "
                            "copied); they were not restored: the range holds the poison pattern{}",
                            verification.corrupted.size(), verification.corrupted.size() == 1 ? "y" : "ies", what));
  }

  r.seconds = std::chrono::duration<double>(clock_type::now() - start).count();
  r.phases.push_back({"map", pipeline.map_seconds()});
  r.phases.push_back({"map_and_restore", r.seconds});
  log::info("wake_up: {} chunks, {} bytes mapped, {} restored in {:.3f} s", r.chunks, r.bytes_mapped, r.bytes_restored,
            r.seconds);
  return r;
}

}  // namespace torpor
