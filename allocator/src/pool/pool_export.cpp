// The shareable handles of an exportable pool's chunks (Pool::export_handles), for KV transports
// that register the memory with a NIC or hand it to another process.
//
// Design: a chunk is one physical handle mapped at a fixed span, so its handle is what a transport
// needs; the export is made through the driver seam (export_fd / export_fabric), under the pool's
// lock so that no sleep releases a handle halfway through. Which kind by default follows the rule
// by which Driver::create chose the handle types (driver.hpp): fabric where the driver has fabric
// handles and the device's probe said yes, else POSIX descriptors.
//
// Invariants:
//   - all or nothing: every check (exportable pool, known tags, no selected chunk asleep, the
//     kind available, the count within the caller's limit) passes before the first export, and a
//     failed export closes the descriptors already made (ExportedChunk owns them), so a refusal
//     or a failure hands out nothing and leaks nothing;
//   - only awake chunks that hold allocations are exported: a sleeping (or stranded) chunk has no
//     memory of its own to name, and an empty cached slab holds nothing a transport needs (trim
//     may release it at any time);
//   - a handle names the memory mapped now; the next sleep of its tag releases that memory, and
//     the wake's new memory has new handles at the same addresses (tag hooks re-export).
#include <fmt/core.h>
#include <unistd.h>

#include <utility>

#include "pool/pool_state.hpp"
#include "torpor/error.hpp"
#include "torpor/log.hpp"
#include "torpor/pool.hpp"

namespace torpor {

// ---------------------------------------------------------------------------------------------
// ExportedChunk: the owned descriptor

ExportedChunk::ExportedChunk(ExportedChunk&& o) noexcept
    : va(o.va),
      bytes(o.bytes),
      tag(std::move(o.tag)),
      kind(o.kind),
      fabric(o.fabric),
      gpu_direct_rdma(o.gpu_direct_rdma),
      fd_(o.release_fd()) {}

ExportedChunk& ExportedChunk::operator=(ExportedChunk&& o) noexcept {
  if (this != &o) {
    va = o.va;
    bytes = o.bytes;
    tag = std::move(o.tag);
    kind = o.kind;
    fabric = o.fabric;
    gpu_direct_rdma = o.gpu_direct_rdma;
    reset_fd(o.release_fd());
  }
  return *this;
}

ExportedChunk::~ExportedChunk() { reset_fd(); }

int ExportedChunk::release_fd() noexcept { return std::exchange(fd_, -1); }

void ExportedChunk::reset_fd(int fd) noexcept {
  if (fd_ >= 0 && fd_ != fd && ::close(fd_) != 0)
    log::warn("pool: closing the exported descriptor {} of chunk {:#x} failed", fd_, va);
  fd_ = fd;
}

// ---------------------------------------------------------------------------------------------
// Pool

namespace {

// The chunks an export hands out, and the kind, after every check (under the pool's lock).
struct ExportPlan {
  std::vector<const Chunk*> chunks;
  HandleKind kind = HandleKind::posix_fd;
};

HandleKind checked_kind(Driver& driver, int device, std::optional<HandleKind> requested, const char* call) {
  const DriverCapabilities caps = driver.capabilities();
  if (!requested) {
    return caps.fabric_handles && driver.probe_fabric(device).supported() ? HandleKind::fabric : HandleKind::posix_fd;
  }
  switch (*requested) {
    case HandleKind::posix_fd:
      if (!caps.posix_fd_handles)
        throw unavailable(fmt::format("{}: the {} driver cannot export memory as POSIX file descriptors", call,
                                      driver.backend_name()));
      return HandleKind::posix_fd;
    case HandleKind::fabric: {
      if (!caps.fabric_handles)
        throw unavailable(fmt::format("{}: the {} driver has no fabric handles; ask for POSIX descriptors (the "
                                      "processes of one node)",
                                      call, driver.backend_name()));
      const FabricProbe probe = driver.probe_fabric(device);
      if (!probe.supported())
        throw unavailable(fmt::format("{}: fabric handles were asked for, but device {}'s memory has none: {}; ask "
                                      "for POSIX descriptors (the processes of one node) instead",
                                      call, device, probe.describe()));
      return HandleKind::fabric;
    }
  }
  throw invalid_argument(fmt::format("{}: handle kind {} is not one of 1 (POSIX file descriptor) or 2 (fabric handle)",
                                     call, static_cast<int>(*requested)));
}

// Caller holds s.mu.
ExportPlan plan_export(const Pool::State& s, const std::vector<std::string>& requested, std::optional<HandleKind> kind,
                       const char* call) {
  if (!s.options.exportable)
    throw invalid_state(fmt::format(
        "{}: the pool of device {} is not exportable: its memory was created without shareable handle types, so "
        "no chunk has a handle to give. Create the pool exportable (C++: PoolOptions::exportable = true; C: "
        "torpor_pool_options.exportable = 1; Python: torpor.Pool(..., exportable=True), or "
        "torpor.use_pool(..., exportable=True) for PyTorch's pools)",
        call, s.options.device));
  const std::vector<std::string> tags = s.resolve_tags(requested, call);
  ExportPlan plan;
  std::vector<std::string> asleep;
  for (const auto& [va, c] : s.chunks) {
    if (c->allocations.empty() || !has_tag(tags, c->tag)) continue;
    if (!c->awake) {
      if (!has_tag(asleep, c->tag)) asleep.push_back(c->tag);
      continue;
    }
    plan.chunks.push_back(c.get());
  }
  if (!asleep.empty()) {
    std::string names;
    for (const auto& t : asleep) names += fmt::format("{}'{}'", names.empty() ? "" : ", ", t);
    throw invalid_state(fmt::format(
        "{}: tag(s) {} asleep on device {}: a sleeping chunk's memory was released, so it has no handle. Wake "
        "the tag first (wake_up); a transport exports again after each wake, in an after_map tag hook",
        call, names, s.options.device));
  }
  plan.kind = checked_kind(s.driver, s.options.device, kind, call);
  return plan;
}

}  // namespace

std::optional<HandleKind> Pool::export_kind() const {
  if (!options_.exportable) return std::nullopt;
  return checked_kind(driver_, options_.device, std::nullopt, "export_kind");
}

std::size_t Pool::export_count(const std::vector<std::string>& tags, std::optional<HandleKind> kind) const {
  std::lock_guard lock(state_->mu);
  return plan_export(*state_, tags, kind, "export_handles").chunks.size();  // what export_handles would give
}

std::vector<ExportedChunk> Pool::export_handles(const std::vector<std::string>& tags, std::optional<HandleKind> kind,
                                                std::size_t max_chunks) const {
  const char* call = "export_handles";
  std::lock_guard lock(state_->mu);  // no sleep releases a handle while it is exported
  const ExportPlan plan = plan_export(*state_, tags, kind, call);
  if (plan.chunks.size() > max_chunks)
    throw invalid_argument(fmt::format("{}: {} chunks to export, room for {}: nothing exported; ask again with room "
                                       "for {} (export_count says how many)",
                                       call, plan.chunks.size(), max_chunks, plan.chunks.size()));
  std::vector<ExportedChunk> out;
  out.reserve(plan.chunks.size());
  for (const Chunk* c : plan.chunks) {
    ExportedChunk e;
    e.va = c->va;
    e.bytes = c->bytes;
    e.tag = c->tag;
    e.kind = plan.kind;
    e.gpu_direct_rdma = state_->gpu_direct_rdma;
    // A throw leaves `out`, whose destructor closes every descriptor made so far.
    if (plan.kind == HandleKind::fabric)
      e.fabric = driver_.export_fabric(c->handle);
    else
      e.reset_fd(driver_.export_fd(c->handle));
    out.push_back(std::move(e));
  }
  return out;
}

}  // namespace torpor
