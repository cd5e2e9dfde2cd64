// SymmetricHeap: peer mappings at fixed addresses, collective sleep/wake, multicast binding.
// The contract is in symmetric.hpp; this note is about how the code keeps it. The class lives in
// four files: this one (creation, allocate and free, the agreed steps, local release),
// symmetric_mappings.cpp (placing this rank's part and mapping the peers'), symmetric_multicast.cpp
// (the multicast binding) and symmetric_sleep.cpp (collective sleep and wake of the buffers); how
// the parts travel is handle_kinds.hpp's.
//
// Invariants (under mu_):
//   - a buffer's imports are all or none: after any failed step every rank drops the imports of
//     the buffers that step touched, so "needs import" is the same question on every rank;
//   - a peer's import is mapped exactly at peer_va_[r], which never changes; the address ranges
//     are released only when the buffer is freed;
//   - a multicast binding is either complete (added, bound, mapped on this rank) or torn down;
//     its address never changes;
//   - every collective step is agreed: a step runs locally, then every rank learns every rank's
//     outcome (step()), so all ranks continue or all ranks throw, and nothing waits for a rank that
//     already failed. Only a rank that does not arrive at all makes the others wait, for the
//     group's timeout, after which they throw group_timeout naming it.
#include "torpor/symmetric.hpp"

#include <fmt/core.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <numeric>
#include <set>

#include "common/range_allocator.hpp"
#include "ranks/handle_kinds.hpp"
#include "ranks/multicast.hpp"
#include "ranks/symmetric_internal.hpp"
#include "torpor/consensus.hpp"
#include "torpor/error.hpp"
#include "torpor/log.hpp"

namespace torpor {

namespace {

std::string one_line(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  return s;
}

template <typename T>
bool parse_whole(const std::string& text, T& value) {
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  return ec == std::errc() && end == text.data() + text.size();
}

}  // namespace

void* SymmetricBuffer::peer(int r) const {
  if (r < 0 || r >= size())
    throw invalid_argument(fmt::format("SymmetricBuffer::peer: rank {} is outside [0, {})", r, size()));
  return reinterpret_cast<void*>(peer_va_[static_cast<std::size_t>(r)]);
}

bool SymmetricBuffer::peers_mapped() const noexcept {
  for (std::size_t r = 0; r < imports_.size(); ++r)
    if (static_cast<int>(r) != rank_ && !imports_[r].mapped) return false;
  return true;
}

// ---------------------------------------------------------------------------------------------

SymmetricHeap::SymmetricHeap(Pool& pool, Group& group, SymmetricHeapOptions options)
    : pool_(pool), driver_(pool.driver()), group_(group), options_(std::move(options)) {
  std::string problem;
  if (!pool_.options().exportable)
    problem = "its pool is not exportable (create it with PoolOptions::exportable = true)";
  else if (options_.table_tag.empty())
    problem = "SymmetricHeapOptions::table_tag is empty";
  // Every rank announces its device, its process, any problem with its arguments, its node, and
  // which handle kinds it can export (descriptors; fabric as a real export answered).
  detail::SharingAbility sharing;
  if (problem.empty()) {
    try {
      sharing = detail::probe_sharing(driver_, pool_.device());
    } catch (const std::exception& e) {
      problem = fmt::format("asking the driver which handle kinds it can share failed: {}", e.what());
    }
  }
  const std::string mine =
      consensus::encode_fields({std::to_string(pool_.device()), std::to_string(::getpid()), problem, sharing.node,
                                sharing.posix_fd ? "1" : "0", sharing.fabric ? "1" : "0", sharing.fabric_why});
  std::vector<std::string> all;
  try {
    all = consensus::gather_text(group_, mine);
  } catch (const group_timeout& e) {
    throw group_timeout(fmt::format("{}: creating the symmetric heap (collective): {}", who(), e.what()), e.missing());
  }
  std::set<long> pids;
  std::string problems;
  std::vector<detail::SharingAbility> abilities;
  for (std::size_t r = 0; r < all.size(); ++r) {
    const std::string what = fmt::format("{}: malformed heap announcement from rank {}", who(), r);
    auto f = consensus::decode_fields(all[r], 7, what);
    abilities.push_back({f[3], f[4] == "1", f[5] == "1", f[6]});
    int device = 0;
    long pid = 0;
    if (!parse_whole(f[0], device) || !parse_whole(f[1], pid)) throw error(what);
    devices_.push_back(device);
    pids.insert(pid);
    if (!f[2].empty()) problems += fmt::format("; rank {}: {}", r, f[2]);
  }
  if (!problems.empty()) throw invalid_argument(fmt::format("{}: cannot create the symmetric heap{}", who(), problems));
  one_process_ = pids.size() == 1;
  const detail::HandleKindChoice choice = detail::choose_handle_kind(abilities, group_, who());
  handle_kind_ = choice.kind;
  nodes_ = choice.nodes;
  log::debug("{}: parts travel as {} ({} node(s))", who(), to_string(handle_kind_), nodes_);
  if (one_process_) {
    // Ranks that are threads of one process must each have a device of their own.
    std::vector<int> sorted = devices_;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
      throw invalid_argument(fmt::format("{}: ranks of one process share a device (devices by rank: [{}]); give every "
                                         "rank its own device",
                                         who(), fmt::join(devices_, ", ")));
  }
  pool_.add_observer(this);
}

SymmetricHeap::~SymmetricHeap() {
  try {
    pool_.remove_observer(this);
  } catch (const std::exception& e) {
    log::error("{}: removing the sleep observer failed: {}", who(), e.what());
  }
  std::lock_guard lock(mu_);
  for (auto& [id, b] : buffers_) release_local(*b);
  buffers_.clear();
}

std::string SymmetricHeap::who() const {
  return fmt::format("symmetric heap rank {} of {} (device {})", group_.rank(), group_.size(), pool_.device());
}

std::vector<SymmetricBuffer*> SymmetricHeap::buffers() const {
  std::lock_guard lock(mu_);
  std::vector<SymmetricBuffer*> out;
  out.reserve(buffers_.size());
  for (auto& [id, b] : buffers_) out.push_back(b.get());
  return out;
}

std::optional<MulticastDecision> SymmetricHeap::multicast_decision() const {
  std::lock_guard lock(mu_);
  return decision_;
}

std::vector<SymmetricBuffer*> SymmetricHeap::in_tags(const std::vector<std::string>& tags) const {
  std::vector<SymmetricBuffer*> out;
  for (auto& [id, b] : buffers_)
    if (std::find(tags.begin(), tags.end(), b->tag_) != tags.end()) out.push_back(b.get());
  return out;
}

std::vector<std::string> SymmetricHeap::agree(const std::string& operation, const std::string& request,
                                              const std::string& extra) {
  consensus::Agreement a = consensus::compare_requests(group_, one_line(request), extra);
  if (!a.agreed()) {
    std::string text;
    for (std::size_t r = 0; r < a.requests.size(); ++r)
      text += fmt::format("{}rank {}: {}", r == 0 ? "" : "; ", r, a.requests[r]);
    throw invalid_state(fmt::format("{}: ranks disagree on the collective {} ({}); nothing was changed: call it on "
                                    "every rank with the same arguments",
                                    who(), operation, text));
  }
  return std::move(a.extras);
}

void SymmetricHeap::step(const std::string& what, const std::function<void()>& fn) {
  std::optional<std::string> message;  // this rank's failure, for the log should the group fail too
  auto action = [&] {
    try {
      fn();
    } catch (const std::exception& e) {
      message = e.what();
      throw;
    }
  };
  consensus::Outcomes outcomes;
  try {
    outcomes = consensus::run_all_or_none(group_, action);
  } catch (...) {
    if (message) log::error("{}: {} failed here ({}) and the group could not be told", who(), what, *message);
    throw;
  }
  if (outcomes.local) std::rethrow_exception(outcomes.local);
  if (!outcomes.ok())
    throw error(fmt::format("{}: {} failed on rank(s) {}{}", who(), what, format_ranks(outcomes.failed_ranks()),
                            outcomes.details()));
}

PhysicalHandle SymmetricHeap::own_handle(const SymmetricBuffer& b) const {
  auto ci = pool_.chunk_info(b.local_);
  if (!ci || !ci->awake || !ci->handle)
    throw invalid_state(
        fmt::format("{}: symmetric buffer {} is asleep on this rank (tag '{}'); wake it first", who(), b.id_, b.tag_));
  return ci->handle;
}

void SymmetricHeap::release_local(SymmetricBuffer& b) noexcept {
  try {
    teardown_multicast(b);
  } catch (const std::exception& e) {
    log::error("{}: releasing the multicast binding of buffer {}: {}", who(), b.id_, e.what());
  }
  try {
    drop_imports(b);
  } catch (const std::exception& e) {
    log::error("{}: releasing the peer mappings of buffer {}: {}", who(), b.id_, e.what());
  }
  try {
    if (b.mc_ && b.mc_->range && !b.mc_->mapped) {
      pool_.release_address_range(b.mc_->range);
      b.mc_->range = 0;
    }
    bool any_mapped = std::any_of(b.imports_.begin(), b.imports_.end(), [](auto& i) { return i.mapped; });
    if (b.peer_range_ && !any_mapped) {
      pool_.release_address_range(b.peer_range_);
      b.peer_range_ = 0;
    }
    if (b.table_) {
      pool_.deallocate(b.table_);
      b.table_ = nullptr;
    }
    if (b.local_) {
      pool_.deallocate(b.local_);
      b.local_ = nullptr;
    }
  } catch (const std::exception& e) {
    log::error("{}: freeing symmetric buffer {}: {}", who(), b.id_, e.what());
  }
}

// ---------------------------------------------------------------------------------------------
// allocate / free

SymmetricBuffer& SymmetricHeap::allocate(std::size_t bytes, const SymmetricBufferOptions& o) {
  std::lock_guard lock(mu_);
  const int n = group_.size();
  const int me = group_.rank();
  std::string request = fmt::format("allocate bytes {} tag '{}' multicast {}", bytes, o.tag, o.multicast);
  auto context = [&](const group_timeout& e) {
    return group_timeout(fmt::format("{}: symmetric allocate ({}): {}", who(), request, e.what()), e.missing());
  };
  try {
    agree("allocate", request, "");
  } catch (const group_timeout& e) {
    throw context(e);
  }
  // Every rank asked the same, so every rank throws the same here.
  if (bytes == 0) throw invalid_argument(fmt::format("{}: symmetric allocate of 0 bytes", who()));
  if (o.tag.empty()) throw invalid_argument(fmt::format("{}: symmetric allocate with an empty tag", who()));

  auto b = std::make_unique<SymmetricBuffer>();
  b->bytes_ = bytes;
  b->tag_ = o.tag;
  b->name_ = o.name;
  b->rank_ = me;
  b->peer_va_.assign(static_cast<std::size_t>(n), 0);
  b->imports_.resize(static_cast<std::size_t>(n));
  try {
    bool use_multicast = false;
    if (o.multicast) {
      if (!decision_) decision_ = decide_multicast(group_, driver_, pool_.device());
      use_multicast = decision_->use;
    }
    const std::size_t granularity = pool_.granularity();
    std::size_t alignment = granularity;
    if (use_multicast)
      step("querying the multicast granularity",
           [&] { alignment = std::lcm(granularity, driver_.multicast_granularity(devices_, bytes)); });
    // Large enough for a chunk of its own: exporting it must share nothing else.
    b->part_bytes_ = align_up(std::max(bytes, pool_.options().small_limit + 1), alignment);

    step("allocating this rank's part", [&] { place_local(*b, o, use_multicast, alignment); });

    detail::SharedParts shared = share_parts({b.get()});
    step("mapping the peers' parts", [&] { import_peers(*b, shared, 0); });
    if (b->mc_) setup_multicast(*b, *b->mc_);
    step("writing the peer table", [&] { write_table(*b); });
  } catch (const group_timeout& e) {
    release_local(*b);
    throw context(e);
  } catch (...) {
    release_local(*b);
    throw;
  }
  b->id_ = next_id_++;
  SymmetricBuffer& ref = *b;
  buffers_[ref.id_] = std::move(b);
  log::debug("{}: symmetric buffer {} of {} bytes ({} per rank) in tag '{}'{}", who(), ref.id_, bytes, ref.part_bytes_,
             ref.tag_, ref.mc_ ? ", multicast" : "");
  return ref;
}

void SymmetricHeap::free(SymmetricBuffer& buffer) {
  std::lock_guard lock(mu_);
  auto it = buffers_.find(buffer.id_);
  if (it == buffers_.end() || it->second.get() != &buffer)
    throw invalid_argument(fmt::format("{}: free of a symmetric buffer this heap does not hold", who()));
  release_local(*it->second);
  buffers_.erase(it);
}

}  // namespace torpor
