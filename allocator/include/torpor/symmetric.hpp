// Symmetric memory that survives sleep: one buffer per rank, every rank mapping every peer's
// buffer at a fixed address, optionally bound to one multicast (NVLS) object.
//
// A SymmetricHeap is one rank's view: its Pool (exportable, this rank's device), its Group, and
// the buffers allocated collectively through it. Each buffer's part on this rank is a pool
// allocation of class `state` in a dedicated chunk (so exporting the chunk shares nothing else);
// the other ranks import it and map it at addresses reserved in their own pools; access is set
// for the importing device.
//
// How parts travel (handle_kind(), decided once, collectively, when the heap is created: every
// rank announces its node, whether its driver exports POSIX descriptors and what a real fabric
// export answered there, and every rank computes the same choice from the same announcements):
//   - POSIX descriptors when every rank is on one node and the group carries descriptors (Unix
//     socket, threads, the Unix subgroup of a CallbackGroup / NcclGroup): this needs no IMEX
//     service, so a node-local group never depends on it;
//   - else fabric handles (64 bytes over the group's all_gather), when every rank's probe said
//     yes: ranks on several nodes, or a group that carries only bytes (TcpGroup);
//   - else an invalid_argument on every rank naming each rank that cannot, and why (its probe's
//     cause in words: no IMEX channel, not permitted, device without fabric, ...). A device-side peer table (a `state`
// allocation in the heap's table tag, "weights" by default) holds size() + 1 uint64 values: the
// address of every rank's part as seen from this rank, then the multicast address (or 0).
//
// Sleep and wake of the pool are collective for the tags that hold symmetric buffers (the heap
// observes its pool, so pool.sleep() / pool.wake_up() do this by themselves):
//   sleep: wait for this device's work (its writes into peers), agree with every rank on the
//          operation (a rank that does not join within the group's timeout is named in a
//          group_timeout on every other rank and nothing changes), unbind and release multicast,
//          unmap and release the imports of peers (otherwise a peer's memory is never freed),
//          then the pool offloads this rank's bytes and releases its memory. If the pool's
//          sleep fails on any rank, every rank learns it afterwards and the buffers whose parts
//          are still awake on every rank get their imports (and multicast binding) back at
//          once; the others are re-imported by the wake;
//   wake:  agree; the pool re-creates and restores this rank's memory; every rank re-exports,
//          all-gathers, re-imports and maps at the same peer addresses; multicast is re-created
//          and re-bound at the same address.
// Every address (local, peer, table, multicast) is the same after wake. Sleep and wake are
// idempotent and collective: a rank that sleeps or wakes alone gets a group_timeout naming the
// ranks that did not join; after it, recover the group (Group::recover on every rank) and call
// the operation again on every rank. A failure after the agreement (out of memory on one rank's
// wake, a driver error) fails the operation on every rank, naming the rank; imports are all or
// none, so calling the operation again on every rank, once the cause is gone, completes it.
//
// Multicast: a buffer asks for it with SymmetricBufferOptions::multicast; the first such buffer
// makes the group decide (per-rank probe, collective AND; the library's ranks/multicast.hpp). When the group says
// no, the buffer is unicast, no multicast call is made, and rank 0 logs one warning naming the
// cause and the rank.
//
// Threading: one thread per rank drives its heap (collective calls must be made in the same order
// on every rank). Destroy the heap before its pool and group. free() and the destructor are local
// (a peer keeps this rank's old memory alive until it frees its own buffer too).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "torpor/driver.hpp"
#include "torpor/group.hpp"
#include "torpor/pool.hpp"

namespace torpor {

namespace detail {
struct SharedParts;  // ranks/handle_kinds.hpp
}

// The group's multicast decision (the first multicast buffer makes it; see Multicast above).
struct MulticastDecision {
  bool use = false;
  // Why not ("" when used), naming the rank: "rank 1: disabled by TORPOR_DISABLE_MULTICAST=1".
  std::string reason;
  // The warning rank 0 logged ("" on the other ranks, when used, and for a single rank).
  std::string warning;
  // Each rank's own verdict, by rank ("" = usable).
  std::vector<std::string> rank_reasons;
};

struct SymmetricHeapOptions {
  std::string table_tag = tags::weights;  // where peer tables live (class state)
};

struct SymmetricBufferOptions {
  std::string tag = tags::weights;  // the pool tag of this rank's part (class state)
  std::string name;                 // allocation name (the table is named name + ".peers")
  bool multicast = false;           // bind a multicast object when the group can use one
};

class SymmetricBuffer {
 public:
  std::uint64_t id() const noexcept { return id_; }  // same on every rank
  std::size_t bytes() const noexcept { return bytes_; }
  std::size_t part_bytes() const noexcept { return part_bytes_; }  // per rank, whole chunks
  const std::string& tag() const noexcept { return tag_; }
  const std::string& name() const noexcept { return name_; }
  int rank() const noexcept { return rank_; }
  int size() const noexcept { return static_cast<int>(peer_va_.size()); }

  void* local() const noexcept { return local_; }
  // Rank r's part as mapped on this rank (local() for this rank). Valid while peers_mapped().
  void* peer(int r) const;
  // size() + 1 uint64 in device memory: peer(0), ..., peer(size() - 1), multicast address or 0.
  void* peer_table() const noexcept { return table_; }
  // The multicast mapping of this buffer, or nullptr (not asked for, or the group said no).
  void* multicast_address() const noexcept { return mc_ ? reinterpret_cast<void*>(mc_->va) : nullptr; }
  bool peers_mapped() const noexcept;

 private:
  friend class SymmetricHeap;
  struct Import {
    PhysicalHandle handle;
    bool mapped = false;
  };
  struct Multicast {
    device_ptr range = 0;  // reserved span (with alignment slack)
    device_ptr va = 0;     // aligned mapping address inside it
    std::size_t bytes = 0;
    MulticastHandle handle;
    bool added = false;
    bool bound = false;
    bool mapped = false;
  };

  std::uint64_t id_ = 0;
  std::size_t bytes_ = 0;
  std::size_t part_bytes_ = 0;
  std::string tag_;
  std::string name_;
  int rank_ = 0;
  void* local_ = nullptr;
  void* table_ = nullptr;
  device_ptr peer_range_ = 0;
  std::vector<device_ptr> peer_va_;  // by rank
  std::vector<Import> imports_;      // by rank (own entry unused)
  std::optional<Multicast> mc_;
};

class SymmetricHeap final : private SleepObserver {
 public:
  // Collective. The pool must be exportable (PoolOptions::exportable) and on this rank's device.
  SymmetricHeap(Pool& pool, Group& group, SymmetricHeapOptions options = {});
  ~SymmetricHeap() override;
  SymmetricHeap(const SymmetricHeap&) = delete;
  SymmetricHeap& operator=(const SymmetricHeap&) = delete;

  // Collective: every rank with the same bytes and options. All ranks succeed or all throw.
  SymmetricBuffer& allocate(std::size_t bytes, const SymmetricBufferOptions& options = {});
  // Local; see the note above.
  void free(SymmetricBuffer& buffer);

  std::vector<SymmetricBuffer*> buffers() const;
  // The group's decision, once a buffer has asked for multicast.
  std::optional<MulticastDecision> multicast_decision() const;
  // How this heap's parts travel between ranks (see the note above); the same on every rank.
  HandleKind handle_kind() const noexcept { return handle_kind_; }
  // The number of distinct nodes the ranks run on (Driver::node_name()).
  int nodes() const noexcept { return nodes_; }
  Pool& pool() const noexcept { return pool_; }
  Group& group() const noexcept { return group_; }

 private:
  void before_sleep(Pool&, int level, const std::vector<std::string>& tags) override;
  void after_sleep(Pool&, int level, const std::vector<std::string>& tags, bool ok) override;
  void before_wake(Pool&, const std::vector<std::string>& tags) override;
  void after_wake(Pool&, const std::vector<std::string>& tags, bool ok) override;

  std::vector<SymmetricBuffer*> in_tags(const std::vector<std::string>& tags) const;
  // All-gathers `request` (+ per-rank `extra`); throws invalid_state on every rank when the
  // requests differ. Returns every rank's extra.
  std::vector<std::string> agree(const std::string& operation, const std::string& request, const std::string& extra);
  // Runs fn here, then every rank learns every outcome: returns only when all succeeded.
  void step(const std::string& what, const std::function<void()>& fn);

  // This rank's share of a new buffer, local only: its part (a chunk of its own), its peer table,
  // the VA range for the peers' parts, and, with multicast, the range the object maps at.
  void place_local(SymmetricBuffer& b, const SymmetricBufferOptions& o, bool use_multicast, std::size_t alignment);
  // Every rank's exported parts of `work` (in order), as handle_kind() carries them, after a
  // collective export step.
  detail::SharedParts share_parts(const std::vector<SymmetricBuffer*>& work);
  // Imports and maps every peer part not mapped yet; `i` is the buffer's index in `shared`.
  void import_peers(SymmetricBuffer& b, const detail::SharedParts& shared, std::size_t i);
  void drop_imports(SymmetricBuffer& b);
  void setup_multicast(SymmetricBuffer& b, SymmetricBuffer::Multicast& m);
  void teardown_multicast(SymmetricBuffer& b);
  void write_table(SymmetricBuffer& b);
  // Collective: re-export this rank's parts of `work`, all-gather, import and map the peers'
  // parts, set multicast up again. Throws (every rank) after dropping what it imported.
  void reimport(const std::vector<SymmetricBuffer*>& work);
  PhysicalHandle own_handle(const SymmetricBuffer& b) const;
  // Local release of everything a buffer holds; logs failures, never throws.
  void release_local(SymmetricBuffer& b) noexcept;
  std::string who() const;

  Pool& pool_;
  Driver& driver_;
  Group& group_;
  SymmetricHeapOptions options_;
  std::vector<int> devices_;  // by rank
  bool one_process_ = false;
  HandleKind handle_kind_ = HandleKind::posix_fd;
  int nodes_ = 1;
  mutable std::mutex mu_;
  std::map<std::uint64_t, std::unique_ptr<SymmetricBuffer>> buffers_;
  std::uint64_t next_id_ = 1;
  std::optional<MulticastDecision> decision_;
  // Between before_wake and after_wake: the buffers to re-import (every rank has the same list).
  std::optional<std::vector<std::uint64_t>> wake_work_;
};

}  // namespace torpor
