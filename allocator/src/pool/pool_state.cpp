// Pool::State's helpers: chunk creation and disposal, host copies, the survival rule (asked of
// sleep_policy.hpp), tag resolution. The invariants they keep are in pool_state.hpp.
#include "pool/pool_state.hpp"

#include <fmt/core.h>
#include <fnmatch.h>

#include <algorithm>

#include "common/options.hpp"
#include "pool/sleep_policy.hpp"
#include "pool/store/host_topology.hpp"
#include "torpor/error.hpp"
#include "torpor/log.hpp"

namespace torpor {

Chunk& Pool::State::new_chunk(std::size_t bytes, const std::string& tag, MemoryClass cls, ChunkKind kind) {
  auto c = std::make_unique<Chunk>();  // before anything that would need undoing
  auto off = va.allocate(bytes, granularity);
  if (!off)
    throw out_of_memory(fmt::format(
        "pool VA reservation exhausted: {} bytes for tag '{}' do not fit ({} of {} bytes free, largest hole {}); "
        "raise PoolOptions::va_bytes",
        bytes, tag, va.free_bytes(), va.capacity(), va.largest_free()));
  c->va = va_base + *off;
  c->bytes = bytes;
  c->tag = tag;
  c->cls = cls;
  c->kind = kind;
  try {
    c->map_new(memory);
  } catch (...) {
    if (c->handle) {
      // Set access failed and so did the unmap: the span stays mapped, so it must not be handed
      // out again; the handle goes (the memory lives until the reservation is freed).
      log::error("pool: a new chunk at {:#x} could not be unmapped after a failure; its {} bytes of address space "
                 "are lost",
                 c->va, bytes);
      memory.release_or_defer(c->handle, c->va);
    } else {
      va.free(*off, bytes);
    }
    throw;
  }
  if (c->slab()) c->space = RangeAllocator(bytes);
  Chunk& ref = *c;
  chunks[ref.va] = std::move(c);
  return ref;
}

void Pool::State::dispose_chunk(Chunk& c) {
  if (c.handle) c.unmap_and_release(memory);  // awake or stranded; may throw: then nothing changed
  drop_all_copies(c.backups);
  drop_all_copies(c.retained);
  va.free(c.va - va_base, c.bytes);
  chunks.erase(c.va);
}

void Pool::State::free_span(const HostSpan& span) noexcept {
  try {
    host.free(span.ptr, span.bytes);
  } catch (const std::exception& e) {
    log::error("pool: freeing a host copy failed: {}", e.what());
  }
}

void Pool::State::drop_all_copies(std::map<std::size_t, HostCopy>& copies) noexcept {
  for (auto& [off, c] : copies) free_span(c.span);
  copies.clear();
}

void Pool::State::drop_copies(std::map<std::size_t, HostCopy>& copies, std::size_t lo, std::size_t hi) {
  if (lo >= hi) return;
  auto it = copies.upper_bound(lo);
  if (it != copies.begin()) --it;
  while (it != copies.end() && it->first < hi) {
    std::size_t start = it->first;
    HostCopy c = it->second;
    std::size_t end = start + c.bytes;
    if (end <= lo) {
      ++it;
      continue;
    }
    it = copies.erase(it);
    std::size_t cut_lo = std::max(lo, start);
    std::size_t cut_hi = std::min(hi, end);
    // Left piece keeps [start, cut_lo); right piece keeps [cut_hi, end) plus the store's
    // rounding slack; the middle goes back to the store. Split pieces lose their hash.
    std::size_t slack = c.span.bytes - c.bytes;
    auto sub = [&](std::size_t from, std::size_t n) { return HostSpan{c.span.ptr + (from - start), n, c.span.tier}; };
    if (cut_lo > start)
      copies[start] = HostCopy{cut_lo - start, sub(start, cut_lo - start), {}, false, {}, false, false};
    if (cut_hi < end) {
      copies[cut_hi] = HostCopy{end - cut_hi, sub(cut_hi, end - cut_hi + slack), {}, false, {}, false, false};
      free_span(sub(cut_lo, cut_hi - cut_lo));
    } else {
      free_span(sub(cut_lo, cut_hi - cut_lo + slack));
    }
    it = copies.lower_bound(cut_hi);
  }
}

void Pool::State::retry_stranded_mappings() noexcept {
  for (auto& [va, c] : chunks) {
    if (!c->stranded()) continue;
    try {
      c->unmap_and_release(memory);
    } catch (const std::exception& e) {
      log::warn("pool: chunk {:#x} is asleep but still mapped; unmapping it failed again: {}", va, e.what());
    }
  }
}

Event Pool::State::event(std::size_t i) {
  while (events.size() <= i) events.push_back(driver.event_create(options.device));
  return events[i];
}

bool Pool::State::preserved(const Segment& s) const {
  for (const auto& g : preserve)
    if (::fnmatch(g.c_str(), s.name.c_str(), 0) == 0) return true;
  return false;
}

bool Pool::State::survives(const Segment& s, SleepLevel level) const {
  return torpor::survives(segment_fate(s.cls, level), [&] { return preserved(s); });
}

Allocation* Pool::State::containing(device_ptr p) const {
  auto up = allocations.upper_bound(p);
  if (up == allocations.begin()) return nullptr;
  Allocation* a = std::prev(up)->second.get();
  return p < a->base + a->bytes ? a : nullptr;
}

HostStoreOptions Pool::State::host_store_options(const PoolOptions& o, Driver& d) {
  HostStoreOptions h;
  h.device = o.device;
  h.pinned_limit = o.host_store_limit;
  h.pin_block_bytes = o.host_pin_block_bytes;
  h.pin_threads = o.host_pin_threads;
  h.spill_dir = o.spill_dir;
  h.spill_limit = o.spill_limit;
  h.spill_try_direct_io = o.spill_try_direct_io;
  h.spill_file_per_span = o.spill_file_per_allocation;
  h.sys_root = options::sysfs_root();
  h.memlock_charged = d.capabilities().host_register_charged_to_memlock;
  const NumaPlacement numa = numa_placement(h.sys_root, d.device_properties(o.device).pci_bus_id);
  h.numa_node = numa.node;
  h.numa_reason = numa.reason;
  if (numa.node >= 0) log::info("pool: device {}: host store on NUMA node {} ({})", o.device, numa.node, numa.reason);
  return h;
}

std::vector<std::string> Pool::State::resolve_tags(const std::vector<std::string>& requested,
                                                   const char* operation) const {
  std::vector<std::string> out;
  if (requested.empty()) {
    for (auto& [t, s] : tags) out.push_back(t);
    return out;
  }
  for (const auto& t : requested) {
    if (!tags.count(t)) {
      std::string known;
      for (auto& [k, s] : tags) known += fmt::format("{}'{}'", known.empty() ? "" : ", ", k);
      throw invalid_argument(fmt::format("{}: unknown tag '{}' (known tags: {})", operation, t,
                                         known.empty() ? std::string("none yet") : known));
    }
    if (std::find(out.begin(), out.end(), t) == out.end()) out.push_back(t);
  }
  return out;
}

bool Pool::State::has_mapped_chunk(const std::string& tag) const {
  for (const auto& [va, c] : chunks)
    if (c->tag == tag && c->awake) return true;
  return false;
}

bool Pool::State::fully_mapped(const std::string& tag) const {
  auto it = tags.find(tag);
  if (it != tags.end() && it->second.asleep) return false;
  for (const auto& [va, c] : chunks)
    if (c->tag == tag && !c->awake) return false;
  return true;
}

}  // namespace torpor
