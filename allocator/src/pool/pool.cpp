// Pool: reservation, chunks, sub-allocation, classes, tags, stats. The sleep engine is
// sleep.cpp and wake.cpp (plan -> pipeline -> apply or roll back); the shared bookkeeping and
// its invariants are in pool_state.hpp, a chunk's physical lifetime in chunk.hpp.
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

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <type_traits>

#include "common/enum_names.hpp"
#include "common/text.hpp"
#include "pool/pool_state.hpp"
#include "pool/sleep_plan.hpp"
#include "torpor/error.hpp"
#include "torpor/log.hpp"

namespace torpor {

namespace {

constexpr std::size_t sub_alignment = 256;
constexpr std::size_t recently_freed_limit = 4096;
// A new medium slab never makes a (tag, class) hold more than this share of what it allocated
// (at least medium_slab_min, at most medium_slab_max) mapped but unallocated.
constexpr std::size_t medium_slack_divisor = 8;
// PoolOptions::va_bytes: far beyond any device's (twice its memory) and any rounding overflow.
constexpr std::size_t max_va_bytes = std::size_t{1} << 52;

constexpr auto memory_class_names = std::to_array<EnumName<MemoryClass>>(
    {{MemoryClass::parameter, "parameter"}, {MemoryClass::state, "state"}, {MemoryClass::cache, "cache"}});
static_assert(memory_class_names.size() == memory_class_count);

constexpr auto fill_on_wake_names = std::to_array<EnumName<FillOnWake>>(
    {{FillOnWake::none, "none"}, {FillOnWake::zero, "zero"}, {FillOnWake::poison, "poison"}});

constexpr auto sleep_level_names =
    std::to_array<EnumName<SleepLevel>>({{SleepLevel::none, "none"},
                                         {SleepLevel::offload, "offload"},
                                         {SleepLevel::discard_parameters, "discard_parameters"}});
// The levels' numbers, as vLLM's sleep(level=...) and the C API write them.
constexpr auto sleep_level_numbers = std::to_array<EnumName<SleepLevel>>(
    {{SleepLevel::none, "0"}, {SleepLevel::offload, "1"}, {SleepLevel::discard_parameters, "2"}});

}  // namespace

std::string_view to_string(MemoryClass c) noexcept { return name_of(memory_class_names, c); }

MemoryClass parse_memory_class(std::string_view name) { return parse_named(memory_class_names, name, "memory class"); }

std::string_view to_string(FillOnWake f) noexcept { return name_of(fill_on_wake_names, f); }

FillOnWake parse_fill_on_wake(std::string_view name) { return parse_named(fill_on_wake_names, name, "fill_on_wake"); }

std::string_view to_string(SleepLevel l) noexcept { return name_of(sleep_level_names, l); }

SleepLevel parse_sleep_level(std::string_view name) {
  if (std::optional<SleepLevel> l = value_named(sleep_level_names, name)) return *l;
  if (std::optional<SleepLevel> l = value_named(sleep_level_numbers, name)) return *l;
  throw invalid_argument(fmt::format("unknown sleep level '{}' (expected {}, or {})", name,
                                     spoken_list(sleep_level_names), spoken_list(sleep_level_numbers)));
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
// Construction and destruction

namespace {

void check_device(const PoolOptions& o, const DeviceProperties& props) {
  if (!props.vmm_supported)
    throw error(fmt::format("device {} ({}) does not support CUDA virtual memory management "
                            "(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 0); torpor needs it",
                            o.device, props.name));
  if (o.exportable && !props.posix_fd_handles_supported)
    throw error(
        fmt::format("device {} cannot export memory as POSIX file descriptors; exportable pools need it", o.device));
}

// The handle-size policy's defaults, rounded to the granularity, and its consistency.
void normalize_sizes(PoolOptions& o, const DeviceProperties& props, std::size_t gran) {
  if (o.va_bytes > max_va_bytes)
    throw invalid_argument(fmt::format("PoolOptions::va_bytes {} is outside [0, {}] (0 = twice the device's memory)",
                                       o.va_bytes, max_va_bytes));
  if (o.va_bytes == 0) o.va_bytes = std::min(2 * props.total_bytes, max_va_bytes);
  o.va_bytes = align_up(o.va_bytes, gran);
  if (o.slab_bytes == 0) o.slab_bytes = gran;
  if (o.slab_bytes % gran != 0)
    throw invalid_argument(
        fmt::format("PoolOptions::slab_bytes {} must be a multiple of the granularity {}", o.slab_bytes, gran));
  if (o.small_limit == 0) o.small_limit = o.slab_bytes / 2;
  if (o.small_limit > o.slab_bytes)
    throw invalid_argument(
        fmt::format("PoolOptions::small_limit {} exceeds slab_bytes {}", o.small_limit, o.slab_bytes));
  if (o.medium_limit != 0) {
    o.medium_slab_min = align_up(std::max(o.medium_slab_min, gran), gran);
    o.medium_slab_max = align_up(std::max(o.medium_slab_max, o.medium_slab_min), gran);
    if (o.medium_limit > o.medium_slab_max)
      throw invalid_argument(
          fmt::format("PoolOptions::medium_limit {} exceeds medium_slab_max {}", o.medium_limit, o.medium_slab_max));
  }
}

// The sleep engine's knobs.
void check_engine_options(PoolOptions& o) {
  if (o.release_threads < 1 || o.release_threads > 64)
    throw invalid_argument(fmt::format("PoolOptions::release_threads {} must be 1..64", o.release_threads));
  if (o.copy_streams < 1 || o.copy_streams > 64)
    throw invalid_argument(fmt::format("PoolOptions::copy_streams {} must be 1..64", o.copy_streams));
  if (o.copy_piece_bytes < HostStore::alignment)
    throw invalid_argument(
        fmt::format("PoolOptions::copy_piece_bytes {} is below {}", o.copy_piece_bytes, HostStore::alignment));
  o.copy_piece_bytes = align_up(o.copy_piece_bytes, HostStore::alignment);
  if (o.staging_slots < 2 || o.staging_slots > 64 || o.staging_slot_bytes < HostStore::alignment ||
      o.staging_slot_bytes > (std::size_t{1} << 30))
    throw invalid_argument(
        "PoolOptions: the staging ring needs 2..64 slots (staging_slots) of 256 bytes to 1 GiB (staging_slot_bytes)");
}

// The host store's knobs.
void check_host_options(const PoolOptions& o) {
  if (o.host_pin_threads < 0 || o.host_pin_threads > 256)
    throw invalid_argument(
        fmt::format("PoolOptions::host_pin_threads {} must be 0..256 (0 = min(16, cores))", o.host_pin_threads));
  if (o.host_pin_block_bytes < HostStore::block_rounding || o.host_pin_block_bytes > (std::size_t{64} << 30))
    throw invalid_argument(
        fmt::format("PoolOptions::host_pin_block_bytes {} must be 2 MiB..64 GiB", o.host_pin_block_bytes));
  if (!o.spill_dir.empty() && o.host_store_limit == 0)
    throw invalid_argument(fmt::format("PoolOptions::spill_dir '{}' needs host_store_limit > 0: what does not fit "
                                       "under the limit goes to disk (a limit below 2 MiB puts every backup there)",
                                       o.spill_dir));
}

// The bookkeeping and the copy streams; on failure the streams created so far are destroyed.
std::unique_ptr<Pool::State> make_state(Driver& driver, const PoolOptions& o, std::size_t gran, device_ptr va_base,
                                        std::vector<int> access) {
  auto state = std::make_unique<Pool::State>(driver, o, gran, va_base);
  try {
    state->memory.set_access_devices(std::move(access));
    for (int i = 0; i < o.copy_streams; ++i) state->streams.push_back(driver.stream_create(o.device));
    if (o.skip_unchanged) {
      // Load the hash kernels now: the device memory a first launch takes (module, local
      // memory) belongs to the pool's setup, not to the first sleep's "memory returned".
      HashRange none{};
      Hash128 ignored;
      driver.hash(std::span<const HashRange>(&none, 1), &ignored, state->streams[0]);
    }
  } catch (...) {
    for (Stream st : state->streams) {
      try {
        driver.stream_destroy(st);
      } catch (...) {
      }
    }
    throw;
  }
  return state;
}

// Never throws: failures are logged.
void destroy_streams_and_events(Pool::State& s) noexcept {
  for (Stream st : s.streams) {
    try {
      s.driver.stream_destroy(st);
    } catch (const std::exception& e) {
      log::error("pool: destroying a stream failed: {}", e.what());
    }
  }
  for (Event e : s.events) {
    try {
      s.driver.event_destroy(e);
    } catch (const std::exception& ex) {
      log::error("pool: destroying an event failed: {}", ex.what());
    }
  }
  s.staging.release();
}

// The pool's device and every distinct peer, each of which must be able to access it.
std::vector<int> access_devices(Driver& driver, const PoolOptions& o, int count) {
  std::vector<int> access{o.device};
  for (int p : o.peer_devices) {
    if (p < 0 || p >= count) throw invalid_argument(fmt::format("Pool: peer device {} does not exist", p));
    if (p == o.device || std::find(access.begin(), access.end(), p) != access.end()) continue;
    if (!driver.can_access_peer(p, o.device))
      throw invalid_argument(fmt::format("Pool: device {} cannot access device {} (no peer access)", p, o.device));
    access.push_back(p);
  }
  return access;
}

}  // namespace

Pool::Pool(Driver& driver, PoolOptions options) : driver_(driver), options_(std::move(options)) {
  int count = driver_.device_count();
  if (options_.device < 0 || options_.device >= count)
    throw invalid_argument(fmt::format("Pool: device {} does not exist ({} {} device(s) present)", options_.device,
                                       count, driver_.backend_name()));
  DeviceProperties props = driver_.device_properties(options_.device);
  check_device(options_, props);
  granularity_ = props.granularity;
  normalize_sizes(options_, props, granularity_);
  check_engine_options(options_);
  check_host_options(options_);
  std::vector<int> access = access_devices(driver_, options_, count);

  va_base_ = driver_.reserve(options_.va_bytes, granularity_);
  try {
    state_ = make_state(driver_, options_, granularity_, va_base_, std::move(access));
    if (options_.host_store_prepare != 0) state_->host.prepare(options_.host_store_prepare);
  } catch (...) {
    try {
      driver_.free_reservation(va_base_, options_.va_bytes);
    } catch (const std::exception& e) {
      log::error("pool: freeing the VA reservation after a failed construction: {}", e.what());
    }
    throw;
  }
  log::debug("pool: device {} backend {} va [{:#x}, +{:#x}) granularity {:#x}", options_.device, driver_.backend_name(),
             va_base_, options_.va_bytes, granularity_);
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
    if (c->handle) {  // awake, or stranded
      try {
        c->unmap_and_release(s.memory);
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
  if (std::size_t n = s.memory.pending(); n != 0)
    log::error("pool: {} physical handles could not be released at destruction", n);
  destroy_streams_and_events(s);
  try {
    driver_.free_reservation(va_base_, options_.va_bytes);
  } catch (const std::exception& e) {
    log::error("pool: freeing the VA reservation failed: {}", e.what());
  }
  // HostStore's destructor frees the pinned blocks.
}

// ---------------------------------------------------------------------------------------------
// Allocation

namespace {

ChunkKind kind_for(std::size_t bytes, bool dedicated, const PoolOptions& o) {
  if (dedicated) return ChunkKind::dedicated;
  if (bytes <= o.small_limit) return ChunkKind::small_slab;
  if (o.medium_limit != 0 && bytes <= o.medium_limit) return ChunkKind::medium_slab;
  return ChunkKind::dedicated;
}

struct Placement {
  Chunk* chunk = nullptr;
  std::size_t offset = 0;
  std::size_t footprint = 0;
};

// The awake slabs of one kind and (tag, class): bytes mapped, and bytes of them not carved.
struct PairSpace {
  std::size_t mapped = 0;
  std::size_t free = 0;
};

// The fast path: room in a mapped slab of this kind and (tag, class). No driver call. Sums the
// pair's slabs into `pair` (the medium slab policy sizes a new slab by them).
std::optional<Placement> carve_from_slab(Pool::State& s, ChunkKind kind, std::size_t footprint,
                                         const AllocationOptions& options, PairSpace& pair) {
  for (auto& [va, c] : s.chunks) {
    if (c->kind != kind || c->tag != options.tag || c->cls != options.memory_class || !c->awake) continue;
    if (auto off = c->space.allocate(footprint, sub_alignment)) return Placement{c.get(), *off, footprint};
    pair.mapped += c->bytes;
    pair.free += c->space.free_bytes();
  }
  return std::nullopt;
}

// A new medium slab for `footprint` bytes: as large as the slack budget allows (PoolOptions: the
// pair's mapped-but-unallocated bytes stay within clamp(allocated / 8, medium_slab_min,
// medium_slab_max)), at most medium_slab_max, at least the allocation itself.
// The slab holds a whole number of footprints: a model allocates runs of same-size tensors, and
// a slab tail too short for the next one would count as slack for good, so every later slab
// would be made smaller, leaving another tail: the slabs (and the VMM calls of each sleep) would
// multiply instead of growing.
std::size_t medium_slab_bytes(const PoolOptions& o, std::size_t gran, const PairSpace& pair, std::size_t footprint) {
  const std::size_t need = align_up(footprint, gran);
  const std::size_t allocated = pair.mapped - pair.free + footprint;
  const std::size_t budget = std::clamp(allocated / medium_slack_divisor, o.medium_slab_min, o.medium_slab_max);
  if (budget + footprint <= pair.free) return need;  // frees left more than the budget: no slack added
  const std::size_t limit = std::min((budget + footprint - pair.free) / gran * gran, o.medium_slab_max);
  const std::size_t whole = limit / footprint * footprint;  // both granule multiples: align_up stays <= limit
  return std::max(need, align_up(whole, gran));
}

bool out_of_memory_error(const std::exception& e) {
  if (dynamic_cast<const out_of_memory*>(&e) != nullptr) return true;
  const auto* d = dynamic_cast<const driver_error*>(&e);
  return d != nullptr && d->is_out_of_memory();
}

// A slab of `preferred` bytes, or, when the device (or the VA reservation) cannot hold one, a
// slab of just `need` bytes: a slab is a convenience, and an allocation that fits must not fail
// for it (nor strand, in a half-size slab, memory the next allocation needs).
Chunk& new_slab(Pool::State& s, std::size_t preferred, std::size_t need, const AllocationOptions& options,
                ChunkKind kind) {
  try {
    return s.new_chunk(preferred, options.tag, options.memory_class, kind);
  } catch (const std::exception& e) {
    if (preferred <= need || !out_of_memory_error(e)) throw;
    log::debug("pool: no room for a {}-byte slab in tag '{}' ({}); taking {} bytes", preferred, options.tag, e.what(),
               need);
  }
  return s.new_chunk(need, options.tag, options.memory_class, kind);
}

Placement place(Pool::State& s, std::size_t bytes, const AllocationOptions& options) {
  const PoolOptions& o = s.options;
  ChunkKind kind = kind_for(bytes, options.dedicated, o);
  if (kind == ChunkKind::dedicated) {
    std::size_t footprint = align_up(bytes, s.granularity);
    return Placement{&s.new_chunk(footprint, options.tag, options.memory_class, kind), 0, footprint};
  }
  std::size_t footprint = align_up(bytes, sub_alignment);
  PairSpace pair;
  if (auto p = carve_from_slab(s, kind, footprint, options, pair)) return *p;
  const std::size_t need = align_up(footprint, s.granularity);
  std::size_t slab = std::max(o.slab_bytes, need);
  if (kind == ChunkKind::medium_slab) slab = medium_slab_bytes(o, s.granularity, pair, footprint);
  Chunk& c = new_slab(s, slab, need, options, kind);
  return Placement{&c, *c.space.allocate(footprint, sub_alignment), footprint};
}

void check_allocation(std::size_t bytes, const AllocationOptions& options, std::size_t va_bytes) {
  if (bytes == 0) throw invalid_argument("allocate: size 0 (torpor does not hand out empty allocations)");
  check_class(options.memory_class);
  check_tag(options.tag, "allocate");
  if (bytes > va_bytes)
    throw invalid_argument(fmt::format("allocate: {} bytes exceed the pool's whole VA reservation of {} bytes; "
                                       "raise PoolOptions::va_bytes",
                                       bytes, va_bytes));
}

void forget_recently_freed(Pool::State& s, device_ptr base) {
  if (s.recently_freed_set.erase(base)) {
    auto it = std::find(s.recently_freed.begin(), s.recently_freed.end(), base);
    if (it != s.recently_freed.end()) s.recently_freed.erase(it);
  }
}

void remember_freed(Pool::State& s, device_ptr base) {
  s.recently_freed.push_back(base);
  s.recently_freed_set.insert(base);
  if (s.recently_freed.size() > recently_freed_limit) {
    s.recently_freed_set.erase(s.recently_freed.front());
    s.recently_freed.pop_front();
  }
}

}  // namespace

void* Pool::allocate(std::size_t bytes, const AllocationOptions& options) {
  check_allocation(bytes, options, options_.va_bytes);
  State& s = *state_;
  std::lock_guard lock(s.mu);
  auto tag_it = s.tags.find(options.tag);
  if (tag_it != s.tags.end() && tag_it->second.asleep)
    throw invalid_state(
        fmt::format("allocate: tag '{}' is asleep (level {}); wake_up({{\"{}\"}}) before allocating in it", options.tag,
                    static_cast<int>(tag_it->second.level), options.tag));

  Placement at = place(s, bytes, options);
  auto a = std::make_unique<Allocation>();
  a->base = at.chunk->va + at.offset;
  a->bytes = bytes;
  a->footprint = at.footprint;
  a->offset = at.offset;
  a->chunk = at.chunk;
  a->segments[0] = Segment{bytes, options.memory_class, options.name};
  at.chunk->allocations[at.offset] = a.get();
  device_ptr base = a->base;
  s.allocations[base] = std::move(a);
  s.tags.try_emplace(options.tag);
  forget_recently_freed(s, base);
  return reinterpret_cast<void*>(base);
}

namespace {

// Why `p` cannot be freed: an interior pointer, a double free, or a foreign pointer.
[[noreturn]] void reject_deallocate(const Pool::State& s, device_ptr p) {
  if (p == 0) throw invalid_argument("deallocate: null pointer");
  if (const Allocation* a = s.containing(p))
    throw invalid_argument(fmt::format("deallocate: {} is inside allocation {} (+{} of {} bytes, tag '{}'); "
                                       "pass the allocation's base address",
                                       hex(p), hex(a->base), p - a->base, a->bytes, a->chunk->tag));
  if (s.recently_freed_set.count(p))
    throw invalid_argument(fmt::format("deallocate: {} was already freed (double free)", hex(p)));
  throw invalid_argument(
      fmt::format("deallocate: {} was not allocated by this pool (device {})", hex(p), s.options.device));
}

// An empty awake small slab is kept for the fast path, one per (tag, class); a second goes.
void dispose_if_spare(Pool::State& s, Chunk& c) {
  bool another_empty = false;
  for (auto& [va, o] : s.chunks)
    if (o.get() != &c && o->kind == c.kind && o->awake && o->allocations.empty() && o->tag == c.tag && o->cls == c.cls)
      another_empty = true;
  if (!another_empty) return;
  try {
    s.dispose_chunk(c);
  } catch (const std::exception& e) {
    log::warn("pool: releasing a spare slab failed, keeping it: {}", e.what());
  }
}

// Takes `a` out of its chunk: the whole chunk when it was the last allocation of a dedicated
// chunk, a medium slab or a sleeping slab; else its space and host copies.
void remove_from_chunk(Pool::State& s, Allocation& a) {
  Chunk& c = *a.chunk;
  bool last = c.allocations.size() == 1;
  if (last && (c.kind != ChunkKind::small_slab || !c.awake)) {
    s.dispose_chunk(c);  // throws before changing anything if unmap fails
    return;
  }
  s.drop_copies(c.awake ? c.retained : c.backups, a.offset, a.offset + a.footprint);
  c.space.free(a.offset, a.footprint);
  c.allocations.erase(a.offset);
  if (c.allocations.empty()) dispose_if_spare(s, c);
}

// mark() on a sleeping allocation: bytes the sleep discarded have no backup, so they come back
// undefined whatever their class; calling them state would promise bytes that do not exist.
void refuse_state_over_discarded_bytes(const Allocation& a, std::size_t lo, std::size_t hi, MemoryClass cls) {
  const Chunk& c = *a.chunk;
  if (c.awake || cls != MemoryClass::state) return;
  std::size_t backed = c.backed_bytes(a.offset + lo, a.offset + hi);
  if (backed == hi - lo) return;
  const std::string& name = std::prev(a.segments.upper_bound(lo))->second.name;
  throw invalid_state(fmt::format(
      "mark: [{}, +{}) of allocation {}{} (tag '{}') is asleep at level {} and {} of those bytes were discarded by the "
      "sleep; marking them state would claim bytes that no longer exist: wake_up({{\"{}\"}}) (and reload them) first",
      hex(a.base + lo), hi - lo, hex(a.base), name.empty() ? std::string() : fmt::format(" '{}'", name), c.tag,
      static_cast<int>(c.level), hi - lo - backed, c.tag));
}

}  // namespace

void Pool::deallocate(void* ptr) {
  State& s = *state_;
  auto p = reinterpret_cast<device_ptr>(ptr);
  std::lock_guard lock(s.mu);
  auto it = s.allocations.find(p);
  if (it == s.allocations.end()) reject_deallocate(s, p);
  remove_from_chunk(s, *it->second);
  s.allocations.erase(it);
  remember_freed(s, p);
}

namespace {

// The allocation [ptr, ptr + bytes) lies in, checked (invalid_argument naming `what`).
Allocation& mark_target(const Pool::State& s, void* ptr, std::size_t bytes, MemoryClass memory_class,
                        const std::string& what) {
  check_class(memory_class);
  if (bytes == 0) throw invalid_argument(fmt::format("{}: size 0", what));
  auto p = reinterpret_cast<device_ptr>(ptr);
  Allocation* found = s.containing(p);
  if (found == nullptr)
    throw invalid_argument(fmt::format("{}: {} is not inside any allocation of this pool", what, hex(p)));
  if (bytes > found->bytes - (p - found->base))
    throw invalid_argument(fmt::format("{}: [{}, +{}) runs past the end of allocation {} ({} bytes)", what, hex(p),
                                       bytes, hex(found->base), found->bytes));
  return *found;
}

void apply_mark(Allocation& a, device_ptr p, std::size_t bytes, MemoryClass memory_class, std::string_view name);

}  // namespace

void Pool::mark(void* ptr, std::size_t bytes, MemoryClass memory_class, std::string_view name) {
  State& s = *state_;
  std::lock_guard lock(s.mu);
  Allocation& a = mark_target(s, ptr, bytes, memory_class, "mark");
  apply_mark(a, reinterpret_cast<device_ptr>(ptr), bytes, memory_class, name);
}

void Pool::mark(std::span<const MarkRange> ranges) {
  State& s = *state_;
  std::lock_guard lock(s.mu);
  std::vector<Allocation*> targets;
  targets.reserve(ranges.size());
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    const MarkRange& m = ranges[i];
    targets.push_back(&mark_target(s, m.ptr, m.bytes, m.memory_class, fmt::format("mark: range {}", i)));
  }
  for (std::size_t i = 0; i < ranges.size(); ++i)
    apply_mark(*targets[i], reinterpret_cast<device_ptr>(ranges[i].ptr), ranges[i].bytes, ranges[i].memory_class,
               ranges[i].name);
}

namespace {

void apply_mark(Allocation& a, device_ptr p, std::size_t bytes, MemoryClass memory_class, std::string_view name) {
  std::size_t lo = p - a.base;
  std::size_t hi = lo + bytes;
  refuse_state_over_discarded_bytes(a, lo, hi, memory_class);
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

// `read(allocation, offset of ptr in it)` of the live allocation holding `ptr`, under the pool's
// lock; nothing when no live allocation holds it.
template <class F>
auto read_containing(Pool::State& s, const void* ptr, F read)
    -> std::optional<std::invoke_result_t<F, const Allocation&, std::size_t>> {
  auto p = reinterpret_cast<device_ptr>(ptr);
  std::lock_guard lock(s.mu);
  const Allocation* a = s.containing(p);
  if (a == nullptr) return std::nullopt;
  return read(*a, p - a->base);
}

}  // namespace

std::optional<AllocationInfo> Pool::find(const void* ptr) const {
  return read_containing(*state_, ptr, [](const Allocation& a, std::size_t off) {
    const Segment& seg = std::prev(a.segments.upper_bound(off))->second;
    return AllocationInfo{a.base, a.bytes, off, a.chunk->tag, seg.cls, seg.name, !a.chunk->awake};
  });
}

std::optional<ChunkInfo> Pool::chunk_info(const void* ptr) const {
  return read_containing(*state_, ptr, [](const Allocation& a, std::size_t) {
    const Chunk& c = *a.chunk;
    return ChunkInfo{c.va, c.bytes, a.offset, c.awake, c.kind == ChunkKind::dedicated, c.handle};
  });
}

namespace {

// One chunk's share of the pool's and its tag's figures.
void add_chunk_stats(const Chunk& c, PoolStats& st, TagStats& x) {
  ++x.chunks;
  ++st.chunks;
  x.reserved_bytes += c.bytes;
  for (auto& [off, r] : c.retained) {
    st.retained_bytes += r.bytes;
    st.host_copies_bytes += r.span.bytes;
  }
  for (auto& [off, b] : c.backups) st.host_copies_bytes += b.span.bytes;
  if (c.handle) {  // awake, or stranded: still mapped
    x.mapped_bytes += c.bytes;
    st.mapped_bytes += c.bytes;
  }
  if (c.awake) {
    if (c.allocations.empty()) st.cached_bytes += c.bytes;
  } else {
    x.level = std::max(x.level, static_cast<int>(c.level));
  }
  for (auto& [off, a] : c.allocations) {
    ++x.allocations;
    ++st.allocations;
    x.allocated_bytes += a->bytes;
    for (auto& [start, seg] : a->segments) {
      ClassStats& cs = x.classes[static_cast<std::size_t>(seg.cls)];
      std::size_t len = seg.end - start;
      cs.allocated_bytes += len;
      if (c.awake) continue;
      std::size_t kept = c.backed_bytes(a->offset + start, a->offset + seg.end);
      cs.offloaded_bytes += kept;
      cs.discarded_bytes += len - kept;
      x.offloaded_bytes += kept;
      x.discarded_bytes += len - kept;
    }
  }
}

}  // namespace

PoolStats Pool::stats() const {
  State& s = *state_;
  std::lock_guard lock(s.mu);
  PoolStats st;
  st.device = options_.device;
  st.backend = std::string(driver_.backend_name());
  st.va_bytes = options_.va_bytes;
  st.va_used_bytes = s.va.used_bytes();
  st.granularity = granularity_;
  HostStoreStats hs = s.host.stats();
  st.host_store_bytes = hs.pinned_bytes + hs.pinning_bytes + hs.pageable_bytes;
  st.host_store_pinned_bytes = hs.pinned_bytes;
  st.host_store_pinning_bytes = hs.pinning_bytes;
  st.host_store_pageable_bytes = hs.pageable_bytes;
  st.host_store_used_bytes = hs.used_bytes;
  st.spill_bytes = hs.disk_bytes;
  st.spill_used_bytes = hs.disk_used_bytes;
  st.host_registration_refused = hs.registration_refused;
  if (const SpillStore* spill = s.host.spill()) {
    st.spill_path = spill->path();
    st.spill_direct_io = spill->direct_io();
  }
  st.pending_releases = s.memory.pending();
  for (auto& [va, n] : s.address_ranges) st.address_ranges_bytes += n;
  std::map<std::string, TagStats, std::less<>> by_tag;
  for (auto& [t, ts] : s.tags) {
    TagStats& x = by_tag[t];
    x.tag = t;
    x.asleep = ts.asleep;
  }
  for (auto& [va, c] : s.chunks) add_chunk_stats(*c, st, by_tag[c->tag]);
  for (auto& [t, x] : by_tag) st.tags.push_back(std::move(x));
  return st;
}

void Pool::set_preserve(std::vector<std::string> globs) {
  for (const auto& g : globs) {
    if (g.empty()) throw invalid_argument("set_preserve: empty glob");
    check_no_nul(g, fmt::format("glob '{}'", g.substr(0, g.find('\0'))), "set_preserve");
  }
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
  s.retry_stranded_mappings();
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
  constexpr auto top = std::numeric_limits<std::uintptr_t>::max();
  for (const void* p : {static_cast<const void*>(dst), src})
    if (bytes > top - reinterpret_cast<std::uintptr_t>(p))
      throw invalid_argument(fmt::format("copy: [{}, +{}) wraps around the end of the address space", p, bytes));
  if (bytes > 0 && (dst == nullptr || src == nullptr)) throw invalid_argument("copy: NULL pointer");
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

std::size_t Pool::prepare_host_store(std::size_t bytes) {
  std::lock_guard lock(state_->mu);
  return state_->host.prepare(bytes != 0 ? bytes : level1_host_bytes(*state_));
}

void Pool::wait_host_store() {
  state_->host.pinner().wait_all();  // thread-safe: other calls go on meanwhile
  std::lock_guard lock(state_->mu);
  state_->host.wait_pinning();  // notes a refusal (and waits for blocks added meanwhile)
}

}  // namespace torpor
