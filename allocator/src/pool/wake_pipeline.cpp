// The wake's plan and pipeline; the design note and invariants are in wake_pipeline.hpp.
#include "pool/wake_pipeline.hpp"

#include <algorithm>
#include <chrono>
#include <exception>
#include <thread>

#include "pool/host_copies.hpp"
#include "torpor/log.hpp"

namespace torpor {

namespace {

// A chunk whose wake copies bytes back (restores), not only maps (and maybe fills).
bool restores(const Chunk* c) { return !c->backups.empty(); }

}  // namespace

std::vector<WakeGroup> plan_wake_groups(const Pool::State& s, const std::vector<std::string>& tags) {
  std::vector<WakeGroup> groups;
  device_ptr group_end = 0;
  std::size_t group_bytes = 0;
  for (auto& [va, c] : s.chunks) {
    if (c->awake || !has_tag(tags, c->tag)) continue;
    if (groups.empty() || c->va != group_end || group_bytes + c->bytes > s.options.map_group_bytes) {
      groups.emplace_back();
      group_bytes = 0;
    }
    groups.back().push_back(c.get());
    group_end = c->va + c->bytes;
    group_bytes += c->bytes;
  }
  // The groups with restores are mapped first, so their copies run while the others are mapped.
  std::stable_partition(groups.begin(), groups.end(),
                        [](const WakeGroup& g) { return std::any_of(g.begin(), g.end(), restores); });
  return groups;
}

void WakePipeline::map_group(std::size_t g) {
  const WakeGroup& group = groups_[g];
  try {
    for (Chunk* c : group) c->remap(s_.memory);
    const Chunk& first = *group.front();
    const Chunk& last = *group.back();
    s_.memory.set_access(first.va, last.va + last.bytes - first.va);
  } catch (...) {
    for (Chunk* c : group)
      if (c->handle) c->drop_mapping(s_.memory);
    throw;
  }
}

void WakePipeline::map_loop() {
  for (std::size_t g = 0; g < groups_.size() && !stop_; ++g) {
    auto t = std::chrono::steady_clock::now();
    try {
      map_group(g);
    } catch (...) {
      map_error_ = std::current_exception();
      break;
    }
    mapped_[g] = 1;
    map_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
    ready_.push(g);
  }
  ready_.close();
}

void WakePipeline::fill_discarded(const Chunk& c, Stream stream) {
  std::uint8_t v = s_.options.fill_on_wake == FillOnWake::zero ? 0 : poison_byte;
  c.for_each_discarded([&](std::size_t lo, std::size_t hi) {
    s_.driver.fill_async(c.va + lo, v, hi - lo, stream);
    r_.bytes_filled += hi - lo;
  });
}

void WakePipeline::issue_chunk_restores(const Chunk& c, Stream stream) {
  if (!c.backups.empty() || (s_.options.fill_on_wake != FillOnWake::none && !c.allocations.empty())) mark_used(stream);
  for (auto& [off, b] : c.backups) {
    restore_from_span(s_, c.va + off, b.span, b.bytes, stream, r_);
    r_.bytes_restored += b.bytes;
  }
  if (s_.options.fill_on_wake != FillOnWake::none) fill_discarded(c, stream);
}

void WakePipeline::issue_restores(std::size_t g, Stream stream) {
  for (Chunk* c : groups_[g]) issue_chunk_restores(*c, stream);
}

bool WakePipeline::restore_now(Chunk& c) noexcept {
  try {
    s_.memory.set_access(c.va, c.bytes);
    issue_chunk_restores(c, s_.streams[0]);
    s_.driver.stream_synchronize(s_.streams[0]);
    return true;
  } catch (const std::exception& e) {
    log::error("wake_up: finishing the wake of chunk {:#x} failed: {}", c.va, e.what());
    return false;
  }
}

void WakePipeline::mark_used(Stream stream) {
  for (std::size_t i = 0; i < s_.streams.size(); ++i)
    if (s_.streams[i].value == stream.value) used_[i] = 1;
}

void WakePipeline::synchronize_streams() {
  for (std::size_t i = 0; i < s_.streams.size(); ++i) {
    if (!used_[i]) continue;  // nothing of this wake queued there: a synchronize would be a driver call for nothing
    Stream st = s_.streams[i];
    try {
      s_.driver.stream_synchronize(st);
    } catch (...) {
      synced_ = false;
      if (!sync_error_) sync_error_ = std::current_exception();
    }
  }
}

void WakePipeline::run() {
  std::thread mapper([this] { map_loop(); });
  while (auto g = ready_.pop()) {
    if (issue_error_) continue;  // drain
    try {
      issue_restores(*g, s_.streams[*g % s_.streams.size()]);
      issued_[*g] = 1;
    } catch (...) {
      issue_error_ = std::current_exception();
      stop_ = true;
    }
  }
  mapper.join();
  synchronize_streams();
}

}  // namespace torpor
