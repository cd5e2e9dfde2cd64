// Handle kinds: see handle_kinds.hpp.
#include "ranks/handle_kinds.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <set>

#include "torpor/error.hpp"

namespace torpor::detail {

namespace {

FabricHandle fabric_handle_at(const std::vector<std::byte>& blob, std::size_t i) {
  FabricHandle h;
  std::copy_n(blob.begin() + static_cast<std::ptrdiff_t>(i * fabric_handle_bytes), fabric_handle_bytes,
              h.bytes.begin());
  return h;
}

}  // namespace

SharingAbility probe_sharing(Driver& driver, int device) {
  SharingAbility a;
  a.node = driver.node_name();
  a.posix_fd = driver.capabilities().posix_fd_handles;
  FabricProbe probe = driver.probe_fabric(device);
  a.fabric = probe.supported();
  a.fabric_why = probe.describe();
  return a;
}

HandleKindChoice choose_handle_kind(const std::vector<SharingAbility>& ranks, const Group& group,
                                    const std::string& who) {
  std::set<std::string> nodes;
  bool all_posix = true;
  std::string no_fabric;  // the ranks that cannot use fabric handles, and why
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    nodes.insert(ranks[r].node);
    all_posix = all_posix && ranks[r].posix_fd;
    if (!ranks[r].fabric) no_fabric += fmt::format("; rank {} ({}): {}", r, ranks[r].node, ranks[r].fabric_why);
  }
  HandleKindChoice c;
  c.nodes = static_cast<int>(nodes.size());
  if (c.nodes == 1 && group.carries_fds() && all_posix) {
    c.kind = HandleKind::posix_fd;
  } else if (no_fabric.empty()) {
    c.kind = HandleKind::fabric;
  } else {
    const std::string why_not_fds =
        c.nodes > 1            ? fmt::format("the ranks run on {} nodes", c.nodes)
        : !group.carries_fds() ? fmt::format("the group ('{}') carries only bytes, not descriptors", group.kind())
                               : std::string("not every rank's driver exports POSIX descriptors");
    throw invalid_argument(fmt::format("{}: cannot share memory between the ranks: POSIX descriptors are out ({}) and "
                                       "fabric handles are refused{}",
                                       who, why_not_fds, no_fabric));
  }
  return c;
}

bool SharedParts::has(int r, std::size_t i) const {
  const auto ru = static_cast<std::size_t>(r);
  if (kind == HandleKind::fabric) return blobs[ru].size() >= (i + 1) * fabric_handle_bytes;
  return i < fds[ru].size();
}

bool SharedParts::holds_exactly(int r, std::size_t n) const {
  const auto ru = static_cast<std::size_t>(r);
  if (kind == HandleKind::fabric) return blobs[ru].size() == n * fabric_handle_bytes;
  return fds[ru].size() == n;
}

PhysicalHandle SharedParts::import_part(Driver& driver, int r, std::size_t i, std::size_t bytes) const {
  const auto ru = static_cast<std::size_t>(r);
  if (kind == HandleKind::fabric) return driver.import_fabric(fabric_handle_at(blobs[ru], i), bytes);
  return driver.import_fd_of_size(fds[ru][i].get(), bytes);
}

MulticastHandle SharedParts::import_multicast(Driver& driver, int r, std::size_t i) const {
  const auto ru = static_cast<std::size_t>(r);
  if (kind == HandleKind::fabric) return driver.multicast_import_fabric(fabric_handle_at(blobs[ru], i));
  return driver.multicast_import_fd(fds[ru][i].get());
}

void Exports::add(Driver& driver, PhysicalHandle handle) {
  if (kind_ == HandleKind::fabric) {
    FabricHandle h = driver.export_fabric(handle);
    blobs_.insert(blobs_.end(), h.bytes.begin(), h.bytes.end());
  } else {
    fds_.emplace_back(driver.export_fd(handle));
  }
}

void Exports::add(Driver& driver, MulticastHandle handle) {
  if (kind_ == HandleKind::fabric) {
    FabricHandle h = driver.multicast_export_fabric(handle);
    blobs_.insert(blobs_.end(), h.bytes.begin(), h.bytes.end());
  } else {
    fds_.emplace_back(driver.multicast_export_fd(handle));
  }
}

SharedParts Exports::exchange(Group& group) const {
  SharedParts out;
  out.kind = kind_;
  if (kind_ == HandleKind::fabric) {
    out.blobs = group.all_gather(blobs_);
  } else {
    std::vector<int> raw;
    raw.reserve(fds_.size());
    for (const UniqueFd& f : fds_) raw.push_back(f.get());
    out.fds = group.all_gather_fds(raw);
  }
  return out;
}

}  // namespace torpor::detail
