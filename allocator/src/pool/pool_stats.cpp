// Pool::stats(): the pool's and each tag's figures, summed chunk by chunk under the pool's lock,
// so one call sees one consistent state (PoolStats and TagStats in pool.hpp say what each
// figure counts).
#include "pool/pool_state.hpp"
#include "torpor/pool.hpp"

namespace torpor {

namespace {

// One chunk's share of the pool's and its tag's figures.
void add_chunk_stats(const Chunk& c, PoolStats& st, TagStats& x) {
  ++x.chunks;
  ++st.chunks;
  x.reserved_bytes += c.bytes;
  for (auto& [off, r] : c.retained) {
    st.retained_bytes += r.bytes;
    st.host_copies_bytes += r.span.bytes;
  }
  for (auto& [off, b] : c.backups) st.host_copies_bytes += b.span.bytes;
  if (c.handle) {  // awake, or stranded: still mapped
    x.mapped_bytes += c.bytes;
    st.mapped_bytes += c.bytes;
  }
  if (c.awake) {
    if (c.allocations.empty()) st.cached_bytes += c.bytes;
  } else {
    x.level = std::max(x.level, static_cast<int>(c.level));
  }
  for (auto& [off, a] : c.allocations) {
    ++x.allocations;
    ++st.allocations;
    x.allocated_bytes += a->bytes;
    for (auto& [start, seg] : a->segments) {
      ClassStats& cs = x.classes[static_cast<std::size_t>(seg.cls)];
      std::size_t len = seg.end - start;
      cs.allocated_bytes += len;
      if (c.awake) continue;
      std::size_t kept = c.backed_bytes(a->offset + start, a->offset + seg.end);
      cs.offloaded_bytes += kept;
      cs.discarded_bytes += len - kept;
      x.offloaded_bytes += kept;
      x.discarded_bytes += len - kept;
    }
  }
}

}  // namespace

PoolStats Pool::stats() const {
  State& s = *state_;
  std::lock_guard lock(s.mu);
  PoolStats st;
  st.device = options_.device;
  st.backend = std::string(driver_.backend_name());
  st.va_bytes = options_.va_bytes;
  st.va_used_bytes = s.va.used_bytes();
  st.granularity = granularity_;
  HostStoreStats hs = s.host.stats();
  st.host_store_bytes = hs.pinned_bytes + hs.pinning_bytes + hs.pageable_bytes;
  st.host_store_pinned_bytes = hs.pinned_bytes;
  st.host_store_pinning_bytes = hs.pinning_bytes;
  st.host_store_pageable_bytes = hs.pageable_bytes;
  st.host_store_used_bytes = hs.used_bytes;
  st.spill_bytes = hs.disk_bytes;
  st.spill_used_bytes = hs.disk_used_bytes;
  st.host_registration_refused = hs.registration_refused;
  st.host_store_budget_bytes = hs.budget_bytes;
  st.host_store_budget_source = hs.budget_source;
  st.host_cgroup_limit_bytes = hs.cgroup_limit;
  st.host_memlock_limit_bytes = hs.memlock_limit;
  st.host_memlock_charged = hs.memlock_charged;
  st.host_store_capped = hs.capped;
  st.host_numa_node = hs.numa_node;
  st.host_numa_placement = hs.numa_reason;
  if (const SpillStore* spill = s.host.spill()) {
    st.spill_path = spill->path();
    st.spill_direct_io = spill->direct_io();
  } else if (s.host.has_disk_tier()) {
    st.spill_path = s.options.spill_dir;  // a file per allocation there: the directory
  }
  st.pending_releases = s.memory.pending();
  for (auto& [va, n] : s.address_ranges) st.address_ranges_bytes += n;
  std::map<std::string, TagStats, std::less<>> by_tag;
  for (auto& [t, ts] : s.tags) {
    TagStats& x = by_tag[t];
    x.tag = t;
    x.asleep = ts.asleep;
  }
  for (auto& [va, c] : s.chunks) add_chunk_stats(*c, st, by_tag[c->tag]);
  for (auto& [t, x] : by_tag) st.tags.push_back(std::move(x));
  return st;
}

}  // namespace torpor
