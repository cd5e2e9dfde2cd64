// PoolOptions validation. See pool_options.hpp.
#include "pool/pool_options.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <cstddef>

#include "common/range_allocator.hpp"
#include "pool/store/host_store.hpp"
#include "torpor/error.hpp"

namespace torpor {

namespace {

// PoolOptions::va_bytes: far beyond any device's (twice its memory) and any rounding overflow.
constexpr std::size_t max_va_bytes = std::size_t{1} << 52;

void check_device(const PoolOptions& o, const DeviceProperties& props) {
  if (!props.vmm_supported)
    throw error(fmt::format("device {} ({}) does not support CUDA virtual memory management "
                            "(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0); torpor needs it",
                            o.device, props.name));
  if (o.exportable && !props.posix_fd_handles_supported)
    throw error(
        fmt::format("device {} cannot export memory as POSIX file descriptors; exportable pools need it", o.device));
}

// The handle-size policy's defaults, rounded to the granularity, and its consistency.
void normalize_sizes(PoolOptions& o, const DeviceProperties& props, std::size_t gran) {
  if (o.va_bytes > max_va_bytes)
    throw invalid_argument(fmt::format("PoolOptions::va_bytes {} is outside [0, {}] (0 = twice the device's memory)",
                                       o.va_bytes, max_va_bytes));
  if (o.va_bytes == 0) o.va_bytes = std::min(2 * props.total_bytes, max_va_bytes);
  o.va_bytes = align_up(o.va_bytes, gran);
  if (o.slab_bytes == 0) o.slab_bytes = gran;
  if (o.slab_bytes % gran != 0)
    throw invalid_argument(
        fmt::format("PoolOptions::slab_bytes {} must be a multiple of the granularity {}", o.slab_bytes, gran));
  if (o.small_limit == 0) o.small_limit = o.slab_bytes / 2;
  if (o.small_limit > o.slab_bytes)
    throw invalid_argument(
        fmt::format("PoolOptions::small_limit {} exceeds slab_bytes {}", o.small_limit, o.slab_bytes));
  if (o.medium_limit != 0) {
    o.medium_slab_min = align_up(std::max(o.medium_slab_min, gran), gran);
    o.medium_slab_max = align_up(std::max(o.medium_slab_max, o.medium_slab_min), gran);
    if (o.medium_limit > o.medium_slab_max)
      throw invalid_argument(
          fmt::format("PoolOptions::medium_limit {} exceeds medium_slab_max {}", o.medium_limit, o.medium_slab_max));
  }
}

// The sleep engine's knobs.
void check_engine_options(PoolOptions& o) {
  if (o.release_threads < 1 || o.release_threads > 64)
    throw invalid_argument(fmt::format("PoolOptions::release_threads {} must be 1..64", o.release_threads));
  if (o.copy_streams < 1 || o.copy_streams > 64)
    throw invalid_argument(fmt::format("PoolOptions::copy_streams {} must be 1..64", o.copy_streams));
  if (o.copy_piece_bytes < HostStore::alignment)
    throw invalid_argument(
        fmt::format("PoolOptions::copy_piece_bytes {} is below {}", o.copy_piece_bytes, HostStore::alignment));
  o.copy_piece_bytes = align_up(o.copy_piece_bytes, HostStore::alignment);
  if (o.hash_group_bytes == 0)
    throw invalid_argument("PoolOptions::hash_group_bytes is 0: it must be at least 1 (one chunk per hash call)");
  if (o.staging_slots < 2 || o.staging_slots > 64 || o.staging_slot_bytes < HostStore::alignment ||
      o.staging_slot_bytes > (std::size_t{1} << 30))
    throw invalid_argument(
        "PoolOptions: the staging ring needs 2..64 slots (staging_slots) of 256 bytes to 1 GiB (staging_slot_bytes)");
}

// The host store's knobs.
void check_host_options(const PoolOptions& o) {
  if (o.host_pin_threads < 0 || o.host_pin_threads > 256)
    throw invalid_argument(
        fmt::format("PoolOptions::host_pin_threads {} must be 0..256 (0 = min(16, cores))", o.host_pin_threads));
  if (o.host_pin_block_bytes < HostStore::block_rounding || o.host_pin_block_bytes > (std::size_t{64} << 30))
    throw invalid_argument(
        fmt::format("PoolOptions::host_pin_block_bytes {} must be 2 MiB..64 GiB", o.host_pin_block_bytes));
  if (!o.spill_dir.empty() && o.host_store_limit == 0)
    throw invalid_argument(fmt::format("PoolOptions::spill_dir '{}' needs host_store_limit > 0: what does not fit "
                                       "under the limit goes to disk (a limit below 2 MiB puts every backup there)",
                                       o.spill_dir));
  if (o.spill_file_per_allocation && o.spill_dir.empty())
    throw invalid_argument(
        "PoolOptions::spill_file_per_allocation needs spill_dir: it chooses how the disk tier lays out its files, and "
        "without a spill directory there is none (set spill_dir, or spill_file_per_allocation false)");
  // A limit on a disk tier that does not exist would be ignored: the caller meant to spill.
  if (o.spill_limit != 0 && o.spill_dir.empty())
    throw invalid_argument(fmt::format("PoolOptions::spill_limit {} needs spill_dir: it bounds the disk tier, and "
                                       "without a spill directory there is none (set spill_dir, or spill_limit 0)",
                                       o.spill_limit));
}

}  // namespace

void validate_pool_options(PoolOptions& o, const DeviceProperties& props) {
  check_device(o, props);
  normalize_sizes(o, props, props.granularity);
  check_engine_options(o);
  check_host_options(o);
}

// The pool's device and every distinct peer, each of which must be able to access it.
std::vector<int> access_devices(Driver& driver, const PoolOptions& o, int count) {
  std::vector<int> access{o.device};
  for (int p : o.peer_devices) {
    if (p < 0 || p >= count) throw invalid_argument(fmt::format("Pool: peer device {} does not exist", p));
    if (p == o.device || std::find(access.begin(), access.end(), p) != access.end()) continue;
    if (!driver.can_access_peer(p, o.device))
      throw invalid_argument(fmt::format("Pool: device {} cannot access device {} (no peer access)", p, o.device));
    access.push_back(p);
  }
  return access;
}

}  // namespace torpor
