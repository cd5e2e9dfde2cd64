// Pool: one device's sleep-mode-aware allocator.
//
// One VA reservation per device; physical memory in chunks (one driver handle each, a
// multiple of the granularity) mapped at fixed addresses inside it. Allocations above
// `small_limit` get a chunk of their own; smaller ones are carved (256-byte aligned) out of
// slabs that hold a single (tag, class) pair. Carving from a mapped slab makes no driver call.
//
// Every byte of an allocation has a class: parameter (reloadable weights), state (must
// survive bit-exact) or cache (recomputable). allocate() sets one class for the whole
// allocation; mark() reclassifies a sub-range (the PyTorch embedding marks parameters inside
// segments). sleep(level, tags) releases the physical memory of every chunk of those tags and
// keeps, in a persistent host store, only the bytes that must survive:
//
//   class       level 1 (offload)   level 2 (discard_parameters)
//   parameter   offload             discard (offload if its name matches a preserve glob)
//   state       offload             offload
//   cache       discard             discard
//
// wake_up(tags) maps new physical memory at the very same addresses and restores the bytes.
// Failures inside sleep or wake leave each chunk either awake with its bytes or asleep with
// its backup; the call throws and can be repeated once the cause is gone.
//
// All methods are thread-safe (one mutex; sleep and wake hold it for their duration).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "torpor/driver.hpp"
#include "torpor/tags.hpp"

namespace torpor {

enum class MemoryClass : std::uint8_t { parameter = 0, state = 1, cache = 2 };
inline constexpr std::size_t memory_class_count = 3;
std::string_view to_string(MemoryClass c) noexcept;
// Throws invalid_argument naming the accepted names.
MemoryClass parse_memory_class(std::string_view name);

// What a discarded range holds after wake: whatever the new memory had (none), zeros, or
// 0xFF bytes, which read as NaN in fp32, fp16 and bf16, so a forgotten weight reload shows.
enum class FillOnWake : std::uint8_t { none, zero, poison };
std::string_view to_string(FillOnWake f) noexcept;
FillOnWake parse_fill_on_wake(std::string_view name);
inline constexpr std::uint8_t poison_byte = 0xFF;

// How deep a sleep goes (the table above); the values are the levels' numbers, as in vLLM's
// sleep(level=...) and the C API.
enum class SleepLevel : std::uint8_t {
  none = 0,                // memory is not touched
  offload = 1,             // parameters and state offloaded, cache discarded
  discard_parameters = 2,  // parameters discarded too, unless preserved; state offloaded
};
std::string_view to_string(SleepLevel l) noexcept;
// Accepts the names and the numbers 0, 1, 2; throws invalid_argument naming them.
SleepLevel parse_sleep_level(std::string_view name);

struct PoolOptions {
  int device = 0;
  std::size_t va_bytes = 0;  // VA reservation; 0 = twice the device's memory
  FillOnWake fill_on_wake = FillOnWake::none;
  // Physical memory created with shareable handles (POSIX fds; fabric handles where the device's
  // probe_fabric said yes) and GPUDirect RDMA capable where the device supports that: for symmetric
  // memory and for KV transports (export_handles).
  bool exportable = false;
  std::vector<int> peer_devices;  // devices that get access besides `device`

  // Handle-size policy: few, large handles keep VMM calls (and sleep/wake time) low.
  //   bytes <= small_limit             carved from small slabs of slab_bytes
  //   small_limit < bytes <= medium_limit  carved from medium slabs that grow with the
  //                                    (tag, class) as far as the slack bound allows
  //   bytes > medium_limit             a chunk of its own
  // Slack bound: a new medium slab never leaves a (tag, class) with more mapped-but-unallocated
  // medium bytes than clamp(allocated / 8, medium_slab_min, medium_slab_max) (plus less than
  // one granule of rounding), where `allocated` counts the pair's medium allocations with the
  // new one; frees may leave more, which later allocations reuse before any new slab is made.
  // Across the pool, new slabs add no slack beyond a sixteenth of va_bytes or of the device's
  // memory, whichever is smaller (so many tags in a small reservation keep it for allocations).
  // When the device cannot hold the slab the policy asks for, a slab of the allocation's own
  // size is taken: an allocation that fits in free memory never fails for the slab policy.
  std::size_t slab_bytes = 0;                         // 0 = the granularity
  std::size_t small_limit = 0;                        // 0 = slab_bytes / 2
  std::size_t medium_limit = std::size_t{256} << 20;  // 0 disables medium slabs
  std::size_t medium_slab_min = std::size_t{32} << 20;
  std::size_t medium_slab_max = std::size_t{1} << 30;

  // Sleep/wake engine.
  std::size_t copy_piece_bytes = std::size_t{64} << 20;  // copies (and hashes) in pieces of at most this
  int copy_streams = 2;                                  // streams the copies rotate over
  int release_threads = 2;                               // threads unmapping/releasing chunks during sleep
  std::size_t map_group_bytes = std::size_t{2} << 30;    // contiguous chunks mapped per set_access call on wake
  // Bytes of pieces hashed per call during a sleep (skip_unchanged), whole chunks, at least one:
  // the copies and releases of the chunks already hashed run while the next ones are hashed.
  std::size_t hash_group_bytes = std::size_t{1} << 30;
  // Host memory. The offloaded bytes live in a persistent host store; its page-locked blocks are
  // kept from sleep to sleep (a steady cycle allocates nothing) until release_host_store().
  //
  // skip_unchanged (default on): keep the host copies after wake with their device-computed
  // hash; the next sleep hashes again and copies only the pieces whose hash changed, so an
  // unchanged re-sleep takes milliseconds instead of a full copy. The cost: a copy of every byte
  // that survives a sleep stays in (page-locked) host memory while awake. Off, wake gives the
  // copies back to the store (its blocks stay for the next sleep); vLLM's allocator instead
  // frees its host memory after wake: release_host_store() after wake_up does that here.
  bool skip_unchanged = true;
  // Page-locked host store cap in bytes (0 = none). Beyond it backups live in pageable memory
  // or, with spill_dir, on disk; either way moved through a pinned staging ring of
  // staging_slots x staging_slot_bytes (rounded up to 4 KiB).
  std::size_t host_store_limit = 0;
  int staging_slots = 4;
  std::size_t staging_slot_bytes = std::size_t{8} << 20;
  // The disk tier: what does not fit under host_store_limit goes to one file of this directory
  // (created if missing; direct I/O where the file system takes it), at most spill_limit bytes
  // (0 = what the disk holds). Needs host_store_limit > 0; a limit below 2 MiB puts every backup
  // on disk. Empty: no disk tier.
  std::string spill_dir;
  std::size_t spill_limit = 0;
  // false: the spill file uses buffered I/O even where the file system takes O_DIRECT (for file
  // systems whose direct I/O misbehaves; the page cache then holds spilled bytes for a while).
  bool spill_try_direct_io = true;
  // true: a file of its own in spill_dir for every backed-up range of an allocation (contiguous
  // allocations are not merged into one range; a range is cut at copy_piece_bytes), as
  // torch_memory_saver's disk backup writes a file per allocation; a file goes when its copy
  // does. false (default): one spill file per pool. Needs spill_dir.
  bool spill_file_per_allocation = false;
  // Page-locking: the pinned store grows in blocks of at most host_pin_block_bytes (one mapping
  // for all the blocks a sleep or a prepare adds), first touched by host_pin_threads threads
  // (0 = min(16, cores)) and registered block by block as the touching finishes. With
  // host_pin_overlap a sleep that grows the store copies into each new block as soon as that
  // block is page-locked, while the later blocks are still being touched and registered. Off
  // (default), it waits for all of the pinning before its first copy: on the H200 records
  // (bench/results, torpor_bench_sleep --overlap-pinning beside the default in one run)
  // registering host memory slowed the concurrent copies so much that the sum of the two was
  // faster; the option stays for drivers and hosts where overlapping wins. host_store_prepare starts pinning that many
  // bytes in the background when the pool is created (as prepare_host_store() does), so that the first sleep, after the
  // engine loaded its model, runs at steady-state speed.
  std::size_t host_store_prepare = 0;
  int host_pin_threads = 0;
  bool host_pin_overlap = false;
  std::size_t host_pin_block_bytes = std::size_t{1} << 30;
};

inline constexpr std::string_view default_tag = "default";

struct AllocationOptions {
  std::string tag{default_tag};
  MemoryClass memory_class = MemoryClass::state;
  std::string name;  // matched against preserve globs
  // A chunk of its own whatever the size: for memory whose handle is shared with other
  // devices or processes (exporting a slab would share its neighbours too).
  bool dedicated = false;
};

struct AllocationInfo {
  device_ptr base = 0;
  std::size_t bytes = 0;
  std::size_t offset = 0;  // of the queried pointer
  std::string tag;
  MemoryClass memory_class = MemoryClass::state;  // at the queried pointer
  std::string name;                               // at the queried pointer
  bool asleep = false;
};

// The physical chunk an allocation lives in, for layers that share memory between devices
// or processes (symmetric buffers export the handle, bind it to multicast objects, and
// re-export it after every wake: the handle changes, the VA does not).
struct ChunkInfo {
  device_ptr va = 0;       // chunk start (granularity-aligned)
  std::size_t bytes = 0;   // chunk size (a multiple of the granularity)
  std::size_t offset = 0;  // of the queried allocation inside the chunk
  bool awake = false;
  bool dedicated = false;  // the chunk holds this allocation alone
  PhysicalHandle handle;   // valid while awake
};

// One chunk's shareable handle, from Pool::export_handles: what a KV transport registers, or what
// another process (kind posix_fd: of this node; kind fabric: of any node of the NVLink domain)
// imports and maps to reach the same physical memory. It names the memory mapped at
// [va, va + bytes) now: a sleep releases that memory and a wake maps new memory at the same
// addresses, so the handle is then stale; export again after the wake (an after_map tag hook).
// A descriptor (kind posix_fd) is owned by this object: the destructor closes it, release_fd()
// hands it to the caller, who closes it then. An open descriptor, like any import of it, may keep
// the memory it names alive after the pool released it (the host backend's does: it is the memory):
// close it before the tag sleeps (a before_unmap tag hook), or the sleep returns less memory.
struct ExportedChunk {
  device_ptr va = 0;      // chunk start (granularity-aligned); the same address across sleep and wake
  std::size_t bytes = 0;  // chunk size (a multiple of the granularity)
  std::string tag;        // the tag whose allocations the chunk holds
  HandleKind kind = HandleKind::posix_fd;
  FabricHandle fabric;           // kind fabric: the 64 bytes; zeros otherwise
  bool gpu_direct_rdma = false;  // created GPUDirect RDMA capable (DeviceProperties::gpu_direct_rdma_vmm)

  ExportedChunk() = default;
  ExportedChunk(ExportedChunk&& o) noexcept;
  ExportedChunk& operator=(ExportedChunk&& o) noexcept;
  ExportedChunk(const ExportedChunk&) = delete;
  ExportedChunk& operator=(const ExportedChunk&) = delete;
  ~ExportedChunk();
  // The descriptor (kind posix_fd), still owned by this object; -1 for a fabric handle or once
  // released.
  int fd() const noexcept { return fd_; }
  // Hands the descriptor over: the caller owns (and must close) it; -1 when there is none.
  int release_fd() noexcept;
  // Takes ownership of `fd`, closing the descriptor held before (if any).
  void reset_fd(int fd = -1) noexcept;

 private:
  int fd_ = -1;
};

struct ClassStats {
  std::size_t allocated_bytes = 0;
  std::size_t offloaded_bytes = 0;  // held in the host store now
  std::size_t discarded_bytes = 0;  // asleep without a copy now
};

struct TagStats {
  std::string tag;
  bool asleep = false;
  int level = 0;  // deepest level of a sleeping chunk, 0 when awake
  std::size_t chunks = 0;
  std::size_t allocations = 0;
  std::size_t allocated_bytes = 0;  // bytes of the tag's live allocations, as requested, asleep or not
  std::size_t reserved_bytes = 0;   // VA spans of the chunks
  std::size_t mapped_bytes = 0;     // physical memory held now: what the device sees in use
  std::size_t offloaded_bytes = 0;
  std::size_t discarded_bytes = 0;
  std::array<ClassStats, memory_class_count> classes{};
};

struct PoolStats {
  int device = 0;
  std::string backend;
  std::size_t va_bytes = 0;
  std::size_t va_used_bytes = 0;
  std::size_t granularity = 0;
  std::size_t mapped_bytes = 0;
  std::size_t cached_bytes = 0;  // mapped empty slabs kept for the fast path (trim() frees)
  std::size_t chunks = 0;
  std::size_t allocations = 0;
  std::size_t host_store_bytes = 0;           // host memory held: pinned, being pinned, pageable
  std::size_t host_store_pinned_bytes = 0;    // page-locked and ready
  std::size_t host_store_pinning_bytes = 0;   // being page-locked in the background
  std::size_t host_store_pageable_bytes = 0;  // beyond host_store_limit (no spill_dir), or refused pinning
  std::size_t host_store_used_bytes = 0;      // host memory holding copies
  std::size_t retained_bytes = 0;             // host copies kept after wake (skip_unchanged), any tier
  std::size_t spill_bytes = 0;                // disk held by the spill file
  std::size_t spill_used_bytes = 0;           // disk holding copies
  std::string spill_path;                     // the spill file ("" without a disk tier; its directory
                                              // with spill_file_per_allocation)
  bool spill_direct_io = false;               // the spill file takes O_DIRECT
  bool host_registration_refused = false;     // page-locking by registration failed once
  // The page-locked budget, derived at every growth of the store from host_store_limit, the
  // cgroup's memory limit (less its other usage and an eighth kept for the process) and
  // RLIMIT_MEMLOCK where registration counts against it. Beyond it backups are pageable (through
  // the staging ring) or, with spill_dir, on disk; host_store_capped says a growth was cut short.
  std::size_t host_store_budget_bytes = 0;   // 0 = no limit
  std::string host_store_budget_source;      // "none", "host_store_limit", "cgroup <file>", "RLIMIT_MEMLOCK"
  std::size_t host_cgroup_limit_bytes = 0;   // 0 = none found
  std::size_t host_memlock_limit_bytes = 0;  // RLIMIT_MEMLOCK, 0 = unlimited
  bool host_memlock_charged = false;         // registration counts against it (driver capability)
  bool host_store_capped = false;
  // NUMA: the node the store's page-locked blocks prefer (the device's, from its PCI bus id), -1
  // for none (one node, unknown), and why.
  int host_numa_node = -1;
  std::string host_numa_placement;
  // Host store bytes the backups and retained copies hold, every tier (their spans, rounding
  // included): equals host_store_used_bytes + spill_used_bytes, which the store counts on its own.
  std::size_t host_copies_bytes = 0;
  std::size_t pending_releases = 0;      // handles whose release failed and will be retried
  std::size_t address_ranges_bytes = 0;  // VA handed out by reserve_address_range
  std::vector<TagStats> tags;            // sorted by tag
};

// What Pool::read_host_copy found.
struct HostCopyRead {
  bool copied = false;  // a host copy covered every byte asked for, and they were copied
  bool asleep = false;  // the allocation's chunk is asleep (its host copy is its backup)
};

// What one sleep or wake did.
struct TransitionReport {
  struct Phase {
    std::string name;
    double seconds = 0;
  };
  std::string operation;  // "sleep" or "wake_up"
  int level = 0;
  std::vector<std::string> tags;
  std::size_t chunks = 0;           // chunks that changed state
  std::size_t bytes_offloaded = 0;  // copied device -> host by this call
  std::size_t bytes_skipped = 0;    // unchanged since the retained copy: not copied
  std::size_t bytes_hashed = 0;     // hashed on the device
  std::size_t bytes_staged = 0;     // moved through the pinned staging ring (host_store_limit)
  std::size_t bytes_spilled = 0;    // of those, written to (sleep) or read from (wake) the spill file
  std::size_t pieces = 0;           // copy pieces planned
  std::size_t bytes_discarded = 0;  // allocated bytes released without a copy
  std::size_t bytes_released = 0;   // physical memory given back
  std::size_t bytes_mapped = 0;     // physical memory created (wake)
  std::size_t bytes_restored = 0;   // copied host -> device
  std::size_t bytes_filled = 0;     // discarded bytes filled on wake
  double seconds = 0;
  std::vector<Phase> phases;
};

class Pool;

// Layers that keep mappings of their own over pool memory (symmetric buffers: peers' imports,
// multicast bindings) observe sleep and wake. Pool calls these outside its lock, for levels
// 1 and 2 only, with the resolved tag list. A throw from before_* aborts the operation with
// nothing changed in the pool; after_* runs exactly once for every observer whose before_*
// returned: ok = false when the operation (or a later observer's before_*) threw, else ok = true,
// for every observer even if one of them throws (the call then rethrows the first such error).
class SleepObserver {
 public:
  virtual ~SleepObserver() = default;
  virtual void before_sleep(Pool&, int /*level*/, const std::vector<std::string>& /*tags*/) {}
  virtual void after_sleep(Pool&, int /*level*/, const std::vector<std::string>& /*tags*/, bool /*ok*/) {}
  virtual void before_wake(Pool&, const std::vector<std::string>& /*tags*/) {}
  virtual void after_wake(Pool&, const std::vector<std::string>& /*tags*/, bool /*ok*/) {}
};

// Tag hooks: per-tag callbacks for state that must live exactly as long as a tag's mapping
// (transport registrations of the KV cache: vLLM's register_tag_hooks, NIXL). The pool calls
// them outside its lock, on the thread that sleeps or wakes (tag_hooks.cpp has the rules):
//   before_unmap(tag): in every sleep (levels 1, 2; discard is a level-2 sleep) of a tag with
//     at least one mapped chunk, before anything moves and before the SleepObservers' before_*.
//     A throw aborts the sleep with nothing moved; the sleep rethrows it.
//   after_map(tag): after every wake_up, once per wake, for every hooked tag left fully mapped
//     (no chunk asleep; a tag the pool does not know yet counts as mapped, as in vLLM), after
//     the SleepObservers' after_wake (peer imports are mapped again by then). It must be
//     idempotent: it also runs for tags that never slept, and retries an earlier failure.
// Rollback: when a sleep fails after before_unmap ran (a later hook threw, an observer refused,
// the engine failed), after_map runs once for every such tag the failed sleep left fully mapped,
// so no registration stays dropped over mapped memory; a tag partly asleep gets it from the wake
// that maps it. Hooks run in the order they were added; removing one means no new call starts.
struct TagHooks {
  std::function<void(const std::string& tag)> before_unmap;  // may be empty
  std::function<void(const std::string& tag)> after_map;     // may be empty (not both)
};

class Pool {
 public:
  // The driver must outlive the pool.
  explicit Pool(Driver& driver, PoolOptions options = {});
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  void* allocate(std::size_t bytes, const AllocationOptions& options = {});
  void deallocate(void* ptr);
  // Reclassify [ptr, ptr + bytes), which must lie inside one allocation. An empty name keeps
  // the allocation's name. On a sleeping allocation the new classes apply from the next sleep
  // (the wake restores what the last sleep kept), and marking bytes that sleep discarded as
  // state is refused (invalid_state naming the allocation and its tag): they have no content
  // to keep; wake the tag (and reload them) first.
  void mark(void* ptr, std::size_t bytes, MemoryClass memory_class, std::string_view name = {});
  std::optional<AllocationInfo> find(const void* ptr) const;
  // The chunk of the allocation that contains ptr; nothing when ptr is not allocated here.
  std::optional<ChunkInfo> chunk_info(const void* ptr) const;
  // The shareable handles of the chunks that hold allocations of `tags` (empty: every tag), in
  // address order, one per chunk: what a KV transport registers (ExportedChunk says what each is
  // and who owns the descriptor). `kind`: the handle kind, or nothing for export_kind(). All or
  // nothing: on any refusal or failure nothing is handed out (descriptors already made are
  // closed). Refused: a pool that is not exportable (invalid_state: PoolOptions::exportable); an
  // unknown tag (invalid_argument); a chunk of those tags asleep (invalid_state: sleep released its
  // memory, so it has no handle; wake the tag first); fabric handles where this device's
  // probe_fabric said no, or a kind the driver lacks (unavailable, with the cause); more chunks
  // than `max_chunks` (invalid_argument, nothing exported; export_count() says how many).
  std::vector<ExportedChunk> export_handles(const std::vector<std::string>& tags = {},
                                            std::optional<HandleKind> kind = std::nullopt,
                                            std::size_t max_chunks = std::numeric_limits<std::size_t>::max()) const;
  // How many chunks export_handles(tags, kind) would hand out now, after the same checks; it
  // exports nothing.
  std::size_t export_count(const std::vector<std::string>& tags = {},
                           std::optional<HandleKind> kind = std::nullopt) const;
  // The kind export_handles gives when none is asked for: fabric where the driver has fabric
  // handles and this device's probe_fabric said yes (the memory was created with the fabric type),
  // else a POSIX descriptor; nothing for a pool that is not exportable.
  std::optional<HandleKind> export_kind() const;
  PoolStats stats() const;
  // What the next wakes write into discarded bytes (PoolOptions::fill_on_wake), for engines that
  // decide it per wake (vLLM reads VLLM_POISON_DISCARDED_PAGES at each wake). Returns the
  // previous value; a value outside the enum is invalid_argument.
  FillOnWake set_fill_on_wake(FillOnWake fill);
  // Parameters whose name matches one of these globs (fnmatch) are offloaded by level 2.
  void set_preserve(std::vector<std::string> globs);
  std::vector<std::string> preserve() const;

  // See the table above; SleepLevel::none does nothing. Empty `requested` = every known tag.
  TransitionReport sleep(SleepLevel level, const std::vector<std::string>& requested = {});
  // The level as its number: 0, 1 or 2 (anything else is invalid_argument).
  TransitionReport sleep(int level, const std::vector<std::string>& requested = {});
  TransitionReport wake_up(const std::vector<std::string>& requested = {});
  bool asleep(std::string_view tag) const;
  std::vector<std::string> tags() const;

  // A span of the pool's VA reservation with nothing mapped, for mappings the caller makes
  // itself (peer imports, multicast): its addresses stay fixed for the pool's life.
  // bytes is rounded up to the granularity. Throws out_of_memory when the reservation is full.
  device_ptr reserve_address_range(std::size_t bytes);
  // The caller must have unmapped everything it mapped inside the span.
  void release_address_range(device_ptr va);

  // Observers are not owned; remove before destroying them.
  void add_observer(SleepObserver* observer);
  void remove_observer(SleepObserver* observer);

  // Tag hooks (see TagHooks above). Returns the id for remove_tag_hooks; an empty tag, or both
  // callbacks empty, is invalid_argument. Removing an id that is not a live hook is
  // invalid_argument (removed twice?).
  std::uint64_t add_tag_hooks(const std::string& tag, TagHooks hooks);
  void remove_tag_hooks(std::uint64_t id);
  // after_map of every hooked tag that is fully mapped, as a wake that maps nothing selected runs
  // them (vLLM calls its after_map hooks after every wake-up, whatever it selected). A hook's
  // exception propagates after the others ran, as at the end of wake_up.
  void run_after_map_hooks();

  // Synchronous copy through the pool's stream, any direction (host <-> pool memory). For
  // tests, tools and embeddings that have no stream of their own.
  void copy(void* dst, const void* src, std::size_t bytes);

  // The host copy of [ptr, ptr + bytes), copied to the host memory at `dst`: the backup while
  // the allocation sleeps, the retained copy (skip_unchanged) while it is awake, which holds the
  // bytes of the last sleep. The range must lie inside one allocation (invalid_argument
  // otherwise). Nothing is copied when no host copy covers every byte of it (discarded bytes,
  // an awake allocation without a retained copy): the result says so and whether it sleeps.
  HostCopyRead read_host_copy(const void* ptr, std::size_t bytes, void* dst) const;

  // Unmaps cached empty slabs. Returns the bytes released.
  std::size_t trim();
  // Drops the host copies kept after wake (skip_unchanged) and gives every unused host store
  // block back, memory and disk (backups of sleeping chunks stay). Returns the bytes released.
  std::size_t release_host_store();
  // Starts page-locking host memory in the background until the pinned store holds `bytes`
  // (0: what a level-1 sleep of everything allocated now needs), within host_store_limit, so that
  // a later first sleep copies at full speed instead of waiting for pinning. Returns at once,
  // with the bytes being added. Call it while the engine loads its model.
  std::size_t prepare_host_store(std::size_t bytes = 0);
  // The host store bytes a sleep at `level` (0, 1, 2) of `tags` (empty: all) would hold with the
  // classes marked now: what an engine prepares before its first sleep (a level-2-only workload
  // needs only its state bytes). Unknown tags are invalid_argument, as for sleep().
  std::size_t sleep_host_bytes(int level, const std::vector<std::string>& tags = {}) const;
  // Blocks until no host store block is being pinned (without holding up other calls).
  void wait_host_store();
  // Reclassify several ranges at once, in order (later ranges win where they overlap): what an
  // embedding does before every sleep, in one call. Every range is checked first; on a bad one
  // nothing is applied and invalid_argument names its index.
  struct MarkRange {
    void* ptr = nullptr;
    std::size_t bytes = 0;
    MemoryClass memory_class = MemoryClass::state;
    std::string_view name;  // empty keeps the name
  };
  void mark(std::span<const MarkRange> ranges);

  Driver& driver() const noexcept { return driver_; }
  int device() const noexcept { return options_.device; }
  device_ptr va_base() const noexcept { return va_base_; }
  std::size_t va_bytes() const noexcept { return options_.va_bytes; }
  std::size_t granularity() const noexcept { return granularity_; }
  const PoolOptions& options() const noexcept { return options_; }

  struct State;  // internals, defined in pool_state.hpp

 private:
  // The engine itself (sleep.cpp, wake.cpp), without observers; tags already resolved.
  TransitionReport sleep_tags(SleepLevel level, const std::vector<std::string>& tags);
  TransitionReport wake_tags(const std::vector<std::string>& tags);

  Driver& driver_;
  PoolOptions options_;
  std::size_t granularity_ = 0;
  device_ptr va_base_ = 0;
  std::unique_ptr<State> state_;
};

std::string to_json(const PoolStats& stats, int indent = -1);
std::string to_json(const TransitionReport& report, int indent = -1);

}  // namespace torpor
