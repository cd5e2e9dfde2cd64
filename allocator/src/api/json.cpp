// JSON forms of stats and reports, for `--json` in the CLI and for the C API (which the
// Python package reads). Field names match the C++ members.
#include <nlohmann/json.hpp>

#include "torpor/pool.hpp"

namespace torpor {

std::string to_json(const PoolStats& st, int indent) {
  nlohmann::json j;
  j["device"] = st.device;
  j["backend"] = st.backend;
  j["va_bytes"] = st.va_bytes;
  j["va_used_bytes"] = st.va_used_bytes;
  j["granularity"] = st.granularity;
  j["mapped_bytes"] = st.mapped_bytes;
  j["cached_bytes"] = st.cached_bytes;
  j["chunks"] = st.chunks;
  j["allocations"] = st.allocations;
  j["host_store_bytes"] = st.host_store_bytes;
  j["host_store_pinned_bytes"] = st.host_store_pinned_bytes;
  j["host_store_pinning_bytes"] = st.host_store_pinning_bytes;
  j["host_store_pageable_bytes"] = st.host_store_pageable_bytes;
  j["host_store_used_bytes"] = st.host_store_used_bytes;
  j["retained_bytes"] = st.retained_bytes;
  j["spill_bytes"] = st.spill_bytes;
  j["spill_used_bytes"] = st.spill_used_bytes;
  j["spill_path"] = st.spill_path;
  j["spill_direct_io"] = st.spill_direct_io;
  j["host_registration_refused"] = st.host_registration_refused;
  j["pending_releases"] = st.pending_releases;
  j["address_ranges_bytes"] = st.address_ranges_bytes;
  j["tags"] = nlohmann::json::object();
  for (const auto& t : st.tags) {
    nlohmann::json x;
    x["asleep"] = t.asleep;
    x["level"] = t.level;
    x["chunks"] = t.chunks;
    x["allocations"] = t.allocations;
    x["allocated_bytes"] = t.allocated_bytes;
    x["reserved_bytes"] = t.reserved_bytes;
    x["mapped_bytes"] = t.mapped_bytes;
    x["offloaded_bytes"] = t.offloaded_bytes;
    x["discarded_bytes"] = t.discarded_bytes;
    for (std::size_t c = 0; c < memory_class_count; ++c) {
      const ClassStats& cs = t.classes[c];
      x["classes"][std::string(to_string(static_cast<MemoryClass>(c)))] = {{"allocated_bytes", cs.allocated_bytes},
                                                                           {"offloaded_bytes", cs.offloaded_bytes},
                                                                           {"discarded_bytes", cs.discarded_bytes}};
    }
    j["tags"][t.tag] = x;
  }
  return j.dump(indent);
}

std::string to_json(const TransitionReport& r, int indent) {
  nlohmann::json j;
  j["operation"] = r.operation;
  j["level"] = r.level;
  j["tags"] = r.tags;
  j["chunks"] = r.chunks;
  j["bytes_offloaded"] = r.bytes_offloaded;
  j["bytes_skipped"] = r.bytes_skipped;
  j["bytes_hashed"] = r.bytes_hashed;
  j["bytes_staged"] = r.bytes_staged;
  j["bytes_spilled"] = r.bytes_spilled;
  j["pieces"] = r.pieces;
  j["bytes_discarded"] = r.bytes_discarded;
  j["bytes_released"] = r.bytes_released;
  j["bytes_mapped"] = r.bytes_mapped;
  j["bytes_restored"] = r.bytes_restored;
  j["bytes_filled"] = r.bytes_filled;
  j["seconds"] = r.seconds;
  j["phases"] = nlohmann::json::object();
  for (const auto& p : r.phases) j["phases"][p.name] = p.seconds;
  return j.dump(indent);
}

}  // namespace torpor
