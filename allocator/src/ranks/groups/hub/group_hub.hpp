// The rendezvous bookkeeping every Group implementation shares: which rank contributed to which
// collective, when one completes, who is missing when one is given up, and recovery. No I/O and
// no locking: the thread group calls it under its mutex, the hub server (hub_server.hpp) from
// the one thread that serves the sockets. Each call returns the replies to deliver, rank by rank.
//
// Invariants:
//   - collectives are identified by (generation, sequence number); every rank numbers its own
//     collectives 1, 2, 3, ... within a generation, so equal numbers are the same collective;
//   - a pending collective completes when every rank contributed, with the same kind;
//   - a rank has at most one contribution pending (it waits for each collective before its
//     next), so the hub holds at most one message per rank;
//   - a collective that failed (given up after a timeout, kinds mismatched, a rank left, a rank
//     started recovery) is remembered by number, so a rank that arrives late is answered at once;
//   - while any rank is recovering, new contributions are refused; when every rank asked to
//     recover, the generation advances and all bookkeeping of the old generation is dropped.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "torpor/group.hpp"

namespace torpor::detail {

enum class CollectiveKind : std::uint8_t { formation = 1, barrier = 2, all_gather = 3, all_gather_fds = 4 };
const char* to_string(CollectiveKind k) noexcept;

struct Part {
  std::vector<std::byte> bytes;
  std::vector<UniqueFd> fds;
};

enum class ReplyType : std::uint8_t {
  result = 1,           // the collective completed: parts of every rank
  failed = 2,           // the collective failed: see reason
  recovered = 3,        // recovery complete: new generation
  recover_pending = 4,  // recovery given up by this rank after a timeout: missing ranks
};

enum class FailReason : std::uint8_t {
  timeout = 1,   // ranks did not arrive before someone gave up
  late = 2,      // this rank arrived after the collective had failed
  mismatch = 3,  // ranks called different collectives at the same position
  left = 4,      // a rank left the group
  recovery = 5,  // a rank is recovering the group
  stale = 6,     // the contribution belongs to an older generation
};

struct Reply {
  ReplyType type = ReplyType::result;
  FailReason reason = FailReason::timeout;
  std::uint64_t generation = 0;
  std::uint64_t sequence = 0;
  std::shared_ptr<const std::vector<Part>> parts;  // result
  std::vector<int> missing;                        // failed (timeout/left), recover_pending
  std::string message;                             // failed
};

using Deliveries = std::vector<std::pair<int, Reply>>;

class Hub {
 public:
  explicit Hub(int size);

  Deliveries contribute(int rank, std::uint64_t generation, std::uint64_t sequence, CollectiveKind kind, Part part);
  // `rank` stops waiting for (generation, sequence). Nothing is delivered when that collective
  // is no longer pending (its result or failure was delivered already).
  Deliveries give_up(int rank, std::uint64_t generation, std::uint64_t sequence, double waited_seconds);
  Deliveries recover(int rank, std::uint64_t generation);
  // `rank` stops waiting for recovery (it stays counted as asking); it is answered with the ranks
  // that have not asked yet.
  Deliveries give_up_recovery(int rank, std::uint64_t generation);
  // `rank` is gone for good (its connection closed or its Group was destroyed): every pending
  // collective fails naming it (missing = {rank}), whether or not it had contributed.
  Deliveries leave(int rank);

  int size() const noexcept { return size_; }
  std::uint64_t generation() const noexcept { return generation_; }

 private:
  struct Pending {
    CollectiveKind kind;
    std::vector<std::optional<Part>> parts;
    std::size_t arrived = 0;
  };
  // Fails a pending collective: remembers `late_message` for later arrivals, delivers to the
  // ranks that had arrived.
  void fail(Deliveries& out, std::uint64_t sequence, FailReason reason, const std::string& message,
            const std::string& late_message);
  std::vector<int> missing_from(const Pending& p) const;
  std::optional<Reply> refusal(int rank, std::uint64_t generation, std::uint64_t sequence) const;
  Reply failure(FailReason reason, std::uint64_t sequence, std::string message, std::vector<int> missing) const;

  int size_;
  std::uint64_t generation_ = 0;
  std::map<std::uint64_t, Pending> pending_;
  std::map<std::uint64_t, std::pair<FailReason, std::string>> failed_;  // by sequence, this generation
  std::set<int> recovering_;
  std::set<int> gone_;
};

}  // namespace torpor::detail
