// HostStore; the design note and invariants are in host_store.hpp.
#include "pool/store/host_store.hpp"

#include <fmt/core.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <fstream>
#include <limits>
#include <mutex>

#include "common/enum_names.hpp"
#include "torpor/error.hpp"
#include "torpor/log.hpp"

namespace torpor {

namespace {

// Once per process: without transparent huge pages the first touch faults 4 KiB pages and
// pinning runs at about half the speed (DESIGN.md's performance table).
void note_huge_pages_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
    std::string line;
    if (std::getline(f, line) && line.find("[never]") != std::string::npos)
      log::info("host store: transparent huge pages are off on this machine ({}); page-locking the store runs "
                "slower",
                line);
  });
}

// Anonymous read-write memory, 2 MiB-aligned so that huge pages can back all of it, bound to
// prefer `node` (>= 0) before anything touches it: the first fault places a page.
std::byte* map_for_pinning(std::size_t bytes, int node) {
  const std::size_t align = HostStore::block_rounding;
  void* raw = ::mmap(nullptr, bytes + align, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  auto at = reinterpret_cast<std::uintptr_t>(raw);
  std::uintptr_t base = align_up(at, align);
  if (base > at) ::munmap(raw, base - at);
  std::size_t tail = at + bytes + align - (base + bytes);
  if (tail > 0) ::munmap(reinterpret_cast<void*>(base + bytes), tail);
  auto* p = reinterpret_cast<std::byte*>(base);
#ifdef MADV_HUGEPAGE
  if (::madvise(p, bytes, MADV_HUGEPAGE) != 0) log::debug("host store: madvise(MADV_HUGEPAGE) refused");
#endif
  if (node >= 0 && !prefer_numa_node(p, bytes, node)) {
    static std::once_flag once;
    const int err = errno;
    std::call_once(once, [&] {
      log::info("host store: binding page-locked memory to NUMA node {} (mbind) was refused (errno {}); the pages "
                "land where they are first touched",
                node, err);
    });
  }
  note_huge_pages_once();
  return p;
}

constexpr auto host_tier_names = std::to_array<EnumName<HostTier>>(
    {{HostTier::pinned, "pinned"}, {HostTier::pageable, "pageable"}, {HostTier::disk, "disk"}});

}  // namespace

std::string_view to_string(HostTier t) noexcept { return name_of(host_tier_names, t); }

HostTier HostStore::Block::tier() const noexcept {
  switch (source) {
    case Source::registered: {
      PinJob::Status st = job->status();
      return st == PinJob::Status::refused || st == PinJob::Status::cancelled ? HostTier::pageable : HostTier::pinned;
    }
    case Source::allocated: return HostTier::pinned;
    case Source::pageable: return HostTier::pageable;
    case Source::disk: return HostTier::disk;
  }
  return HostTier::pageable;
}

bool HostStore::Block::counts_as_pinned() const noexcept {
  return source == Source::allocated || (source == Source::registered && tier() == HostTier::pinned);
}

HostStore::HostStore(Driver& driver, HostStoreOptions options)
    : driver_(driver),
      options_(std::move(options)),
      spill_(
          options_.spill_dir.empty() || options_.spill_file_per_span
              ? nullptr
              : std::make_unique<SpillStore>(options_.spill_dir, options_.spill_limit, options_.spill_try_direct_io)),
      pinner_(driver, options_.device, options_.pin_threads) {
  options_.pin_block_bytes = align_up(std::max(options_.pin_block_bytes, block_rounding), block_rounding);
}

HostStore::~HostStore() {
  for (auto& b : blocks_)
    if (b->job) HostPinner::cancel(*b->job);
  pinner_.wait_all();
  for (auto& b : blocks_) free_block(*b);
}

void HostStore::free_block(Block& b) noexcept {
  try {
    switch (b.source) {
      case Source::registered:
        HostPinner::cancel(*b.job);
        unregister_if_ready(b);
        ::munmap(b.base, b.map_bytes);
        break;
      case Source::allocated: driver_.host_free(b.base); break;
      case Source::pageable: ::munmap(b.base, b.map_bytes); break;
      case Source::disk:
        ::munmap(b.base, b.map_bytes);
        if (b.file)
          b.file.reset();  // its destructor removes the file
        else
          spill_->free(b.file_offset, b.map_bytes);
        break;
    }
  } catch (const std::exception& e) {
    log::error("HostStore: freeing a {}-byte block failed: {}", b.map_bytes, e.what());
  }
}

std::size_t HostStore::pinned_held() const noexcept {
  std::size_t n = 0;
  for (auto& b : blocks_)
    if (b->counts_as_pinned()) n += b->map_bytes;
  return n;
}

PinBudget HostStore::budget() {
  if (options_.sys_root.empty()) {
    PinBudget b;
    b.bytes = options_.pinned_limit;
    b.source = options_.pinned_limit != 0 ? "host_store_limit" : "none";
    last_budget_ = b;
    return b;
  }
  last_budget_ = read_pin_budget(options_.sys_root, options_.pinned_limit, options_.memlock_charged, pinned_held());
  return last_budget_;
}

std::size_t HostStore::limit_now() { return budget().bytes; }

std::size_t HostStore::pinned_room() {
  const std::size_t limit = limit_now();
  if (limit == 0) return std::numeric_limits<std::size_t>::max();
  std::size_t have = pinned_held();
  return have >= limit ? 0 : limit - have;
}

// Once per store, when the budget (not the user's own limit) first keeps a growth from being
// page-locked: what set the budget, and where the bytes go instead.
void HostStore::note_capped(std::size_t wanted, std::size_t got) {
  if (got >= wanted) return;
  const bool first = !capped_;
  capped_ = true;
  if (!first || last_budget_.source == "host_store_limit") return;
  log::warn("host store: page-locked memory is capped at {} bytes by {} ({}); {} of the {} bytes asked for are not "
            "page-locked: they go {} (set host_store_limit and spill_dir to choose, or raise the limit)",
            last_budget_.bytes, last_budget_.source,
            last_budget_.source == "RLIMIT_MEMLOCK"
                ? fmt::format("ulimit -l is {} bytes", last_budget_.memlock_limit)
                : fmt::format("limit {} bytes, {} in use, an eighth kept for the rest of the process",
                              last_budget_.cgroup_limit, last_budget_.cgroup_usage),
            wanted - got, wanted,
            spill_ ? "to the disk tier (spill_dir)" : "to pageable memory, copied through the pinned staging ring");
}

void HostStore::note_refusal(const Block& b) {
  if (registration_refused_ || b.source != Source::registered || b.job->status() != PinJob::Status::refused) return;
  registration_refused_ = true;
  log::warn("host store: page-locking {} bytes of host memory (cuMemHostRegister) was refused: {}; those bytes stay "
            "pageable (copied through the staging ring) and the store grows with cuMemHostAlloc from now on",
            b.map_bytes, b.job->refusal());
}

HostStore::Block& HostStore::add_block(std::size_t bytes, HostTier tier) {
  if (tier == HostTier::pinned) return add_pinned_blocks(bytes, bytes);
  return keep(add_beyond_limit_block(bytes));
}

HostStore::Block& HostStore::keep(std::unique_ptr<Block> block) {
  Block& b = *block;
  blocks_.push_back(std::move(block));
  by_base_[b.base] = &b;
  ++growths_;
  log::debug("HostStore: new {} block of {} bytes ({} blocks, {} bytes of host memory)", to_string(b.tier()),
             b.map_bytes, blocks_.size(), capacity());
  return b;
}

HostStore::Block& HostStore::add_pinned_blocks(std::size_t bytes, std::size_t first_block) {
  bytes = align_up(bytes, block_rounding);
  first_block = std::min(align_up(first_block, block_rounding), bytes);
  for (auto& b : blocks_) note_refusal(*b);
  if (!registration_refused_) return add_registered_blocks(bytes, first_block);
  Block* first = nullptr;
  for (std::size_t added = 0; added < bytes;) {
    const std::size_t n = std::min(first == nullptr ? first_block : options_.pin_block_bytes, bytes - added);
    Block& b = keep(allocated_block(n));
    if (first == nullptr) first = &b;
    added += n;
  }
  return *first;
}

// One mapping for all the blocks: mapping, trimming and advising take the process's mmap lock for
// writing, which waits behind every page fault and registration in flight. A mapping per block,
// made while the blocks before it are being pinned, would make the pinning wait on the mapping and
// the mapping on the pinning, block after block. Each block is unmapped on its own later (munmap
// of part of a mapping).
HostStore::Block& HostStore::add_registered_blocks(std::size_t bytes, std::size_t first_block) {
  std::byte* base = map_for_pinning(bytes, options_.numa_node);
  if (base == nullptr)
    throw out_of_memory(
        fmt::format("host backing store could not map {} bytes to page-lock ({} held)", bytes, capacity()));
  std::vector<std::unique_ptr<Block>> fresh;
  try {
    for (std::size_t offset = 0; offset < bytes;) {
      const std::size_t n = std::min(fresh.empty() ? first_block : options_.pin_block_bytes, bytes - offset);
      auto block = std::make_unique<Block>();
      block->base = base + offset;
      block->map_bytes = n;
      block->space = RangeAllocator(n);
      block->source = Source::registered;
      block->job = pinner_.submit(block->base, n);
      fresh.push_back(std::move(block));
      offset += n;
    }
  } catch (...) {
    for (auto& b : fresh) HostPinner::cancel(*b->job);
    bool unmap = true;
    for (auto& b : fresh) try {
        unregister_if_ready(*b);
      } catch (const std::exception& e) {
        log::error("HostStore: unregistering a {}-byte block failed, leaving it mapped: {}", b->map_bytes, e.what());
        unmap = false;
      }
    if (unmap) ::munmap(base, bytes);
    throw;
  }
  Block* first = fresh.front().get();
  for (auto& b : fresh) keep(std::move(b));
  return *first;
}

std::unique_ptr<HostStore::Block> HostStore::allocated_block(std::size_t bytes) {
  auto block = std::make_unique<Block>();
  block->map_bytes = bytes;
  block->space = RangeAllocator(bytes);
  try {
    block->base = static_cast<std::byte*>(driver_.host_alloc(bytes));
  } catch (const driver_error& e) {
    throw out_of_memory(
        fmt::format("host backing store could not grow by {} pinned bytes ({} held): {}", bytes, capacity(), e.what()));
  }
  block->source = Source::allocated;
  return block;
}

// After its job settled (cancelled first): unregisters a block whose registration went through.
void HostStore::unregister_if_ready(Block& b) {
  if (pinner_.wait(*b.job) == PinJob::Status::ready) driver_.host_unregister(b.base, options_.device);
}

std::unique_ptr<HostStore::Block> HostStore::add_beyond_limit_block(std::size_t bytes) {
  const bool own_file = has_disk_tier() && options_.spill_file_per_span;
  bytes = align_up(bytes, own_file ? SpillStore::alignment : block_rounding);  // a file per span: its size
  auto block = std::make_unique<Block>();
  block->map_bytes = bytes;
  block->space = RangeAllocator(bytes);
  if (own_file) {
    std::size_t held = 0;
    std::size_t files = 0;
    for (auto& b : blocks_)
      if (b->file) {
        held += b->map_bytes;
        ++files;
      }
    if (options_.spill_limit != 0 && held + bytes > options_.spill_limit)
      throw out_of_memory(fmt::format("disk tier: {} more bytes would pass spill_limit {} ({} held in {} files of {})",
                                      bytes, options_.spill_limit, held, files, options_.spill_dir));
    block->file = std::make_unique<SpillStore>(options_.spill_dir, 0, options_.spill_try_direct_io);
    block->file_offset = block->file->allocate(bytes);  // throws out_of_memory; the file goes with `block`
  } else if (spill_) {
    block->file_offset = spill_->allocate(bytes);  // throws out_of_memory with nothing held
  }
  if (own_file || spill_) {
    void* va = ::mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (va == MAP_FAILED) {
      if (!own_file) spill_->free(block->file_offset, bytes);
      throw out_of_memory(fmt::format("host backing store could not reserve addresses for {} spilled bytes", bytes));
    }
    block->base = static_cast<std::byte*>(va);
    block->source = Source::disk;
  } else {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
      throw out_of_memory(
          fmt::format("host backing store could not grow by {} pageable bytes ({} held)", bytes, capacity()));
    block->base = static_cast<std::byte*>(p);
    block->source = Source::pageable;
  }
  return block;
}

void HostStore::reserve(std::size_t bytes) {
  if (bytes == 0) return;
  std::size_t free_total = 0;
  for (auto& b : blocks_) free_total += b->space.free_bytes();
  if (free_total >= bytes) return;
  std::size_t need = bytes - free_total;
  // Pinned up to the limit, in blocks of at most pin_block_bytes; what is left beyond it goes to
  // one pageable or disk block.
  std::size_t room = pinned_room();
  std::size_t pinned = room >= align_up(need, block_rounding) ? need : (room / block_rounding) * block_rounding;
  note_capped(need, pinned);
  if (pinned > 0) add_pinned_blocks(pinned, options_.pin_block_bytes);
  // (With a file per span, allocate() makes each disk span's block: one reserved here would be shared.)
  if (need > pinned && !(has_disk_tier() && options_.spill_file_per_span))
    add_block(need - pinned, has_disk_tier() ? HostTier::disk : HostTier::pageable);
}

std::size_t HostStore::prepare(std::size_t bytes) {
  // Beyond the machine's memory no amount can be page-locked (and rounding it up to whole blocks
  // could wrap to nothing): a caller's mistake, said as such.
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  const std::size_t memory =
      pages > 0 && page > 0 ? static_cast<std::size_t>(pages) * static_cast<std::size_t>(page) : SIZE_MAX / 2;
  if (bytes > memory)
    throw invalid_argument(fmt::format("prepare_host_store: {} bytes is more than this machine's {} bytes of memory; "
                                       "pass at most that, or 0 for what a level-1 sleep of everything needs",
                                       bytes, memory));
  const std::size_t limit = limit_now();
  std::size_t target = limit == 0 ? bytes : std::min(bytes, limit);
  const std::size_t have = pinned_held();
  if (have >= target) {
    note_capped(bytes, target);
    return 0;
  }
  const std::size_t wanted = align_up(target - have, block_rounding);
  std::size_t n = wanted;
  if (limit != 0) n = std::min(n, pinned_room() / block_rounding * block_rounding);
  note_capped(bytes > have ? bytes - have : 0, n);
  if (n == 0) return 0;
  add_pinned_blocks(n, options_.pin_block_bytes);
  return n;
}

HostSpan HostStore::allocate(std::size_t bytes, std::size_t remaining, std::size_t remaining_spans) {
  const std::size_t rounded = reserved_size(bytes);
  const std::size_t on_disk = align_up(bytes, SpillStore::alignment);
  auto take = [&](Block& b, HostTier tier) -> std::optional<HostSpan> {
    bool disk = tier == HostTier::disk;
    std::size_t n = disk ? on_disk : rounded;
    if (b.file && !b.space.unused()) return std::nullopt;  // a file of its own holds one span
    if (auto off = b.space.allocate(n, disk ? SpillStore::alignment : alignment))
      return HostSpan{b.base + *off, n, tier};
    return std::nullopt;
  };
  // Pinned space first (ready or being pinned: both copy at link speed), then the rest.
  for (HostTier want : {HostTier::pinned, HostTier::pageable, HostTier::disk})
    for (auto& b : blocks_)
      if (b->tier() == want)
        if (auto span = take(*b, want)) return *span;
  // Grow by what this sleep still needs: pinned blocks for all of it (as the room allows) at once,
  // so that they are pinned in the order the copies use them; beyond the limit one block within
  // pin_block_bytes.
  std::size_t grow = std::max(rounded, std::min(options_.pin_block_bytes, remaining));
  const std::size_t room = pinned_room() / block_rounding * block_rounding;
  note_capped(std::max(rounded, remaining), std::min(room, std::max(rounded, remaining)));
  Block* b = nullptr;
  if (room >= align_up(rounded, block_rounding)) {
    grow = std::max(rounded, std::min(grow, room));
    b = &add_pinned_blocks(std::max(grow, std::min(remaining, room)), grow);
  } else if (has_disk_tier() && options_.spill_file_per_span) {
    b = &add_block(on_disk, HostTier::disk);  // this span's own file
  } else if (spill_) {
    // Disk spans are rounded up to SpillStore::alignment each.
    grow = std::max(on_disk, std::min(options_.pin_block_bytes, remaining + remaining_spans * SpillStore::alignment));
    b = &add_block(grow, HostTier::disk);
  } else {
    b = &add_block(grow, HostTier::pageable);
  }
  auto span = take(*b, b->tier());
  if (!span) throw error(fmt::format("internal: a new {}-byte host block cannot hold {} bytes", b->map_bytes, bytes));
  return *span;
}

HostStore::Block* HostStore::block_of(const std::byte* p) const {
  auto it = by_base_.upper_bound(p);
  if (it == by_base_.begin()) return nullptr;
  Block* b = std::prev(it)->second;
  return p < b->base + b->map_bytes ? b : nullptr;
}

HostTier HostStore::wait_ready(const HostSpan& span) {
  if (span.tier != HostTier::pinned) return span.tier;
  Block* b = block_of(span.ptr);
  if (b == nullptr) throw error(fmt::format("internal: {} is not in the host store", static_cast<void*>(span.ptr)));
  if (b->source == Source::registered) {
    pinner_.wait(*b->job);
    note_refusal(*b);
  }
  return b->tier();
}

bool HostStore::being_pinned(const HostSpan& span) const {
  if (span.tier != HostTier::pinned) return false;
  const Block* b = block_of(span.ptr);
  return b != nullptr && b->source == Source::registered && !b->job->settled();
}

void HostStore::wait_pinning() {
  pinner_.wait_all();
  for (auto& b : blocks_) note_refusal(*b);
}

void HostStore::free(std::byte* p, std::size_t bytes) {
  Block* b = block_of(p);
  if (b == nullptr) throw error(fmt::format("internal: {} is not in the host store", static_cast<void*>(p)));
  b->space.free(static_cast<std::size_t>(p - b->base), bytes);
}

std::size_t HostStore::release_unused() {
  std::size_t released = 0;
  for (auto it = blocks_.begin(); it != blocks_.end();) {
    Block& b = **it;
    if (b.space.unused()) {
      released += b.map_bytes;
      by_base_.erase(b.base);
      free_block(b);
      it = blocks_.erase(it);
    } else {
      ++it;
    }
  }
  return released;
}

bool HostStore::writable(const HostSpan& span, std::size_t bytes) const {
  if (span.tier != HostTier::disk) return true;
  return file_offset(span.ptr) % SpillStore::alignment == 0 && span.bytes >= align_up(bytes, SpillStore::alignment);
}

SpillStore& HostStore::spill_of(const std::byte* p) const {
  Block* b = block_of(p);
  if (b == nullptr || b->source != Source::disk)
    throw error(fmt::format("internal: {} is not a spilled span", static_cast<const void*>(p)));
  return b->file ? *b->file : *spill_;
}

std::uint64_t HostStore::file_offset(const std::byte* p) const {
  Block* b = block_of(p);
  if (b == nullptr || b->source != Source::disk)
    throw error(fmt::format("internal: {} is not a spilled span", static_cast<const void*>(p)));
  return b->file_offset + static_cast<std::uint64_t>(p - b->base);
}

HostStoreStats HostStore::stats() const {
  HostStoreStats st;
  st.registration_refused = registration_refused_;
  st.budget_bytes = last_budget_.bytes;
  st.budget_source =
      last_budget_.source.empty() ? (options_.pinned_limit ? "host_store_limit" : "none") : last_budget_.source;
  if (last_budget_.source.empty()) st.budget_bytes = options_.pinned_limit;
  st.cgroup_limit = last_budget_.cgroup_limit;
  st.memlock_limit = last_budget_.memlock_limit;
  st.memlock_charged = options_.memlock_charged;
  st.capped = capped_;
  st.numa_node = options_.numa_node;
  st.numa_reason = options_.numa_reason;
  for (auto& b : blocks_) {
    std::size_t used = b->space.used_bytes();
    switch (b->tier()) {
      case HostTier::pinned:
        (b->source == Source::registered && !b->job->settled() ? st.pinning_bytes : st.pinned_bytes) += b->map_bytes;
        st.used_bytes += used;
        break;
      case HostTier::pageable:
        st.pageable_bytes += b->map_bytes;
        st.used_bytes += used;
        break;
      case HostTier::disk:
        st.disk_bytes += b->map_bytes;
        st.disk_used_bytes += used;
        break;
    }
  }
  return st;
}

std::size_t HostStore::capacity() const noexcept {
  HostStoreStats st = stats();
  return st.pinned_bytes + st.pinning_bytes + st.pageable_bytes;
}

std::size_t HostStore::pinned_capacity() const noexcept { return stats().pinned_bytes; }

std::size_t HostStore::used() const noexcept { return stats().used_bytes; }

}  // namespace torpor
