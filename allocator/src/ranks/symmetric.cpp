// SymmetricHeap: peer mappings at fixed addresses, collective sleep/wake, multicast binding.
// The contract is in symmetric.hpp; this note is about how the code keeps it.
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
#include "ranks/multicast.hpp"
#include "torpor/consensus.hpp"
#include "torpor/error.hpp"
#include "torpor/log.hpp"

namespace torpor {

namespace {

std::string one_line(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  return s;
}

std::string ids_of(const std::vector<SymmetricBuffer*>& bs) {
  std::vector<std::uint64_t> ids;
  ids.reserve(bs.size());
  for (auto* b : bs) ids.push_back(b->id());
  return fmt::format("[{}]", fmt::join(ids, ", "));
}

template <typename T>
bool parse_whole(const std::string& text, T& value) {
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  return ec == std::errc() && end == text.data() + text.size();
}

// Runs fn and keeps the first exception, so a cleanup can try every piece.
template <typename F>
void attempt(std::exception_ptr& first, F&& fn) {
  try {
    fn();
  } catch (...) {
    if (!first) first = std::current_exception();
  }
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
  std::string node;
  std::string fabric = "0";
  std::string fabric_why;
  bool posix = false;
  if (problem.empty()) {
    try {
      node = driver_.node_name();
      posix = driver_.capabilities().posix_fd_handles;
      FabricProbe probe = driver_.probe_fabric(pool_.device());
      fabric = probe.supported() ? "1" : "0";
      fabric_why = probe.describe();
    } catch (const std::exception& e) {
      problem = fmt::format("asking the driver which handle kinds it can share failed: {}", e.what());
    }
  }
  const std::string mine = consensus::encode_fields({std::to_string(pool_.device()), std::to_string(::getpid()),
                                                     problem, node, posix ? "1" : "0", fabric, fabric_why});
  std::vector<std::string> all;
  try {
    all = consensus::gather_text(group_, mine);
  } catch (const group_timeout& e) {
    throw group_timeout(fmt::format("{}: creating the symmetric heap (collective): {}", who(), e.what()), e.missing());
  }
  std::set<long> pids;
  std::set<std::string> nodes;
  std::string problems;
  bool all_posix = true;
  std::string no_fabric;  // the ranks that cannot use fabric handles, and why
  for (std::size_t r = 0; r < all.size(); ++r) {
    const std::string what = fmt::format("{}: malformed heap announcement from rank {}", who(), r);
    auto f = consensus::decode_fields(all[r], 7, what);
    nodes.insert(f[3]);
    all_posix = all_posix && f[4] == "1";
    if (f[5] != "1") no_fabric += fmt::format("; rank {} ({}): {}", r, f[3], f[6]);
    int device = 0;
    long pid = 0;
    if (!parse_whole(f[0], device) || !parse_whole(f[1], pid)) throw error(what);
    devices_.push_back(device);
    pids.insert(pid);
    if (!f[2].empty()) problems += fmt::format("; rank {}: {}", r, f[2]);
  }
  if (!problems.empty()) throw invalid_argument(fmt::format("{}: cannot create the symmetric heap{}", who(), problems));
  one_process_ = pids.size() == 1;
  nodes_ = static_cast<int>(nodes.size());
  if (nodes_ == 1 && group_.carries_fds() && all_posix) {
    handle_kind_ = HandleKind::posix_fd;
  } else if (no_fabric.empty()) {
    handle_kind_ = HandleKind::fabric;
  } else {
    const std::string why_not_fds =
        nodes_ > 1              ? fmt::format("the ranks run on {} nodes", nodes_)
        : !group_.carries_fds() ? fmt::format("the group ('{}') carries only bytes, not descriptors", group_.kind())
                                : std::string("not every rank's driver exports POSIX descriptors");
    throw invalid_argument(fmt::format("{}: cannot share memory between the ranks: POSIX descriptors are out ({}) and "
                                       "fabric handles are refused{}",
                                       who(), why_not_fds, no_fabric));
  }
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

template <typename F>
void SymmetricHeap::step(const std::string& what, F&& fn) {
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

SymmetricHeap::SharedParts SymmetricHeap::share_parts(const std::vector<SymmetricBuffer*>& work) {
  SharedParts out;
  std::vector<UniqueFd> own;
  std::vector<int> raw;
  std::vector<std::byte> blobs;
  step("exporting this rank's parts", [&] {
    for (SymmetricBuffer* b : work) {
      if (handle_kind_ == HandleKind::fabric) {
        FabricHandle h = driver_.export_fabric(own_handle(*b));
        blobs.insert(blobs.end(), h.bytes.begin(), h.bytes.end());
      } else {
        own.emplace_back(driver_.export_fd(own_handle(*b)));
        raw.push_back(own.back().get());
      }
    }
  });
  if (handle_kind_ == HandleKind::fabric)
    out.blobs = group_.all_gather(blobs);
  else
    out.fds = group_.all_gather_fds(raw);
  return out;
}

void SymmetricHeap::import_peers(SymmetricBuffer& b, const SharedParts& shared, std::size_t i) {
  const int me = group_.rank();
  const int device = pool_.device();
  for (int r = 0; r < group_.size(); ++r) {
    auto& imp = b.imports_[static_cast<std::size_t>(r)];
    if (r == me || imp.mapped) continue;
    const auto ru = static_cast<std::size_t>(r);
    if (!imp.handle) {
      // Every rank's part is part_bytes_ long.
      if (handle_kind_ == HandleKind::fabric) {
        const auto& blob = shared.blobs[ru];
        if (blob.size() < (i + 1) * fabric_handle_bytes)
          throw error(fmt::format("{}: rank {} sent no fabric handle for symmetric buffer {}", who(), r, b.id_));
        FabricHandle h;
        std::copy_n(blob.begin() + static_cast<std::ptrdiff_t>(i * fabric_handle_bytes), fabric_handle_bytes,
                    h.bytes.begin());
        try {
          imp.handle = driver_.import_fabric(h, b.part_bytes_);
        } catch (const driver_error& e) {
          throw driver_error(e.code(), e.call(),
                             fmt::format("{}: importing rank {}'s part of symmetric buffer {} (fabric handle): {}",
                                         who(), r, b.id_, e.what()));
        }
      } else {
        if (i >= shared.fds[ru].size())
          throw error(fmt::format("{}: rank {} sent no handle for symmetric buffer {}", who(), r, b.id_));
        imp.handle = driver_.import_fd_of_size(shared.fds[ru][i].get(), b.part_bytes_);
      }
    }
    device_ptr va = b.peer_va_[static_cast<std::size_t>(r)];
    driver_.map(va, b.part_bytes_, imp.handle, 0);
    imp.mapped = true;
    try {
      driver_.set_access(va, b.part_bytes_, std::span(&device, 1));
    } catch (...) {
      try {
        driver_.unmap(va, b.part_bytes_);
        imp.mapped = false;
      } catch (const std::exception& e) {
        log::error("{}: unmapping rank {}'s part of buffer {} after a failed set_access: {}", who(), r, b.id_,
                   e.what());
      }
      throw;
    }
  }
}

void SymmetricHeap::drop_imports(SymmetricBuffer& b) {
  std::exception_ptr first;
  for (std::size_t r = 0; r < b.imports_.size(); ++r) {
    auto& imp = b.imports_[r];
    if (imp.mapped)
      attempt(first, [&] {
        driver_.unmap(b.peer_va_[r], b.part_bytes_);
        imp.mapped = false;
      });
    // A handle whose mapping could not be removed is kept: releasing it would not free anything.
    if (imp.handle && !imp.mapped)
      attempt(first, [&] {
        driver_.release(imp.handle);
        imp.handle = {};
      });
  }
  if (first) std::rethrow_exception(first);
}

void SymmetricHeap::teardown_multicast(SymmetricBuffer& b) {
  if (!b.mc_) return;
  auto& m = *b.mc_;
  const int device = pool_.device();
  std::exception_ptr first;
  if (m.mapped)
    attempt(first, [&] {
      driver_.unmap(m.va, m.bytes);
      m.mapped = false;
    });
  if (m.bound)
    attempt(first, [&] {
      driver_.multicast_unbind(m.handle, device, 0, m.bytes);
      m.bound = false;
    });
  if (m.handle && !m.mapped && !m.bound)
    attempt(first, [&] {
      driver_.multicast_release(m.handle);
      m.handle = {};
      m.added = false;
    });
  if (first) std::rethrow_exception(first);
}

void SymmetricHeap::setup_multicast(SymmetricBuffer& b, SymmetricBuffer::Multicast& m) {
  const bool root = group_.rank() == 0;
  const int device = pool_.device();
  try {
    // Rank 0 creates the object for every rank's device and shares it; each rank then adds its
    // own device. Binding is legal only once every device was added (the driver checks), so the
    // steps are agreed one by one.
    // The object travels as the heap's memory does: a descriptor within a node, a fabric handle
    // over the group's bytes otherwise.
    const bool fabric = handle_kind_ == HandleKind::fabric;
    UniqueFd fd;
    FabricHandle blob;
    step("creating the multicast object", [&] {
      teardown_multicast(b);  // what an earlier failure may have left; nothing otherwise
      if (!root) return;
      m.handle = driver_.multicast_create(devices_, m.bytes);
      if (fabric)
        blob = driver_.multicast_export_fabric(m.handle);
      else
        fd.reset(driver_.multicast_export_fd(m.handle));
    });
    std::vector<std::vector<UniqueFd>> fds;
    std::vector<std::vector<std::byte>> blobs;
    if (fabric) {
      std::vector<std::byte> mine;
      if (root) mine.assign(blob.bytes.begin(), blob.bytes.end());
      blobs = group_.all_gather(mine);
    } else {
      std::vector<int> mine;
      if (root) mine.push_back(fd.get());
      fds = group_.all_gather_fds(mine);
    }
    step("joining the multicast object", [&] {
      if (!root && fabric) {
        if (blobs[0].size() != fabric_handle_bytes)
          throw error(fmt::format("{}: rank 0 shared no multicast object", who()));
        FabricHandle h;
        std::copy(blobs[0].begin(), blobs[0].end(), h.bytes.begin());
        m.handle = driver_.multicast_import_fabric(h);
      } else if (!root) {
        if (fds[0].size() != 1) throw error(fmt::format("{}: rank 0 shared no multicast object", who()));
        m.handle = driver_.multicast_import_fd(fds[0][0].get());
      }
      driver_.multicast_add_device(m.handle, device);
      m.added = true;
    });
    step("binding to the multicast object", [&] {
      driver_.multicast_bind(m.handle, 0, own_handle(b), 0, m.bytes);
      m.bound = true;
      driver_.map(m.va, m.bytes, driver_.as_physical(m.handle), 0);
      m.mapped = true;
      driver_.set_access(m.va, m.bytes, std::span(&device, 1));
    });
  } catch (...) {
    try {
      teardown_multicast(b);
    } catch (const std::exception& e) {
      log::error("{}: tearing down a half-made multicast binding of buffer {}: {}", who(), b.id_, e.what());
    }
    throw;
  }
}

void SymmetricHeap::write_table(SymmetricBuffer& b) {
  std::vector<std::uint64_t> t;
  t.reserve(b.peer_va_.size() + 1);
  for (device_ptr va : b.peer_va_) t.push_back(va);
  t.push_back(b.mc_ ? b.mc_->va : 0);
  pool_.copy(b.table_, t.data(), t.size() * sizeof(std::uint64_t));
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

void SymmetricHeap::place_local(SymmetricBuffer& b, const SymmetricBufferOptions& o, bool use_multicast,
                                std::size_t alignment) {
  const int n = group_.size();
  const int me = group_.rank();
  const std::size_t granularity = pool_.granularity();
  b.local_ = pool_.allocate(b.part_bytes_, {o.tag, MemoryClass::state, o.name, /*dedicated=*/true});
  auto ci = pool_.chunk_info(b.local_);
  if (!ci || !ci->dedicated || ci->offset != 0 || ci->bytes != b.part_bytes_)
    throw error(fmt::format("{}: the pool placed symmetric buffer part ({} bytes) inside a shared chunk; it must "
                            "have a chunk of its own",
                            who(), b.part_bytes_));
  std::string table_name = (o.name.empty() ? fmt::format("symmetric.{}", next_id_) : o.name) + ".peers";
  b.table_ = pool_.allocate((static_cast<std::size_t>(n) + 1) * sizeof(std::uint64_t),
                            {options_.table_tag, MemoryClass::state, table_name});
  b.peer_range_ = pool_.reserve_address_range(static_cast<std::size_t>(n) * b.part_bytes_);
  for (int r = 0; r < n; ++r)
    b.peer_va_[static_cast<std::size_t>(r)] =
        r == me ? reinterpret_cast<device_ptr>(b.local_) : b.peer_range_ + static_cast<std::size_t>(r) * b.part_bytes_;
  if (use_multicast) {
    SymmetricBuffer::Multicast m;
    m.bytes = b.part_bytes_;
    std::size_t slack = alignment > granularity ? alignment : 0;
    m.range = pool_.reserve_address_range(m.bytes + slack);
    m.va = align_up(m.range, alignment);
    b.mc_ = m;
  }
}

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

    SharedParts shared = share_parts({b.get()});
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

// ---------------------------------------------------------------------------------------------
// Collective sleep and wake (the pool calls these around its own work)

void SymmetricHeap::before_sleep(Pool&, int level, const std::vector<std::string>& tags) {
  std::lock_guard lock(mu_);
  auto affected = in_tags(tags);
  if (affected.empty()) return;
  std::string request = fmt::format("sleep level {} of symmetric buffers {}", level, ids_of(affected));
  try {
    // This device's writes into peers' memory must land before any peer copies its bytes out.
    driver_.device_synchronize(pool_.device());
    agree("sleep", request, "");
  } catch (const group_timeout& e) {
    throw group_timeout(fmt::format("{}: collective {}: {}", who(), request, e.what()), e.missing());
  }
  // Every rank now lets go of what keeps the others' memory alive; then the pool releases ours.
  try {
    step("dropping the peer mappings", [&] {
      std::exception_ptr first;
      for (SymmetricBuffer* b : affected) {
        attempt(first, [&] { teardown_multicast(*b); });
        attempt(first, [&] { drop_imports(*b); });
      }
      if (first) std::rethrow_exception(first);
    });
  } catch (...) {
    // Every rank is here and nothing sleeps: map again what was dropped (a group that failed
    // refuses this at once; then the next wake does it).
    try {
      reimport(affected);
    } catch (const std::exception& e) {
      log::error("{}: restoring the peer mappings after a failed sleep failed: {}", who(), e.what());
    }
    throw;
  }
}

void SymmetricHeap::before_wake(Pool&, const std::vector<std::string>& tags) {
  std::lock_guard lock(mu_);
  wake_work_.reset();
  auto affected = in_tags(tags);
  if (affected.empty()) return;
  std::string request = fmt::format("wake_up of symmetric buffers {}", ids_of(affected));
  std::string needs;
  for (SymmetricBuffer* b : affected) {
    bool complete = b->peers_mapped() && (!b->mc_ || (b->mc_->mapped && b->mc_->bound));
    needs += complete ? '0' : '1';
  }
  std::vector<std::string> all;
  try {
    all = agree("wake_up", request, needs);
  } catch (const group_timeout& e) {
    throw group_timeout(fmt::format("{}: collective {}: {}", who(), request, e.what()), e.missing());
  }
  std::vector<std::uint64_t> work;
  for (std::size_t i = 0; i < affected.size(); ++i)
    if (std::any_of(all.begin(), all.end(), [&](const std::string& s) { return i < s.size() && s[i] == '1'; }))
      work.push_back(affected[i]->id_);
  wake_work_ = std::move(work);
}

void SymmetricHeap::reimport(const std::vector<SymmetricBuffer*>& work) {
  SharedParts shared = share_parts(work);
  try {
    step("mapping the peers' parts", [&] {
      for (std::size_t i = 0; i < work.size(); ++i) import_peers(*work[i], shared, i);
    });
  } catch (...) {
    for (SymmetricBuffer* b : work) {
      try {
        drop_imports(*b);
      } catch (const std::exception& e) {
        log::error("{}: dropping the peer mappings of buffer {} after a failure: {}", who(), b->id_, e.what());
      }
    }
    throw;
  }
  for (SymmetricBuffer* b : work) {
    if (b->mc_) setup_multicast(*b, *b->mc_);
  }
}

void SymmetricHeap::after_sleep(Pool&, int, const std::vector<std::string>& tags, bool ok) {
  // before_sleep dropped every rank's imports of these buffers. When the pool's sleep failed on
  // some rank, the buffers whose parts are still awake on every rank would stay unmapped until a
  // wake: every rank learns every outcome and those get their imports back now. A part asleep
  // anywhere cannot be imported; the wake does it (imports stay all or none).
  std::lock_guard lock(mu_);
  auto affected = in_tags(tags);
  if (affected.empty()) return;
  std::string mine = ok ? "1" : "0";
  for (SymmetricBuffer* b : affected) {
    auto ci = pool_.chunk_info(b->local_);
    mine += ci && ci->awake ? '1' : '0';
  }
  std::vector<std::string> outcomes;
  try {
    outcomes = consensus::gather_text(group_, mine);
  } catch (const std::exception& e) {
    log::error("{}: after a sleep{} the ranks could not compare outcomes ({}); peer mappings of buffers {} are "
               "restored by the next wake",
               who(), ok ? "" : " that failed here", e.what(), ids_of(affected));
    if (ok) throw;
    return;
  }
  if (std::all_of(outcomes.begin(), outcomes.end(), [](const std::string& o) { return !o.empty() && o[0] == '1'; }))
    return;  // asleep everywhere: the wake re-imports
  std::vector<SymmetricBuffer*> work;
  for (std::size_t i = 0; i < affected.size(); ++i)
    if (std::all_of(outcomes.begin(), outcomes.end(),
                    [&](const std::string& o) { return i + 1 < o.size() && o[i + 1] == '1'; }))
      work.push_back(affected[i]);
  if (work.empty()) return;
  try {
    reimport(work);
    log::warn("{}: the sleep failed; the peer mappings of symmetric buffers {} were restored", who(), ids_of(work));
  } catch (const std::exception& e) {
    log::error("{}: restoring the peer mappings of symmetric buffers {} after a failed sleep failed ({}); the next "
               "wake restores them",
               who(), ids_of(work), e.what());
    if (ok) throw;
  }
}

void SymmetricHeap::after_wake(Pool&, const std::vector<std::string>&, bool ok) {
  // Inside Pool::wake_up's handler when !ok: the pool's own exception says why.
  std::string pool_failure = "the pool's wake_up failed on this rank";
  if (!ok) {
    try {
      if (auto p = std::current_exception()) std::rethrow_exception(p);
    } catch (const std::exception& e) {
      pool_failure = fmt::format("the pool's wake_up failed on this rank: {}", e.what());
    } catch (...) {  // NOLINT(bugprone-empty-catch): another type keeps the message above
    }
  }
  std::lock_guard lock(mu_);
  if (!wake_work_) return;  // nothing symmetric in these tags, or after_wake already ran
  std::vector<SymmetricBuffer*> work;
  for (std::uint64_t id : *wake_work_)
    if (auto it = buffers_.find(id); it != buffers_.end()) work.push_back(it->second.get());
  wake_work_.reset();
  if (work.empty()) return;
  std::string request = fmt::format("wake_up of symmetric buffers {}", ids_of(work));
  try {
    step("waking the pool", [&] {
      if (!ok) throw error(pool_failure);
    });
    reimport(work);
  } catch (const group_timeout& e) {
    if (!ok) return;  // the pool rethrows its own error
    throw group_timeout(fmt::format("{}: collective {}: {}", who(), request, e.what()), e.missing());
  } catch (...) {
    if (!ok) return;
    throw;
  }
}

}  // namespace torpor
