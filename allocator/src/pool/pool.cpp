// Pool, the core: construction and destruction (the VA reservation, the state, the copy
// streams), allocation, mark, deallocation and lookup. What it builds on, one concept a file:
//   pool_options.cpp   PoolOptions checked and completed before anything is reserved
//   placement.cpp      where an allocation goes (the handle-size and slab policies)
//   pool_stats.cpp     stats()
//   pool_names.cpp     the enums' names
//   pool_passthroughs.cpp  preserve, tags, trim, address ranges, observers, copy, host store
//   pool_export.cpp    the chunks' shareable handles (export_handles)
// The sleep engine is sleep.cpp and wake.cpp (plan -> pipeline -> apply or roll back); the shared
// bookkeeping and its invariants are in pool_state.hpp, a chunk's physical lifetime in chunk.hpp.
//
// Invariant kept here: an allocation is recorded (allocations, its chunk's map, its tag) only
// once its placement succeeded, and a free changes nothing when the chunk cannot be released.
#include "torpor/pool.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <type_traits>

#include "common/text.hpp"
#include "pool/placement.hpp"
#include "pool/pool_options.hpp"
#include "pool/pool_state.hpp"
#include "pool/sleep_plan.hpp"
#include "torpor/error.hpp"
#include "torpor/log.hpp"

namespace torpor {

namespace {

constexpr std::size_t recently_freed_limit = 4096;

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

// The bookkeeping, the copy streams and the hash stream; on failure the streams created so far
// are destroyed.
std::unique_ptr<Pool::State> make_state(Driver& driver, const PoolOptions& o, std::size_t gran, device_ptr va_base,
                                        std::vector<int> access) {
  auto state = std::make_unique<Pool::State>(driver, o, gran, va_base);
  try {
    state->memory.set_access_devices(std::move(access));
    for (int i = 0; i < o.copy_streams; ++i) state->streams.push_back(driver.stream_create(o.device));
    if (o.skip_unchanged) {
      state->hash_stream = driver.stream_create(o.device);
      // Load the hash kernels now: the device memory a first launch takes (module, local
      // memory) belongs to the pool's setup, not to the first sleep's "memory returned".
      HashRange none{};
      Hash128 ignored;
      driver.hash(std::span<const HashRange>(&none, 1), &ignored, *state->hash_stream);
    }
  } catch (...) {
    auto destroy = [&driver](Stream st) {
      try {
        driver.stream_destroy(st);
      } catch (...) {  // NOLINT(bugprone-empty-catch): the construction's own error is rethrown below
      }
    };
    for (Stream st : state->streams) destroy(st);
    if (state->hash_stream) destroy(*state->hash_stream);
    throw;
  }
  return state;
}

// Never throws: failures are logged.
void destroy_streams_and_events(Pool::State& s) noexcept {
  auto destroy = [&s](Stream st) noexcept {
    try {
      s.driver.stream_destroy(st);
    } catch (const std::exception& e) {
      log::error("pool: destroying a stream failed: {}", e.what());
    }
  };
  for (Stream st : s.streams) destroy(st);
  if (s.hash_stream) destroy(*s.hash_stream);
  for (Event e : s.events) {
    try {
      s.driver.event_destroy(e);
    } catch (const std::exception& ex) {
      log::error("pool: destroying an event failed: {}", ex.what());
    }
  }
  s.staging.release();
}

}  // namespace

Pool::Pool(Driver& driver, PoolOptions options) : driver_(driver), options_(std::move(options)) {
  int count = driver_.device_count();
  if (options_.device < 0 || options_.device >= count)
    throw invalid_argument(fmt::format("Pool: device {} does not exist ({} {} device(s) present)", options_.device,
                                       count, driver_.backend_name()));
  DeviceProperties props = driver_.device_properties(options_.device);
  validate_pool_options(options_, props);
  granularity_ = props.granularity;
  std::vector<int> access = access_devices(driver_, options_, count);

  va_base_ = driver_.reserve(options_.va_bytes, granularity_);
  try {
    state_ = make_state(driver_, options_, granularity_, va_base_, std::move(access));
    state_->device_bytes = props.total_bytes;
    state_->gpu_direct_rdma = options_.exportable && props.gpu_direct_rdma_vmm;  // as Driver::create decides
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

}  // namespace torpor
