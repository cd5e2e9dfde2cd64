// JSON forms of stats and reports, for `--json` in the CLI and for the C API (which the
// Python package reads). Field names are the C++ members' own: each struct lists its scalar
// members once (nlohmann's NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE writes `"name": value` for each),
// and only what is not a plain member (tags keyed by name, classes by class name, phases by
// phase name) is written by hand. Objects keep their keys sorted, so the order of a list does
// not show in the document.
#include <nlohmann/json.hpp>

#include "torpor/pool.hpp"

namespace torpor {

NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(ClassStats, allocated_bytes, offloaded_bytes, discarded_bytes)

NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(TagStats, asleep, level, chunks, allocations, allocated_bytes, reserved_bytes,
                                   mapped_bytes, offloaded_bytes, discarded_bytes)

NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(PoolStats, device, backend, va_bytes, va_used_bytes, granularity, mapped_bytes,
                                   cached_bytes, chunks, allocations, host_store_bytes, host_store_pinned_bytes,
                                   host_store_pinning_bytes, host_store_pageable_bytes, host_store_used_bytes,
                                   retained_bytes, spill_bytes, spill_used_bytes, spill_path, spill_direct_io,
                                   host_registration_refused, host_store_budget_bytes, host_store_budget_source,
                                   host_cgroup_limit_bytes, host_memlock_limit_bytes, host_memlock_charged,
                                   host_store_capped, host_numa_node, host_numa_placement, pending_releases,
                                   address_ranges_bytes)

NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(TransitionReport, operation, level, tags, chunks, bytes_offloaded, bytes_skipped,
                                   bytes_hashed, bytes_staged, bytes_spilled, pieces, bytes_discarded, bytes_released,
                                   bytes_mapped, bytes_restored, bytes_filled, seconds)

std::string to_json(const PoolStats& st, int indent) {
  nlohmann::json j = st;
  j["tags"] = nlohmann::json::object();
  for (const auto& t : st.tags) {
    nlohmann::json x = t;
    for (std::size_t c = 0; c < memory_class_count; ++c)
      x["classes"][std::string(to_string(static_cast<MemoryClass>(c)))] = t.classes[c];
    j["tags"][t.tag] = x;
  }
  return j.dump(indent);
}

std::string to_json(const TransitionReport& r, int indent) {
  nlohmann::json j = r;
  j["phases"] = nlohmann::json::object();
  for (const auto& p : r.phases) j["phases"][p.name] = p.seconds;
  return j.dump(indent);
}

}  // namespace torpor
