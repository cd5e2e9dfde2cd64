// Hub: see group_hub.hpp for the invariants.
#include "ranks/groups/hub/group_hub.hpp"

#include <fmt/core.h>

#include "torpor/error.hpp"

namespace torpor::detail {

const char* to_string(CollectiveKind k) noexcept {
  switch (k) {
    case CollectiveKind::formation: return "formation";
    case CollectiveKind::barrier: return "barrier";
    case CollectiveKind::all_gather: return "all_gather";
    case CollectiveKind::all_gather_fds: return "all_gather_fds";
  }
  return "?";
}

Hub::Hub(int size) : size_(size) {}

std::vector<int> Hub::missing_from(const Pending& p) const {
  std::vector<int> m;
  for (int r = 0; r < size_; ++r)
    if (!p.parts[static_cast<std::size_t>(r)]) m.push_back(r);
  return m;
}

Reply Hub::failure(FailReason reason, std::uint64_t sequence, std::string message, std::vector<int> missing) const {
  Reply r;
  r.type = ReplyType::failed;
  r.reason = reason;
  r.generation = generation_;
  r.sequence = sequence;
  r.message = std::move(message);
  r.missing = std::move(missing);
  return r;
}

void Hub::fail(Deliveries& out, std::uint64_t sequence, FailReason reason, const std::string& message,
               const std::string& late_message) {
  auto it = pending_.find(sequence);
  if (it == pending_.end()) return;
  std::vector<int> missing = missing_from(it->second);
  for (int r = 0; r < size_; ++r)
    if (it->second.parts[static_cast<std::size_t>(r)]) out.emplace_back(r, failure(reason, sequence, message, missing));
  // A rank arriving later learns at once that it came too late (or that a rank left, ...).
  failed_[sequence] = {reason == FailReason::timeout ? FailReason::late : reason, late_message};
  pending_.erase(it);
}

// Why `rank`'s contribution to collective `sequence` of `generation` cannot be taken: the group
// lost a rank, was recovered without it, already failed that collective, is recovering, or
// holds another contribution of this rank. Nothing when it can be taken.
std::optional<Reply> Hub::refusal(int rank, std::uint64_t generation, std::uint64_t sequence) const {
  if (!gone_.empty()) {
    std::vector<int> gone(gone_.begin(), gone_.end());
    return failure(FailReason::left, sequence,
                   fmt::format("rank(s) {} left the group; build a new group", format_ranks(gone)), gone);
  }
  if (generation != generation_) {
    return failure(FailReason::stale, sequence,
                   fmt::format("collective #{} belongs to generation {} but the group is at generation "
                               "{} (it was recovered without this rank's knowledge); call recover()",
                               sequence, generation, generation_),
                   {});
  }
  // A late rank hears what happened to the collective it came for, even while others recover.
  if (auto f = failed_.find(sequence); f != failed_.end()) {
    return failure(f->second.first, sequence, f->second.second, {});
  }
  if (!recovering_.empty()) {
    std::vector<int> rec(recovering_.begin(), recovering_.end());
    return failure(FailReason::recovery, sequence,
                   fmt::format("rank(s) {} are recovering the group after a failed collective; call "
                               "recover() on this rank too",
                               format_ranks(rec)),
                   {});
  }
  // A rank waits for each collective before its next, so it has at most one contribution
  // pending: the hub never holds more than one message per rank.
  for (auto& [seq, p] : pending_)
    if (seq != sequence && p.parts[static_cast<std::size_t>(rank)]) {
      return failure(FailReason::mismatch, sequence,
                     fmt::format("rank {} contributed to collective #{} while its contribution to #{} "
                                 "is pending",
                                 rank, sequence, seq),
                     {});
    }
  return std::nullopt;
}

Deliveries Hub::contribute(int rank, std::uint64_t generation, std::uint64_t sequence, CollectiveKind kind, Part part) {
  Deliveries out;
  if (std::optional<Reply> refused = refusal(rank, generation, sequence)) {
    out.emplace_back(rank, std::move(*refused));
    return out;
  }
  auto [it, fresh] = pending_.try_emplace(sequence);
  Pending& p = it->second;
  if (fresh) {
    p.kind = kind;
    p.parts.resize(static_cast<std::size_t>(size_));
  }
  auto& slot = p.parts[static_cast<std::size_t>(rank)];
  if (slot) {
    out.emplace_back(rank, failure(FailReason::mismatch, sequence,
                                   fmt::format("rank {} contributed twice to collective #{}", rank, sequence), {}));
    return out;
  }
  slot = std::move(part);
  ++p.arrived;
  if (p.kind != kind) {
    int first = -1;
    for (int r = 0; r < size_ && first < 0; ++r)
      if (r != rank && p.parts[static_cast<std::size_t>(r)]) first = r;
    std::string msg = fmt::format("collective #{} mismatch: rank {} called {} but rank {} called {}; every rank must "
                                  "call the same collectives in the same order",
                                  sequence, first, to_string(p.kind), rank, to_string(kind));
    fail(out, sequence, FailReason::mismatch, msg, msg);
    return out;
  }
  if (p.arrived == static_cast<std::size_t>(size_)) {
    auto parts = std::make_shared<std::vector<Part>>();
    parts->reserve(p.parts.size());
    for (auto& s : p.parts) {
      // Every rank's slot is filled by now (a second contribution is refused above).
      if (!s)
        throw invalid_state(fmt::format("group hub: collective #{} counted every rank but lacks a part", sequence));
      parts->push_back(std::move(*s));
    }
    pending_.erase(it);
    for (int r = 0; r < size_; ++r) {
      Reply reply;
      reply.type = ReplyType::result;
      reply.generation = generation_;
      reply.sequence = sequence;
      reply.parts = parts;
      out.emplace_back(r, std::move(reply));
    }
  }
  return out;
}

Deliveries Hub::give_up(int rank, std::uint64_t generation, std::uint64_t sequence, double waited_seconds) {
  Deliveries out;
  if (generation != generation_) return out;
  auto it = pending_.find(sequence);
  if (it == pending_.end() || !it->second.parts[static_cast<std::size_t>(rank)]) return out;
  std::vector<int> missing = missing_from(it->second);
  const char* kind = to_string(it->second.kind);
  std::string msg = fmt::format("collective #{} ({}) timed out after {:.3f} s on rank {}: rank(s) {} did not arrive",
                                sequence, kind, waited_seconds, rank, format_ranks(missing));
  std::string late = fmt::format("collective #{} ({}) was given up by rank {} after {:.3f} s waiting for rank(s) {}; "
                                 "this rank arrived too late",
                                 sequence, kind, rank, waited_seconds, format_ranks(missing));
  fail(out, sequence, FailReason::timeout, msg, late);
  return out;
}

Deliveries Hub::recover(int rank, std::uint64_t generation) {
  Deliveries out;
  if (generation < generation_) {
    // Recovery completed while this rank had stopped waiting for it.
    Reply r;
    r.type = ReplyType::recovered;
    r.generation = generation_;
    out.emplace_back(rank, std::move(r));
    return out;
  }
  if (!gone_.empty()) {
    std::vector<int> gone(gone_.begin(), gone_.end());
    out.emplace_back(rank, failure(FailReason::left, 0,
                                   fmt::format("cannot recover: rank(s) {} left the group; build a new group",
                                               format_ranks(gone)),
                                   gone));
    return out;
  }
  recovering_.insert(rank);
  std::vector<std::uint64_t> open;
  open.reserve(pending_.size());
  for (auto& [seq, p] : pending_) open.push_back(seq);
  for (std::uint64_t seq : open)
    fail(out, seq, FailReason::recovery,
         fmt::format("rank {} started recovering the group while collective #{} was pending", rank, seq),
         fmt::format("collective #{} was abandoned: rank {} started recovering the group; call recover()", seq, rank));
  if (recovering_.size() == static_cast<std::size_t>(size_)) {
    ++generation_;
    pending_.clear();
    failed_.clear();
    for (int r : recovering_) {
      Reply reply;
      reply.type = ReplyType::recovered;
      reply.generation = generation_;
      out.emplace_back(r, std::move(reply));
    }
    recovering_.clear();
  }
  return out;
}

Deliveries Hub::give_up_recovery(int rank, std::uint64_t generation) {
  Deliveries out;
  if (generation != generation_ || !recovering_.count(rank)) return out;
  // The rank stays counted as recovering: when the others arrive the recovery completes, and its
  // next recover() call is answered at once with the new generation.
  Reply r;
  r.type = ReplyType::recover_pending;
  r.generation = generation_;
  for (int k = 0; k < size_; ++k)
    if (k != rank && !recovering_.count(k)) r.missing.push_back(k);
  out.emplace_back(rank, std::move(r));
  return out;
}

Deliveries Hub::leave(int rank) {
  Deliveries out;
  if (!gone_.insert(rank).second) return out;
  // Every pending collective fails naming the rank that left, whether or not it had contributed:
  // a collective it joined and then died in can never be answered to it, and the ranks still
  // missing from it are not to blame.
  std::vector<std::uint64_t> open;
  open.reserve(pending_.size());
  for (auto& [seq, p] : pending_) open.push_back(seq);
  for (std::uint64_t seq : open) {
    std::string msg = fmt::format("rank {} left the group (its process exited or destroyed its group) while "
                                  "collective #{} was pending",
                                  rank, seq);
    fail(out, seq, FailReason::left, msg, msg);
  }
  std::erase_if(out, [rank](const auto& d) { return d.first == rank; });
  for (auto& [to, reply] : out) reply.missing = {rank};
  recovering_.erase(rank);
  for (int r : recovering_)
    out.emplace_back(r,
                     failure(FailReason::left, 0,
                             fmt::format("cannot recover: rank {} left the group; build a new group", rank), {rank}));
  recovering_.clear();
  return out;
}

}  // namespace torpor::detail
