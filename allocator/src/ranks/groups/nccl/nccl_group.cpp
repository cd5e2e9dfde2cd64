// NcclGroup: bytes over NCCL, everything else over the bootstrap group. See nccl_group.hpp.
// Compiled where CMake found NCCL (TORPOR_NCCL); nccl_group_unavailable.cpp stands in elsewhere.
//
// Invariants: comm_ is a live communicator or null; broken_ is set by a timeout or an NCCL error
// and cleared only by recover(); the staging memory (device region and pinned host buffer) is
// only touched by work on stream_, and the host reads results only after the flag copy that
// follows them on the same stream has landed.
#include "torpor/nccl_group.hpp"

#include <fmt/core.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>
#include <thread>

#include "common/range_allocator.hpp"
#include "ranks/groups/nccl/nccl_library.hpp"
#include "ranks/multicast.hpp"
#include "torpor/error.hpp"
#include "torpor/log.hpp"

namespace torpor {

namespace {

using clock_type = std::chrono::steady_clock;

constexpr std::size_t staging_alignment = 256;

}  // namespace

struct NcclGroup::Impl {
  Impl(Group& bootstrap, Driver& d, int dev, std::chrono::milliseconds t)
      : boot(bootstrap), driver(d), device(dev), timeout(t), api(nccl_library()) {
    if (!driver.capabilities().make_current)
      throw invalid_argument(fmt::format("NcclGroup needs a driver that can make a device current for NCCL (the cuda "
                                         "backend); the '{}' driver cannot",
                                         driver.backend_name()));
    if (!api.usable()) throw error(fmt::format("NcclGroup: {}", api.why_not));
    stream = driver.stream_create(device);
    try {
      init_comm();
    } catch (...) {
      release_staging();
      try {
        driver.stream_destroy(stream);
      } catch (const std::exception& e) {
        log::error("{}: destroying the stream: {}", who(), e.what());
      }
      throw;
    }
  }

  ~Impl() {
    drop_comm(false);
    try {
      driver.stream_synchronize(stream);
    } catch (const std::exception& e) {
      log::error("{}: synchronizing the stream at destruction: {}", who(), e.what());
    }
    release_staging();
    try {
      driver.stream_destroy(stream);
    } catch (const std::exception& e) {
      log::error("{}: destroying the stream: {}", who(), e.what());
    }
  }

  std::string who() const {
    return fmt::format("nccl group rank {} of {} (device {})", boot.rank(), boot.size(), device);
  }

  void check(ncclResult_t r, const char* call) const {
    if (r == ncclSuccess || r == ncclInProgress) return;
    throw error(fmt::format("{}: {} failed: {} ({})", who(), call, api.error_string(r), static_cast<int>(r)));
  }

  // Polls the communicator's state; false when the deadline passes while it is in progress.
  bool settle(clock_type::time_point deadline) const {
    for (;;) {
      ncclResult_t state = ncclSuccess;
      check(api.get_async_error(comm, &state), "ncclCommGetAsyncError");
      if (state != ncclInProgress) {
        check(state, "NCCL (asynchronous error)");
        return true;
      }
      if (clock_type::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  void init_comm() {
    apply_nccl_nvls_policy();  // NCCL's NVLS creates multicast objects: the kill switches apply to it too
    ncclUniqueId id{};
    if (boot.rank() == 0) check(api.get_unique_id(&id), "ncclGetUniqueId");
    std::span<const std::byte> mine;
    if (boot.rank() == 0) mine = std::as_bytes(std::span(&id, 1));
    auto all = boot.all_gather(mine);
    if (all[0].size() != sizeof id) throw error(fmt::format("{}: rank 0 sent no NCCL unique id", who()));
    std::memcpy(&id, all[0].data(), sizeof id);
    driver.make_current(device);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // so that a setup which never completes can be given up
    ncclComm_t c = nullptr;
    check(api.init_rank_config(&c, boot.size(), id, boot.rank(), &config), "ncclCommInitRankConfig");
    comm = c;
    if (!settle(clock_type::now() + timeout)) {
      drop_comm(true);
      throw group_timeout(fmt::format("{}: the NCCL communicator was not ready within {} ms although every rank "
                                      "exchanged its id",
                                      who(), timeout.count()),
                          {});
    }
  }

  void drop_comm(bool abort) noexcept {
    if (comm == nullptr) return;
    try {
      driver.make_current(device);
      bool done = false;
      if (!abort) {
        // Finalize of a non-blocking communicator completes asynchronously; destroy after it.
        ncclResult_t r = api.finalize(comm);
        if (r == ncclSuccess || r == ncclInProgress)
          done = settle(clock_type::now() + timeout) && api.destroy(comm) == ncclSuccess;
      }
      if (!done) api.abort(comm);
    } catch (const std::exception& e) {
      log::error("{}: tearing down the NCCL communicator: {}; aborting it", who(), e.what());
      api.abort(comm);
    }
    comm = nullptr;
  }

  void release_staging() noexcept {
    try {
      if (dev_bytes != 0) {
        driver.unmap(dev, dev_bytes);
        driver.release(dev_handle);
        driver.free_reservation(dev, dev_bytes);
      }
    } catch (const std::exception& e) {
      log::error("{}: freeing the device staging buffer: {}", who(), e.what());
    }
    dev = 0;
    dev_bytes = 0;
    try {
      if (host != nullptr) driver.host_free(host);
    } catch (const std::exception& e) {
      log::error("{}: freeing the host staging buffer: {}", who(), e.what());
    }
    host = nullptr;
    host_bytes = 0;
  }

  void ensure_capacity(std::size_t need) {
    if (need <= dev_bytes && need <= host_bytes) return;
    driver.stream_synchronize(stream);
    release_staging();
    std::size_t g = driver.device_properties(device).granularity;
    std::size_t bytes = align_up(std::max(need, g), g);
    device_ptr va = driver.reserve(bytes, g);
    PhysicalHandle h;
    try {
      h = driver.create(device, bytes, false);
      driver.map(va, bytes, h, 0);
      driver.set_access(va, bytes, std::span(&device, 1));
    } catch (...) {
      try {
        if (h) {
          driver.unmap(va, bytes);
          driver.release(h);
        }
      } catch (...) {  // NOLINT(bugprone-empty-catch): best-effort cleanup; the reservation goes next
      }
      driver.free_reservation(va, bytes);
      throw;
    }
    dev = va;
    dev_bytes = bytes;
    dev_handle = h;
    host = static_cast<std::byte*>(driver.host_alloc(bytes));
    host_bytes = bytes;
  }

  [[noreturn]] void timed_out(const char* op, std::uint64_t seq) {
    drop_comm(true);  // stops the kernels that wait for the missing rank
    broken = fmt::format("NCCL {} #{} timed out", op, seq);
    // Who is missing? The ranks that also gave up answer over the bootstrap group.
    std::vector<int> missing;
    std::string detail;
    try {
      boot.barrier();
      detail = "every rank answered over the bootstrap group, so NCCL itself did not complete";
    } catch (const group_timeout& e) {
      missing = e.missing();
      detail = fmt::format("rank(s) {} did not arrive (they did not answer over the bootstrap group either)",
                           format_ranks(missing));
    } catch (const std::exception& e) {
      detail = fmt::format("asking the bootstrap group who is there failed: {}", e.what());
    }
    throw group_timeout(fmt::format("{}: NCCL {} #{} timed out after {} ms: {}; every rank must call recover() "
                                    "before the group is used again",
                                    who(), op, seq, timeout.count(), detail),
                        missing);
  }

  // Every rank contributes exactly n bytes; returns size() * n bytes, rank by rank.
  std::vector<std::byte> exchange(const void* src, std::size_t n, const char* op) {
    if (broken)
      throw invalid_state(fmt::format("{}: the group is unusable ({}); call recover() on every rank", who(), *broken));
    const std::uint64_t seq = ++sequence;
    const auto deadline = clock_type::now() + timeout;
    const std::size_t ranks = static_cast<std::size_t>(boot.size());
    const std::size_t recv_off = align_up(std::max<std::size_t>(n, 1), staging_alignment);
    const std::size_t flag_off = recv_off + align_up(std::max<std::size_t>(ranks * n, 1), staging_alignment);
    ensure_capacity(flag_off + staging_alignment);
    if (n > 0) std::memcpy(host, src, n);
    try {
      if (n > 0) driver.copy_async(reinterpret_cast<void*>(dev), host, n, stream);
      driver.make_current(device);
      ncclResult_t r = api.all_gather(reinterpret_cast<const void*>(dev), reinterpret_cast<void*>(dev + recv_off), n,
                                      ncclUint8, comm, static_cast<cudaStream_t>(driver.native_stream(stream)));
      check(r, "ncclAllGather");
      if (r == ncclInProgress && !settle(deadline)) timed_out(op, seq);
      if (n > 0) driver.copy_async(host + recv_off, reinterpret_cast<void*>(dev + recv_off), ranks * n, stream);
      auto tick = static_cast<std::uint8_t>(seq % 255 + 1);
      driver.fill_async(dev + flag_off, tick, 1, stream);
      driver.copy_async(host + flag_off, reinterpret_cast<void*>(dev + flag_off), 1, stream);
      auto* flag = reinterpret_cast<std::uint8_t*>(host + flag_off);
      while (__atomic_load_n(flag, __ATOMIC_ACQUIRE) != tick) {
        if (clock_type::now() >= deadline) timed_out(op, seq);
        ncclResult_t state = ncclSuccess;
        check(api.get_async_error(comm, &state), "ncclCommGetAsyncError");
        if (state != ncclInProgress) check(state, "NCCL (asynchronous error)");
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    } catch (const group_timeout&) {
      throw;
    } catch (...) {
      if (!broken) broken = fmt::format("NCCL {} #{} failed", op, seq);
      throw;
    }
    return std::vector<std::byte>(host + recv_off, host + recv_off + ranks * n);
  }

  Group& boot;
  Driver& driver;
  int device;
  std::chrono::milliseconds timeout;
  const NcclLibrary& api;
  ncclComm_t comm = nullptr;
  Stream stream;
  device_ptr dev = 0;
  std::size_t dev_bytes = 0;
  PhysicalHandle dev_handle;
  std::byte* host = nullptr;
  std::size_t host_bytes = 0;
  std::uint64_t sequence = 0;
  std::optional<std::string> broken;
};

bool NcclGroup::available(std::string* why_not) {
  const NcclLibrary& api = nccl_library();
  if (!api.usable() && why_not != nullptr) *why_not = api.why_not;
  return api.usable();
}

NcclGroup::NcclGroup(Group& bootstrap, Driver& driver, int device, const GroupOptions& options)
    : Group(options), impl_(std::make_unique<Impl>(bootstrap, driver, device, timeout_)) {}

NcclGroup::~NcclGroup() = default;

int NcclGroup::rank() const noexcept { return impl_->boot.rank(); }
int NcclGroup::size() const noexcept { return impl_->boot.size(); }

bool NcclGroup::carries_fds() const noexcept { return impl_->boot.carries_fds(); }

std::vector<std::vector<std::byte>> NcclGroup::all_gather(std::span<const std::byte> mine) {
  // Lengths first (fixed 8 bytes each), then every contribution padded to the longest.
  std::uint64_t len = mine.size();
  auto lengths = impl_->exchange(&len, sizeof len, "all_gather (lengths)");
  std::vector<std::uint64_t> sizes(static_cast<std::size_t>(size()));
  std::memcpy(sizes.data(), lengths.data(), lengths.size());
  std::uint64_t longest = *std::max_element(sizes.begin(), sizes.end());
  std::vector<std::vector<std::byte>> out(sizes.size());
  if (longest == 0) return out;
  std::vector<std::byte> padded(longest);
  std::memcpy(padded.data(), mine.data(), mine.size());
  auto data = impl_->exchange(padded.data(), longest, "all_gather");
  for (std::size_t r = 0; r < sizes.size(); ++r)
    out[r].assign(data.begin() + static_cast<std::ptrdiff_t>(r * longest),
                  data.begin() + static_cast<std::ptrdiff_t>(r * longest + sizes[r]));
  return out;
}

std::vector<std::vector<UniqueFd>> NcclGroup::all_gather_fds(std::span<const int> mine) {
  if (impl_->broken)
    throw invalid_state(
        fmt::format("{}: the group is unusable ({}); call recover() on every rank", impl_->who(), *impl_->broken));
  return impl_->boot.all_gather_fds(mine);  // node-local: descriptors cannot travel over NCCL
}

void NcclGroup::barrier() {
  std::uint8_t one = 1;
  impl_->exchange(&one, 1, "barrier");
}

void NcclGroup::recover() {
  impl_->boot.recover();
  impl_->drop_comm(true);
  try {
    impl_->driver.stream_synchronize(impl_->stream);
  } catch (const std::exception& e) {
    log::warn("{}: the stream reported an error after the abort: {}", impl_->who(), e.what());
  }
  impl_->init_comm();
  impl_->sequence = 0;
  impl_->broken.reset();
}

}  // namespace torpor
