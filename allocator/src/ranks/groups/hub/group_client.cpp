// The rank's side of a hub-based Group: HubClientGroup (the collective machinery) and
// WireClientGroup (its requests and replies as wire messages); see group_client.hpp.
#include "ranks/groups/hub/group_client.hpp"

#include <fmt/core.h>

#include "ranks/groups/hub/hub_protocol.hpp"
#include "torpor/log.hpp"

namespace torpor::detail {

HubClientGroup::HubClientGroup(int rank, int size, const GroupOptions& options)
    : Group(options), rank_(rank), size_(size) {
  if (size < 1) throw invalid_argument(fmt::format("group size {} must be at least 1", size));
  if (rank < 0 || rank >= size)
    throw invalid_argument(fmt::format("group rank {} is outside [0, {}) (size {})", rank, size, size));
}

std::string HubClientGroup::who() const { return fmt::format("group rank {} of {} ({})", rank_, size_, kind()); }

void HubClientGroup::raise(const Received& r) {
  std::string text = fmt::format("{}: {}", who(), r.message);
  switch (r.reason) {
    case FailReason::timeout:
    case FailReason::late:
      throw group_timeout(text + "; every rank must call recover() before the group is used again", r.missing);
    case FailReason::mismatch: throw invalid_state(text + "; then call recover() on every rank");
    case FailReason::left: throw group_rank_left(text, r.missing);
    case FailReason::recovery:
    case FailReason::stale: throw invalid_state(text);
  }
  throw invalid_state(text);
}

std::optional<Received> HubClientGroup::reply_or_give_up(Wait& wait, const std::function<void()>& give_up) {
  for (;;) {
    if (std::optional<Received> r = next_reply(wait.deadline)) return r;
    if (wait.gave_up) return std::nullopt;
    wait.gave_up = true;
    give_up();
    wait.deadline = clock::now() + give_up_grace();
  }
}

std::vector<Part> HubClientGroup::exchange(CollectiveKind kind, Part part) {
  if (broken_)
    throw invalid_state(fmt::format("{}: the group is unusable after a failed collective ({}); call recover() on "
                                    "every rank",
                                    who(), *broken_));
  const std::uint64_t seq = ++seq_;
  const auto start = clock::now();
  post_contribution(gen_, seq, kind, std::move(part));
  Wait wait{start + timeout_};
  for (;;) {
    std::optional<Received> r = reply_or_give_up(wait, [&] {
      post_give_up(gen_, seq, std::chrono::duration<double>(clock::now() - start).count());
    });
    if (!r) {
      broken_ = "the rendezvous did not answer";
      throw group_timeout(fmt::format("{}: collective #{} ({}) timed out and the rendezvous (hosted by rank 0) did not "
                                      "answer within {} ms",
                                      who(), seq, to_string(kind), give_up_grace().count()),
                          {0});
    }
    if (r->type != ReplyType::result && r->type != ReplyType::failed) continue;  // recovery leftovers
    if (r->generation != gen_ || r->sequence != seq) continue;                   // stale
    if (r->type == ReplyType::result) {
      if (r->parts.size() != static_cast<std::size_t>(size_))
        throw error(
            fmt::format("{}: collective #{} returned {} parts for {} ranks", who(), seq, r->parts.size(), size_));
      return std::move(r->parts);
    }
    broken_ = r->message;
    raise(*r);
  }
}

std::vector<std::vector<std::byte>> HubClientGroup::all_gather(std::span<const std::byte> mine) {
  Part p;
  p.bytes.assign(mine.begin(), mine.end());
  std::vector<Part> parts = exchange(CollectiveKind::all_gather, std::move(p));
  std::vector<std::vector<std::byte>> out;
  out.reserve(parts.size());
  for (auto& part : parts) out.push_back(std::move(part.bytes));
  return out;
}

std::vector<std::vector<UniqueFd>> HubClientGroup::all_gather_fds(std::span<const int> mine) {
  Part p;
  for (int fd : mine) {
    if (fd < 0) throw invalid_argument(fmt::format("{}: all_gather_fds given an invalid descriptor {}", who(), fd));
    p.fds.push_back(UniqueFd::dup_of(fd));  // the caller keeps its own descriptor
  }
  std::vector<Part> parts = exchange(CollectiveKind::all_gather_fds, std::move(p));
  std::vector<std::vector<UniqueFd>> out;
  out.reserve(parts.size());
  for (auto& part : parts) out.push_back(std::move(part.fds));
  return out;
}

void HubClientGroup::barrier() { exchange(CollectiveKind::barrier, Part{}); }

void HubClientGroup::recover() {
  post_recover(gen_);
  Wait wait{clock::now() + timeout_};
  for (;;) {
    std::optional<Received> r = reply_or_give_up(wait, [&] { post_give_up_recovery(gen_); });
    if (!r) {
      throw group_timeout(fmt::format("{}: recover() got no answer from the rendezvous (hosted by rank 0) within {} ms",
                                      who(), (timeout_ + give_up_grace()).count()),
                          {0});
    }
    if (r->type == ReplyType::recovered && r->generation > gen_) {  // older ones are leftovers
      gen_ = r->generation;
      seq_ = 0;
      broken_.reset();
      log::info("{}: recovered, generation {}", who(), gen_);
      return;
    }
    if (r->type == ReplyType::recover_pending && r->generation == gen_)
      throw group_timeout(fmt::format("{}: recover() timed out after {} ms: rank(s) {} have not called recover()",
                                      who(), timeout_.count(), format_ranks(r->missing)),
                          r->missing);
    if (r->type == ReplyType::failed && r->sequence == 0) raise(*r);  // recovery itself failed (a rank left)
    // Anything else is a leftover of the old generation.
  }
}

// ---------------------------------------------------------------------------------------------
// WireClientGroup

void WireClientGroup::lost(const std::exception& e) const {
  throw invalid_state(fmt::format("{}: lost the rendezvous hosted by rank 0{} ({}); rank 0 exited or destroyed its "
                                  "group; build a new group",
                                  who(), rendezvous_address(), e.what()));
}

void WireClientGroup::send(MessageType type, const std::vector<std::byte>& body, std::span<const int> fds) {
  try {
    send_to_hub(type, {body.data(), body.size()}, fds);
  } catch (const std::exception& e) {
    lost(e);
  }
}

void WireClientGroup::post_contribution(std::uint64_t g, std::uint64_t s, CollectiveKind k, Part p) {
  std::vector<int> fds;
  fds.reserve(p.fds.size());
  for (auto& f : p.fds) fds.push_back(f.get());
  // The kernel duplicates the descriptors into the hub's process.
  send(MessageType::contribute, encode_contribution(g, s, k, p.bytes), fds);
}

void WireClientGroup::post_give_up(std::uint64_t g, std::uint64_t s, double waited) {
  send(MessageType::give_up, encode_give_up(g, s, waited));
}

void WireClientGroup::post_recover(std::uint64_t g) { send(MessageType::recover, encode_generation(g)); }

void WireClientGroup::post_give_up_recovery(std::uint64_t g) {
  send(MessageType::give_up_recovery, encode_generation(g));
}

std::optional<Received> WireClientGroup::next_reply(clock::time_point deadline) {
  std::optional<Message> m;
  try {
    m = receive_from_hub(deadline);
  } catch (const std::exception& e) {
    lost(e);
  }
  if (!m) return std::nullopt;
  if (m->type != MessageType::reply) throw error(fmt::format("{}: unexpected message from the rendezvous", who()));
  return decode_reply(*m);
}

}  // namespace torpor::detail
