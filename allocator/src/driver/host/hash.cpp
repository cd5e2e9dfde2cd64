// HostDriver's content hashes: the CPU reference of the content_hash kernels
// (torpor/content_hash.hpp), bit for bit the GPU's results, over accessible mapped memory or
// host memory. In the asynchronous mode the hash is ordered after the stream's earlier work, as
// the device's kernel is, and the call blocks until its results are out.
#include <algorithm>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <vector>

#include "driver/host/async_engine.hpp"
#include "driver/host/state.hpp"
#include "torpor/content_hash.hpp"

namespace torpor {

void HostDriver::hash(std::span<const HashRange> ranges, Hash128* out, Stream s) {
  const char* call = "hash";
  std::shared_lock touching(mapping_mu_);
  std::vector<InFlight> touched;
  {
    std::lock_guard lock(mu_);
    require_stream(s, call);
    for (const HashRange& r : ranges) {
      check_accessible(r.ptr, r.bytes, call);
      auto lo = reinterpret_cast<std::uintptr_t>(r.ptr);
      if (async_ && r.bytes > 0) touched.push_back(InFlight{lo, lo + r.bytes, s.value, call});
    }
  }
  if (!async_) {
    for (std::size_t i = 0; i < ranges.size(); ++i) out[i] = content_hash::compute(ranges[i].ptr, ranges[i].bytes);
    return;
  }
  // Ordered after the stream's earlier work, like the device's hash kernel; blocks for the results.
  std::vector<HashRange> copy(ranges.begin(), ranges.end());
  auto results = std::make_shared<std::vector<Hash128>>(copy.size());
  std::uint64_t ticket = submit(
      s,
      [copy, results] {
        for (std::size_t i = 0; i < copy.size(); ++i) (*results)[i] = content_hash::compute(copy[i].ptr, copy[i].bytes);
      },
      std::move(touched));
  async_->wait(s.value, ticket);
  std::copy(results->begin(), results->end(), out);
}

}  // namespace torpor
