// The C API's stats and reports as JSON (torpor.h): the pool's stats, its tags, the report of
// its last sleep or wake (the documents api/json.cpp writes), the backend a pool runs on, and
// what CUDA's own graph allocator holds (torpor_graph_memory_nodes / torpor_graph_memory: the
// one entry for C, Python and C++ callers, over the driver seam's cuda backend).
#include <algorithm>
#include <cstdint>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "api/c_api_internal.hpp"
#include "torpor/backend.hpp"
#include "torpor/driver.hpp"
#include "torpor/error.hpp"
#include "torpor/pool.hpp"
#include "torpor/torpor.h"

namespace {

using namespace torpor;
using namespace torpor::detail;

}  // namespace

extern "C" {

torpor_status torpor_stats_json(torpor_pool_t pool, char* buffer, size_t capacity, size_t* needed) {
  return with_pool("torpor_stats_json", pool,
                   [&](CPool& p) { write_out(to_json(p.pool->stats()), buffer, capacity, needed); });
}

torpor_status torpor_tags_json(torpor_pool_t pool, char* buffer, size_t capacity, size_t* needed) {
  return with_pool("torpor_tags_json", pool, [&](CPool& p) {
    std::vector<std::string> tags = p.pool->tags();
    std::sort(tags.begin(), tags.end());
    write_out(nlohmann::json(tags).dump(), buffer, capacity, needed);
  });
}

torpor_status torpor_last_report_json(torpor_pool_t pool, char* buffer, size_t capacity, size_t* needed) {
  return with_pool("torpor_last_report_json", pool, [&](CPool& p) {
    std::lock_guard lock(p.report_mu);
    write_out(p.last_report, buffer, capacity, needed);
  });
}

const char* torpor_pool_backend(torpor_pool_t pool) {
  try {
    auto p = find_pool(pool);
    if (p) return to_string(p->driver.backend).data();  // the backend table's names are literals
  } catch (...) {  // NOLINT(bugprone-empty-catch): reported below, as a handle that is not live
  }
  set_last_error("torpor_pool_backend: pool handle is not a live pool");
  return nullptr;
}

torpor_status torpor_graph_memory_nodes(unsigned long long graph, size_t* count) {
  return guarded("torpor_graph_memory_nodes", [&] {
    if (count == nullptr) throw invalid_argument("count is NULL");
    if (graph == 0) throw invalid_argument("graph is 0 (no captured graph)");
    *count = shared_driver(Backend::cuda).driver->graph_memory_nodes(static_cast<std::uintptr_t>(graph));
  });
}

torpor_status torpor_graph_memory(int device, unsigned long long* used, unsigned long long* reserved) {
  return guarded("torpor_graph_memory", [&] {
    if (used == nullptr || reserved == nullptr) throw invalid_argument("used or reserved is NULL");
    const GraphMemory m = shared_driver(Backend::cuda).driver->graph_memory(device);
    *used = m.used_bytes;
    *reserved = m.reserved_bytes;
  });
}

}  // extern "C"
