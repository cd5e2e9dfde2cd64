// How a symmetric heap's memory travels between its ranks (SymmetricHeap::handle_kind()): the
// choice of a handle kind, and the export, exchange and import of parts and multicast objects in
// that kind, so the heap's code never branches on it.
//
//   - posix_fd: a descriptor per handle (Driver::export_fd), all-gathered over the group's
//     descriptor passing (Group::all_gather_fds). Needs one node and a group that carries
//     descriptors, and no IMEX service;
//   - fabric: fabric_handle_bytes per handle (Driver::export_fabric), all-gathered as bytes
//     (Group::all_gather): ranks on several nodes, or a group that carries only bytes.
//
// Invariants: the choice is computed on every rank from every rank's announcement, the same
// input everywhere, so every rank makes the same choice (or throws the same error); an exchange
// is exactly one group call, whatever this rank exports (nothing included), so ranks stay matched
// call for call.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "torpor/driver.hpp"
#include "torpor/group.hpp"

namespace torpor::detail {

// What one rank can share, as it announces it when a heap is created.
struct SharingAbility {
  std::string node;        // Driver::node_name()
  bool posix_fd = false;   // its driver exports POSIX descriptors
  bool fabric = false;     // a real fabric export answered there
  std::string fabric_why;  // the fabric probe in words
};

// This rank's ability (asks the driver; throws what the driver throws).
SharingAbility probe_sharing(Driver& driver, int device);

struct HandleKindChoice {
  HandleKind kind = HandleKind::posix_fd;
  int nodes = 1;  // distinct nodes among the ranks
};

// The kind for every rank's abilities (by rank): descriptors when every rank is on one node, the
// group carries them and every driver exports them; else fabric handles when every rank's probe
// said yes; else invalid_argument naming each rank that cannot, and why (`who` opens it).
HandleKindChoice choose_handle_kind(const std::vector<SharingAbility>& ranks, const Group& group,
                                    const std::string& who);

// Every rank's exports (by rank), as the kind carries them.
struct SharedParts {
  HandleKind kind = HandleKind::posix_fd;
  std::vector<std::vector<UniqueFd>> fds;     // posix_fd: fds[r][i]
  std::vector<std::vector<std::byte>> blobs;  // fabric: blobs[r], fabric_handle_bytes per handle

  // Whether rank r sent an i-th handle / exactly n handles.
  bool has(int r, std::size_t i) const;
  bool holds_exactly(int r, std::size_t n) const;
  // Rank r's i-th handle, imported into `driver` (a part of `bytes` bytes, or a multicast object).
  PhysicalHandle import_part(Driver& driver, int r, std::size_t i, std::size_t bytes) const;
  MulticastHandle import_multicast(Driver& driver, int r, std::size_t i) const;
};

// This rank's handles exported in one kind, in order, until exchange() shares them.
class Exports {
 public:
  explicit Exports(HandleKind kind) : kind_(kind) {}
  void add(Driver& driver, PhysicalHandle handle);
  void add(Driver& driver, MulticastHandle handle);
  // Collective, one group call: every rank's exports.
  SharedParts exchange(Group& group) const;

 private:
  HandleKind kind_;
  std::vector<UniqueFd> fds_;
  std::vector<std::byte> blobs_;
};

}  // namespace torpor::detail
