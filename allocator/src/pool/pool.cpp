// Pool: reservation, chunks, sub-allocation, classes, tags, stats. Sleep and wake live in
// sleep.cpp; the shared bookkeeping and its invariants in pool_state.hpp.
//
// Size classes (the handle-size policy, see PoolOptions): small allocations are carved from
// granularity-sized slabs, medium ones from slabs that grow with the (tag, class) up to
// medium_slab_max, large ones get a chunk each. Few large handles keep the VMM calls of sleep
// and wake few: a VMM call's cost grows far more slowly than the handle's size, so per byte large
// handles are much cheaper (bench/results/2026-11-30-vmm-costs-h200.md).
//
// The allocation fast path (a slab of the right (tag, class) with room) touches only the
// slab's RangeAllocator and two maps: no driver call. Freed empty small slabs are kept, one
// per (tag, class), so alloc/free churn stays on the fast path; trim() and sleep release them.
// Empty medium slabs are released at once (they are large).
#include "torpor/pool.hpp"

#include <fmt/format.h>
#include <fnmatch.h>

#include <algorithm>

#include "pool/pool_state.hpp"
#include "torpor/error.hpp"
#include "torpor/log.hpp"

namespace torpor {

namespace {

constexpr std::size_t sub_alignment = 256;
constexpr std::size_t recently_freed_limit = 4096;

}  // namespace

std::string_view to_string(MemoryClass c) noexcept {
  switch (c) {
    case MemoryClass::parameter: return "parameter";
    case MemoryClass::state: return "state";
    case MemoryClass::cache: return "cache";
  }
  return "?";
}

MemoryClass parse_memory_class(std::string_view name) {
  if (name == "parameter") return MemoryClass::parameter;
  if (name == "state") return MemoryClass::state;
  if (name == "cache") return MemoryClass::cache;
  throw invalid_argument(fmt::format("unknown memory class '{}' (expected parameter, state or cache)", name));
}

std::string_view to_string(FillOnWake f) noexcept {
  switch (f) {
    case FillOnWake::none: return "none";
    case FillOnWake::zero: return "zero";
    case FillOnWake::poison: return "poison";
  }
  return "?";
}

FillOnWake parse_fill_on_wake(std::string_view name) {
  if (name == "none") return FillOnWake::none;
  if (name == "zero") return FillOnWake::zero;
  if (name == "poison") return FillOnWake::poison;
  throw invalid_argument(fmt::format("unknown fill_on_wake '{}' (expected none, zero or poison)", name));
}

namespace {

void check_class(MemoryClass c) {
  if (static_cast<unsigned>(c) >= memory_class_count)
    throw invalid_argument(fmt::format("unknown memory class {} (expected 0 = parameter, 1 = state, 2 = cache)",
                                       static_cast<unsigned>(c)));
}

std::string hex(device_ptr p) { return fmt::format("{:#x}", p); }

}  // namespace

// ---------------------------------------------------------------------------------------------
// State helpers

PhysicalHandle Pool::State::create_memory(std::size_t bytes, const std::string& tag) {
  try {
    return driver.create(options.device, bytes, options.exportable);
  } catch (const driver_error& e) {
    if (!e.is_out_of_memory()) throw;
    MemoryInfo mi{};
    try {
      mi = driver.memory_info(options.device);
    } catch (...) {
    }
    throw out_of_memory(fmt::format("device {} out of memory: {} bytes for tag '{}' ({} of {} bytes free): {}",
                                    options.device, bytes, tag, mi.free_bytes, mi.total_bytes, e.what()));
  }
}

PhysicalHandle Pool::State::map_new_memory(device_ptr va, std::size_t bytes, const std::string& tag) {
  PhysicalHandle h = create_memory(bytes, tag);
  bool mapped = false;
  try {
    driver.map(va, bytes, h, 0);
    mapped = true;
    driver.set_access(va, bytes, access_devices);
  } catch (...) {
    if (mapped) {
      try {
        driver.unmap(va, bytes);
      } catch (const std::exception& e) {
        log::error("pool: rollback unmap of {} failed: {}", hex(va), e.what());
      }
    }
    release_or_defer(h);
    throw;
  }
  return h;
}

Chunk& Pool::State::new_chunk(std::size_t bytes, const std::string& tag, MemoryClass cls, ChunkKind kind) {
  auto off = va.allocate(bytes, granularity);
  if (!off)
    throw out_of_memory(fmt::format(
        "pool VA reservation exhausted: {} bytes for tag '{}' do not fit ({} of {} bytes free, largest hole {}); "
        "raise PoolOptions::va_bytes",
        bytes, tag, va.free_bytes(), va.capacity(), va.largest_free()));
  device_ptr at = va_base + *off;
  PhysicalHandle h;
  try {
    h = map_new_memory(at, bytes, tag);
  } catch (...) {
    va.free(*off, bytes);
    throw;
  }
  auto c = std::make_unique<Chunk>();
  c->va = at;
  c->bytes = bytes;
  c->tag = tag;
  c->cls = cls;
  c->kind = kind;
  c->handle = h;
  if (c->slab()) c->space = RangeAllocator(bytes);
  Chunk& ref = *c;
  chunks[at] = std::move(c);
  return ref;
}

void Pool::State::release_or_defer(PhysicalHandle h) noexcept {
  try {
    driver.release(h);
  } catch (const std::exception& e) {
    log::warn("pool: releasing a physical handle failed, will retry: {}", e.what());
    pending_release.push_back(h);
  }
}

void Pool::State::retry_pending_releases() noexcept {
  std::vector<PhysicalHandle> still;
  for (PhysicalHandle h : pending_release) {
    try {
      driver.release(h);
    } catch (const std::exception& e) {
      log::warn("pool: retrying a deferred release failed again: {}", e.what());
      still.push_back(h);
    }
  }
  pending_release = std::move(still);
}

void Pool::State::unmap_and_release(Chunk& c) {
  driver.unmap(c.va, c.bytes);  // throws with nothing changed
  PhysicalHandle h = c.handle;
  c.handle = {};
  release_or_defer(h);
}

void Pool::State::free_span(const HostSpan& span) noexcept {
  try {
    host.free(span.ptr, span.bytes);
  } catch (const std::exception& e) {
    log::error("pool: freeing a host copy failed: {}", e.what());
  }
}

void Pool::State::drop_all_copies(std::map<std::size_t, HostCopy>& copies) noexcept {
  for (auto& [off, c] : copies) free_span(c.span);
  copies.clear();
}

void Pool::State::drop_copies(std::map<std::size_t, HostCopy>& copies, std::size_t lo, std::size_t hi) {
  if (lo >= hi) return;
  auto it = copies.upper_bound(lo);
  if (it != copies.begin()) --it;
  while (it != copies.end() && it->first < hi) {
    std::size_t start = it->first;
    HostCopy c = it->second;
    std::size_t end = start + c.bytes;
    if (end <= lo) {
      ++it;
      continue;
    }
    it = copies.erase(it);
    std::size_t cut_lo = std::max(lo, start);
    std::size_t cut_hi = std::min(hi, end);
    // Left piece keeps [start, cut_lo); right piece keeps [cut_hi, end) plus the store's
    // rounding slack; the middle goes back to the store. Split pieces lose their hash.
    std::size_t slack = c.span.bytes - c.bytes;
    if (cut_lo > start) copies[start] = HostCopy{cut_lo - start, HostSpan{c.span.ptr, cut_lo - start, c.span.pinned}, {}, false};
    if (cut_hi < end) {
      copies[cut_hi] = HostCopy{end - cut_hi, HostSpan{c.span.ptr + (cut_hi - start), end - cut_hi + slack, c.span.pinned},
                                {}, false};
      free_span(HostSpan{c.span.ptr + (cut_lo - start), cut_hi - cut_lo, c.span.pinned});
    } else {
      free_span(HostSpan{c.span.ptr + (cut_lo - start), cut_hi - cut_lo + slack, c.span.pinned});
    }
    it = copies.lower_bound(cut_hi);
  }
}

Event Pool::State::event(std::size_t i) {
  while (events.size() <= i) events.push_back(driver.event_create(options.device));
  return events[i];
}

void Pool::State::dispose_chunk(Chunk& c) {
  if (c.awake) unmap_and_release(c);  // may throw: then nothing changed
  drop_all_copies(c.backups);
  drop_all_copies(c.retained);
  va.free(c.va - va_base, c.bytes);
  chunks.erase(c.va);
}

bool Pool::State::preserved(const Segment& s) const {
  for (const auto& g : preserve)
    if (::fnmatch(g.c_str(), s.name.c_str(), 0) == 0) return true;
  return false;
}

bool Pool::State::survives(const Segment& s, int level) const {
  switch (s.cls) {
    case MemoryClass::state: return true;
    case MemoryClass::cache: return false;
    case MemoryClass::parameter: return level <= 1 || preserved(s);
  }
  return true;
}

Allocation* Pool::State::containing(device_ptr p) const {
  auto up = allocations.upper_bound(p);
  if (up == allocations.begin()) return nullptr;
  Allocation* a = std::prev(up)->second.get();
  return p < a->base + a->bytes ? a : nullptr;
}

std::vector<std::string> Pool::State::resolve_tags(const std::vector<std::string>& requested,
                                                    const char* operation) const {
  std::vector<std::string> out;
  if (requested.empty()) {
    for (auto& [t, s] : tags) out.push_back(t);
    return out;
  }
  for (const auto& t : requested) {
    if (!tags.count(t)) {
      std::string known;
      for (auto& [k, s] : tags) known += fmt::format("{}'{}'", known.empty() ? "" : ", ", k);
      throw invalid_argument(fmt::format("{}: unknown tag '{}' (known tags: {})", operation, t,
                                         known.empty() ? std::string("none yet") : known));
    }
    if (std::find(out.begin(), out.end(), t) == out.end()) out.push_back(t);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Pool

Pool::Pool(Driver& driver, PoolOptions options) : driver_(driver), options_(std::move(options)) {
  int count = driver_.device_count();
  if (options_.device < 0 || options_.device >= count)
    throw invalid_argument(fmt::format("Pool: device {} does not exist ({} {} device(s) present)", options_.device,
                                       count, driver_.backend_name()));
  DeviceProperties props = driver_.device_properties(options_.device);
  if (!props.vmm_supported)
    throw error(fmt::format("device {} ({}) does not support CUDA virtual memory management "
                            "(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0); torpor needs it",
                            options_.device, props.name));
  if (options_.exportable && !props.posix_fd_handles_supported)
    throw error(fmt::format("device {} cannot export memory as POSIX file descriptors; exportable pools need it",
                            options_.device));
  granularity_ = props.granularity;
  if (options_.va_bytes == 0) options_.va_bytes = 2 * props.total_bytes;
  options_.va_bytes = align_up(options_.va_bytes, granularity_);
  if (options_.slab_bytes == 0) options_.slab_bytes = granularity_;
  if (options_.slab_bytes % granularity_ != 0)
    throw invalid_argument(fmt::format("PoolOptions::slab_bytes {} must be a multiple of the granularity {}",
                                       options_.slab_bytes, granularity_));
  if (options_.small_limit == 0) options_.small_limit = options_.slab_bytes / 2;
  if (options_.small_limit > options_.slab_bytes)
    throw invalid_argument(fmt::format("PoolOptions::small_limit {} exceeds slab_bytes {}", options_.small_limit,
                                       options_.slab_bytes));
  if (options_.medium_limit != 0) {
    options_.medium_slab_min = align_up(std::max(options_.medium_slab_min, granularity_), granularity_);
    options_.medium_slab_max = align_up(std::max(options_.medium_slab_max, options_.medium_slab_min), granularity_);
    if (options_.medium_limit > options_.medium_slab_max)
      throw invalid_argument(fmt::format("PoolOptions::medium_limit {} exceeds medium_slab_max {}",
                                         options_.medium_limit, options_.medium_slab_max));
  }
  if (options_.release_threads < 1 || options_.release_threads > 64)
    throw invalid_argument(fmt::format("PoolOptions::release_threads {} must be 1..64", options_.release_threads));
  if (options_.copy_streams < 1 || options_.copy_streams > 64)
    throw invalid_argument(fmt::format("PoolOptions::copy_streams {} must be 1..64", options_.copy_streams));
  if (options_.copy_piece_bytes < HostStore::alignment)
    throw invalid_argument(fmt::format("PoolOptions::copy_piece_bytes {} is below {}", options_.copy_piece_bytes,
                                       HostStore::alignment));
  options_.copy_piece_bytes = align_up(options_.copy_piece_bytes, HostStore::alignment);
  if (options_.staging_slots < 2 || options_.staging_slot_bytes < HostStore::alignment)
    throw invalid_argument("PoolOptions: the staging ring needs at least 2 slots of at least 256 bytes");
  std::vector<int> access{options_.device};
  for (int p : options_.peer_devices) {
    if (p < 0 || p >= count) throw invalid_argument(fmt::format("Pool: peer device {} does not exist", p));
    if (p == options_.device || std::find(access.begin(), access.end(), p) != access.end()) continue;
    if (!driver_.can_access_peer(p, options_.device))
      throw invalid_argument(fmt::format("Pool: device {} cannot access device {} (no peer access)", p, options_.device));
    access.push_back(p);
  }

  va_base_ = driver_.reserve(options_.va_bytes, granularity_);
  try {
    state_ = std::make_unique<State>(driver_, options_, granularity_, va_base_);
    state_->access_devices = std::move(access);
    for (int i = 0; i < options_.copy_streams; ++i) state_->streams.push_back(driver_.stream_create(options_.device));
    if (options_.skip_unchanged) {
      // Load the hash kernels now: the device memory a first launch takes (module, local
      // memory) belongs to the pool's setup, not to the first sleep's "memory returned".
      HashRange none{};
      Hash128 ignored;
      driver_.hash(std::span<const HashRange>(&none, 1), &ignored, state_->streams[0]);
    }
  } catch (...) {
    if (state_) {
      for (Stream st : state_->streams) {
        try {
          driver_.stream_destroy(st);
        } catch (...) {
        }
      }
    }
    state_.reset();
    try {
      driver_.free_reservation(va_base_, options_.va_bytes);
    } catch (const std::exception& e) {
      log::error("pool: freeing the VA reservation after a failed construction: {}", e.what());
    }
    throw;
  }
  log::debug("pool: device {} backend {} va [{:#x}, +{:#x}) granularity {:#x}", options_.device,
             driver_.backend_name(), va_base_, options_.va_bytes, granularity_);
}

Pool::~Pool() {
  if (!state_) return;
  State& s = *state_;
  std::lock_guard lock(s.mu);
  // Give everything back; never throw. Device work on our memory must be finished first.
  try {
    driver_.device_synchronize(options_.device);
  } catch (const std::exception& e) {
    log::error("pool: device synchronize at destruction failed: {}", e.what());
  }
  for (auto& [va, c] : s.chunks) {
    if (c->awake && c->handle) {
      try {
        s.unmap_and_release(*c);
      } catch (const std::exception& e) {
        log::error("pool: unmapping chunk {:#x} at destruction failed: {}", va, e.what());
      }
    }
    s.drop_all_copies(c->backups);
    s.drop_all_copies(c->retained);
  }
  s.chunks.clear();
  s.allocations.clear();
  s.retry_pending_releases();
  if (!s.pending_release.empty())
    log::error("pool: {} physical handles could not be released at destruction", s.pending_release.size());
  for (Stream st : s.streams) {
    try {
      driver_.stream_destroy(st);
    } catch (const std::exception& e) {
      log::error("pool: destroying a stream failed: {}", e.what());
    }
  }
  for (auto* list : {&s.events, &s.staging_events}) {
    for (Event e : *list) {
      try {
        driver_.event_destroy(e);
      } catch (const std::exception& ex) {
        log::error("pool: destroying an event failed: {}", ex.what());
      }
    }
  }
  if (s.staging != nullptr) {
    try {
      driver_.host_free(s.staging);
    } catch (const std::exception& e) {
      log::error("pool: freeing the staging ring failed: {}", e.what());
    }
  }
  try {
    driver_.free_reservation(va_base_, options_.va_bytes);
  } catch (const std::exception& e) {
    log::error("pool: freeing the VA reservation failed: {}", e.what());
  }
  // HostStore's destructor frees the pinned blocks.
}

void* Pool::allocate(std::size_t bytes, const AllocationOptions& options) {
  if (bytes == 0) throw invalid_argument("allocate: size 0 (torpor does not hand out empty allocations)");
  check_class(options.memory_class);
  if (options.tag.empty()) throw invalid_argument("allocate: empty tag (use \"default\" or a name)");
  if (bytes > options_.va_bytes)
    throw invalid_argument(fmt::format("allocate: {} bytes exceed the pool's whole VA reservation of {} bytes; "
                                       "raise PoolOptions::va_bytes",
                                       bytes, options_.va_bytes));
  State& s = *state_;
  std::lock_guard lock(s.mu);
  auto tag_it = s.tags.find(options.tag);
  if (tag_it != s.tags.end() && tag_it->second.asleep)
    throw invalid_state(fmt::format("allocate: tag '{}' is asleep (level {}); wake_up({{\"{}\"}}) before allocating in it",
                                    options.tag, tag_it->second.level, options.tag));

  Chunk* chunk = nullptr;
  std::size_t offset = 0;
  std::size_t footprint = 0;
  ChunkKind kind = options.dedicated                                           ? ChunkKind::dedicated
                   : bytes <= options_.small_limit                               ? ChunkKind::small_slab
                   : (options_.medium_limit != 0 && bytes <= options_.medium_limit) ? ChunkKind::medium_slab
                                                                                 : ChunkKind::dedicated;
  if (kind != ChunkKind::dedicated) {
    footprint = align_up(bytes, sub_alignment);
    // Fast path: a mapped slab of this size class and (tag, class) with room. No driver call.
    std::size_t pair_bytes = 0;
    for (auto& [va, c] : s.chunks) {
      if (c->kind != kind || c->tag != options.tag || c->cls != options.memory_class || !c->awake) continue;
      pair_bytes += c->bytes;
      if (auto off = c->space.allocate(footprint, sub_alignment)) {
        chunk = c.get();
        offset = *off;
        break;
      }
    }
    if (chunk == nullptr) {
      std::size_t slab = options_.slab_bytes;
      if (kind == ChunkKind::medium_slab)
        slab = std::max(align_up(bytes, granularity_),
                        std::clamp(align_up(pair_bytes, granularity_), options_.medium_slab_min, options_.medium_slab_max));
      chunk = &s.new_chunk(slab, options.tag, options.memory_class, kind);
      offset = *chunk->space.allocate(footprint, sub_alignment);
    }
  } else {
    footprint = align_up(bytes, granularity_);
    chunk = &s.new_chunk(footprint, options.tag, options.memory_class, kind);
  }

  auto a = std::make_unique<Allocation>();
  a->base = chunk->va + offset;
  a->bytes = bytes;
  a->footprint = footprint;
  a->offset = offset;
  a->chunk = chunk;
  a->segments[0] = Segment{bytes, options.memory_class, options.name};
  chunk->allocations[offset] = a.get();
  device_ptr base = a->base;
  s.allocations[base] = std::move(a);
  s.tags.try_emplace(options.tag);
  if (s.recently_freed_set.erase(base)) {
    auto it = std::find(s.recently_freed.begin(), s.recently_freed.end(), base);
    if (it != s.recently_freed.end()) s.recently_freed.erase(it);
  }
  return reinterpret_cast<void*>(base);
}

void Pool::deallocate(void* ptr) {
  State& s = *state_;
  auto p = reinterpret_cast<device_ptr>(ptr);
  std::lock_guard lock(s.mu);
  auto it = s.allocations.find(p);
  if (it == s.allocations.end()) {
    if (ptr == nullptr) throw invalid_argument("deallocate: null pointer");
    if (const Allocation* a = s.containing(p))
      throw invalid_argument(fmt::format("deallocate: {} is inside allocation {} (+{} of {} bytes, tag '{}'); "
                                         "pass the allocation's base address",
                                         hex(p), hex(a->base), p - a->base, a->bytes, a->chunk->tag));
    if (s.recently_freed_set.count(p))
      throw invalid_argument(fmt::format("deallocate: {} was already freed (double free)", hex(p)));
    throw invalid_argument(fmt::format("deallocate: {} was not allocated by this pool (device {})", hex(p),
                                       options_.device));
  }
  Allocation& a = *it->second;
  Chunk& c = *a.chunk;
  bool last = c.allocations.size() == 1;
  if (last && (c.kind != ChunkKind::small_slab || !c.awake)) {
    s.dispose_chunk(c);  // throws before changing anything if unmap fails
  } else {
    s.drop_copies(c.awake ? c.retained : c.backups, a.offset, a.offset + a.footprint);
    c.space.free(a.offset, a.footprint);
    c.allocations.erase(a.offset);
    if (c.allocations.empty()) {
      // An empty awake small slab: keep one per (tag, class) for the fast path.
      bool another_empty = false;
      for (auto& [va, o] : s.chunks)
        if (o.get() != &c && o->kind == c.kind && o->awake && o->allocations.empty() && o->tag == c.tag &&
            o->cls == c.cls)
          another_empty = true;
      if (another_empty) {
        try {
          s.dispose_chunk(c);
        } catch (const std::exception& e) {
          log::warn("pool: releasing a spare slab failed, keeping it: {}", e.what());
        }
      }
    }
  }
  s.allocations.erase(p);
  s.recently_freed.push_back(p);
  s.recently_freed_set.insert(p);
  if (s.recently_freed.size() > recently_freed_limit) {
    s.recently_freed_set.erase(s.recently_freed.front());
    s.recently_freed.pop_front();
  }
}

void Pool::mark(void* ptr, std::size_t bytes, MemoryClass memory_class, std::string_view name) {
  check_class(memory_class);
  if (bytes == 0) throw invalid_argument("mark: size 0");
  State& s = *state_;
  auto p = reinterpret_cast<device_ptr>(ptr);
  std::lock_guard lock(s.mu);
  Allocation* found = s.containing(p);
  if (found == nullptr) throw invalid_argument(fmt::format("mark: {} is not inside any allocation of this pool", hex(p)));
  Allocation& a = *found;
  std::size_t lo = p - a.base;
  if (bytes > a.bytes - lo)
    throw invalid_argument(fmt::format("mark: [{}, +{}) runs past the end of allocation {} ({} bytes)", hex(p), bytes,
                                       hex(a.base), a.bytes));
  std::size_t hi = lo + bytes;
  auto& segs = a.segments;
  auto split = [&](std::size_t at) {
    if (at == 0 || at >= a.bytes) return;
    auto it = std::prev(segs.upper_bound(at));
    if (it->first == at) return;
    Segment right = it->second;
    it->second.end = at;
    segs[at] = right;
  };
  split(lo);
  split(hi);
  std::string new_name = name.empty() ? std::string() : std::string(name);
  for (auto it = segs.find(lo); it != segs.end() && it->first < hi; ++it) {
    it->second.cls = memory_class;
    if (!name.empty()) it->second.name = new_name;
  }
  // Merge neighbours that became identical.
  for (auto it = segs.begin(); it != segs.end();) {
    auto next = std::next(it);
    if (next != segs.end() && next->second.cls == it->second.cls && next->second.name == it->second.name) {
      it->second.end = next->second.end;
      segs.erase(next);
    } else {
      ++it;
    }
  }
}

std::optional<AllocationInfo> Pool::find(const void* ptr) const {
  State& s = *state_;
  auto p = reinterpret_cast<device_ptr>(ptr);
  std::lock_guard lock(s.mu);
  const Allocation* found = s.containing(p);
  if (found == nullptr) return std::nullopt;
  const Allocation& a = *found;
  std::size_t off = p - a.base;
  const Segment& seg = std::prev(a.segments.upper_bound(off))->second;
  return AllocationInfo{a.base, a.bytes, off, a.chunk->tag, seg.cls, seg.name, !a.chunk->awake};
}

std::optional<ChunkInfo> Pool::chunk_info(const void* ptr) const {
  State& s = *state_;
  auto p = reinterpret_cast<device_ptr>(ptr);
  std::lock_guard lock(s.mu);
  const Allocation* found = s.containing(p);
  if (found == nullptr) return std::nullopt;
  const Allocation& a = *found;
  const Chunk& c = *a.chunk;
  return ChunkInfo{c.va, c.bytes, a.offset, c.awake, c.kind == ChunkKind::dedicated, c.handle};
}

PoolStats Pool::stats() const {
  State& s = *state_;
  std::lock_guard lock(s.mu);
  PoolStats st;
  st.device = options_.device;
  st.backend = std::string(driver_.backend_name());
  st.va_bytes = options_.va_bytes;
  st.va_used_bytes = s.va.used_bytes();
  st.granularity = granularity_;
  st.host_store_bytes = s.host.capacity();
  st.host_store_used_bytes = s.host.used();
  st.host_store_pinned_bytes = s.host.pinned_capacity();
  st.pending_releases = s.pending_release.size();
  for (auto& [va, n] : s.address_ranges) st.address_ranges_bytes += n;
  std::map<std::string, TagStats, std::less<>> by_tag;
  for (auto& [t, ts] : s.tags) {
    TagStats& x = by_tag[t];
    x.tag = t;
    x.asleep = ts.asleep;
  }
  for (auto& [va, cp] : s.chunks) {
    const Chunk& c = *cp;
    TagStats& x = by_tag[c.tag];
    ++x.chunks;
    ++st.chunks;
    x.reserved_bytes += c.bytes;
    for (auto& [off, r] : c.retained) st.retained_bytes += r.bytes;
    if (c.awake) {
      x.mapped_bytes += c.bytes;
      st.mapped_bytes += c.bytes;
      if (c.allocations.empty()) st.cached_bytes += c.bytes;
    } else {
      x.level = std::max(x.level, c.level);
    }
    for (auto& [off, a] : c.allocations) {
      ++x.allocations;
      ++st.allocations;
      for (auto& [start, seg] : a->segments) {
        ClassStats& cs = x.classes[static_cast<std::size_t>(seg.cls)];
        std::size_t len = seg.end - start;
        cs.allocated_bytes += len;
        if (c.awake) continue;
        // Bytes of this segment covered by backups.
        std::size_t lo = a->offset + start, hi = a->offset + seg.end, kept = 0;
        auto b = c.backups.upper_bound(lo);
        if (b != c.backups.begin()) --b;
        for (; b != c.backups.end() && b->first < hi; ++b) {
          std::size_t blo = std::max(lo, b->first), bhi = std::min(hi, b->first + b->second.bytes);
          if (bhi > blo) kept += bhi - blo;
        }
        cs.offloaded_bytes += kept;
        cs.discarded_bytes += len - kept;
        x.offloaded_bytes += kept;
        x.discarded_bytes += len - kept;
      }
    }
  }
  for (auto& [t, x] : by_tag) st.tags.push_back(std::move(x));
  return st;
}

void Pool::set_preserve(std::vector<std::string> globs) {
  for (const auto& g : globs)
    if (g.empty()) throw invalid_argument("set_preserve: empty glob");
  std::lock_guard lock(state_->mu);
  state_->preserve = std::move(globs);
}

std::vector<std::string> Pool::preserve() const {
  std::lock_guard lock(state_->mu);
  return state_->preserve;
}

bool Pool::asleep(std::string_view tag) const {
  std::lock_guard lock(state_->mu);
  auto it = state_->tags.find(tag);
  if (it == state_->tags.end()) throw invalid_argument(fmt::format("asleep: unknown tag '{}'", tag));
  return it->second.asleep;
}

std::vector<std::string> Pool::tags() const {
  std::lock_guard lock(state_->mu);
  std::vector<std::string> out;
  for (auto& [t, s] : state_->tags) out.push_back(t);
  return out;
}

std::size_t Pool::trim() {
  State& s = *state_;
  std::lock_guard lock(s.mu);
  std::size_t released = 0;
  std::vector<Chunk*> empty;
  for (auto& [va, c] : s.chunks)
    if (c->slab() && c->allocations.empty()) empty.push_back(c.get());
  for (Chunk* c : empty) {
    std::size_t b = c->awake ? c->bytes : 0;
    s.dispose_chunk(*c);
    released += b;
  }
  s.retry_pending_releases();
  return released;
}

device_ptr Pool::reserve_address_range(std::size_t bytes) {
  if (bytes == 0) throw invalid_argument("reserve_address_range: size 0");
  State& s = *state_;
  std::lock_guard lock(s.mu);
  std::size_t rounded = align_up(bytes, granularity_);
  auto off = s.va.allocate(rounded, granularity_);
  if (!off)
    throw out_of_memory(fmt::format("reserve_address_range: {} bytes do not fit in the pool's VA reservation "
                                    "({} free, largest hole {}); raise PoolOptions::va_bytes",
                                    rounded, s.va.free_bytes(), s.va.largest_free()));
  device_ptr va = va_base_ + *off;
  s.address_ranges[va] = rounded;
  return va;
}

void Pool::release_address_range(device_ptr va) {
  State& s = *state_;
  std::lock_guard lock(s.mu);
  auto it = s.address_ranges.find(va);
  if (it == s.address_ranges.end())
    throw invalid_argument(fmt::format("release_address_range: {} is not a range from reserve_address_range", hex(va)));
  s.va.free(va - va_base_, it->second);
  s.address_ranges.erase(it);
}

void Pool::add_observer(SleepObserver* observer) {
  if (observer == nullptr) throw invalid_argument("add_observer: null observer");
  std::lock_guard lock(state_->mu);
  auto& v = state_->observers;
  if (std::find(v.begin(), v.end(), observer) == v.end()) v.push_back(observer);
}

void Pool::remove_observer(SleepObserver* observer) {
  std::lock_guard lock(state_->mu);
  auto& v = state_->observers;
  v.erase(std::remove(v.begin(), v.end(), observer), v.end());
}

void Pool::copy(void* dst, const void* src, std::size_t bytes) {
  std::lock_guard lock(state_->mu);
  driver_.copy_async(dst, src, bytes, state_->streams[0]);
  driver_.stream_synchronize(state_->streams[0]);
}

std::size_t Pool::release_host_store() {
  std::lock_guard lock(state_->mu);
  // Retained copies only save a future copy; asleep backups are needed and stay.
  for (auto& [va, c] : state_->chunks) state_->drop_all_copies(c->retained);
  return state_->host.release_unused();
}

}  // namespace torpor
