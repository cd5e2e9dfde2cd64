// The C API's shareable handles (torpor.h): the chunks of an exportable pool as POSIX fds or
// fabric handles, for symmetric memory and KV transports. A refusal exports nothing: the
// descriptors stay owned by the C++ side until every check passed, so a refusal closes them.
#include <fmt/core.h>

#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "api/c_api_internal.hpp"
#include "torpor/driver.hpp"
#include "torpor/error.hpp"
#include "torpor/pool.hpp"
#include "torpor/torpor.h"

namespace {

using namespace torpor;
using namespace torpor::detail;

}  // namespace

extern "C" {

torpor_status torpor_export_handles(torpor_pool_t pool, const char* const* tags, size_t count, int kind,
                                    torpor_chunk_export* out, size_t capacity, size_t* exported) {
  if (exported == nullptr) return fail(TORPOR_ERROR_INVALID_ARGUMENT, "torpor_export_handles: exported is NULL");
  *exported = 0;
  return with_pool("torpor_export_handles", pool, [&](CPool& p) {
    if (kind < TORPOR_HANDLE_AUTO || kind > TORPOR_HANDLE_FABRIC)
      throw invalid_argument(fmt::format("unknown handle kind {} (0 = TORPOR_HANDLE_AUTO, 1 = TORPOR_HANDLE_POSIX_FD, "
                                         "2 = TORPOR_HANDLE_FABRIC)",
                                         kind));
    if (out == nullptr && capacity > 0)
      throw invalid_argument(fmt::format("out is NULL but capacity is {} (pass NULL and 0 to ask how many)", capacity));
    const std::vector<std::string> t = to_strings(tags, count, "tags");
    const std::optional<HandleKind> k =
        kind == TORPOR_HANDLE_AUTO ? std::nullopt : std::optional<HandleKind>(static_cast<HandleKind>(kind));
    const std::size_t n = p.pool->export_count(t, k);
    *exported = n;
    if (out == nullptr) return;  // the question: how many
    if (n > capacity)
      throw invalid_argument(fmt::format("{} chunks to export, room for {} in out: nothing exported; call again with "
                                         "room for {} (*exported says how many)",
                                         n, capacity, n));
    // The descriptors are owned by `chunks` until the last check passed, so a refusal closes them.
    std::vector<ExportedChunk> chunks = p.pool->export_handles(t, k, capacity);
    *exported = chunks.size();
    for (const ExportedChunk& c : chunks)
      if (c.tag.size() > TORPOR_EXPORT_TAG_MAX)
        throw invalid_argument(fmt::format("the tag of chunk {:#x} is {} bytes, more than TORPOR_EXPORT_TAG_MAX ({}) "
                                           "an entry carries: nothing exported; use a shorter tag",
                                           c.va, c.tag.size(), TORPOR_EXPORT_TAG_MAX));
    for (std::size_t i = 0; i < chunks.size(); ++i) {  // nothing below throws
      ExportedChunk& c = chunks[i];
      torpor_chunk_export& e = out[i];
      e = torpor_chunk_export{};
      e.va = reinterpret_cast<void*>(c.va);
      e.bytes = c.bytes;
      e.kind = static_cast<int>(c.kind);
      std::memcpy(e.fabric, c.fabric.bytes.data(), sizeof e.fabric);
      e.gpu_direct_rdma = c.gpu_direct_rdma ? 1 : 0;
      std::memcpy(e.tag, c.tag.data(), c.tag.size());  // e.tag is zeroed: NUL-terminated
      e.fd = c.release_fd();                           // -1 for a fabric handle
    }
  });
}

torpor_status torpor_pool_exportable(torpor_pool_t pool, int* exportable) {
  if (exportable == nullptr) return fail(TORPOR_ERROR_INVALID_ARGUMENT, "torpor_pool_exportable: exportable is NULL");
  *exportable = 0;
  return with_pool("torpor_pool_exportable", pool,
                   [&](CPool& p) { *exportable = p.pool->options().exportable ? 1 : 0; });
}

}  // extern "C"
