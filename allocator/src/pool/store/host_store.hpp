// HostStore: the persistent host backing store that offloaded bytes live in while a pool
// sleeps (and, with skip-unchanged, after it wakes, as retained copies).
//
// Three tiers, in the order spans are given out:
//   pinned    page-locked memory, copied to and from at link speed. It is mapped anonymous (one
//             mapping for all the blocks one growth adds), advised for huge pages, first-touched
//             by several threads and registered (HostPinner) block by block, in blocks of at
//             most pin_block_bytes, in the background: allocate() hands out spans in a block at
//             once, and whoever copies waits (wait_ready) for its block's pinning to finish, so a
//             sleep that grew the store copies into block k while block k + 1 is pinned (or,
//             with host_pin_overlap off, waits for all of it first: sleep_plan.hpp); prepare() pins ahead of a sleep
//             (while an engine loads its model).
//             Where registration is refused (one log line), that block's spans are pageable and
//             the store grows with Driver::host_alloc from then on;
//   pageable  beyond `pinned_limit`: ordinary memory, moved through the pinned staging ring;
//   disk      beyond the limit when a spill directory is set, instead of pageable memory:
//             extents of a SpillStore file. A disk block is a span of reserved, inaccessible
//             addresses standing for its extent (file offset = block offset + address - base),
//             so spans of every tier are split and freed by address alike, and a stray access
//             to one faults. With spill_file_per_span every disk block is one span in a
//             SpillStore (file) of its own, sized for that span, never shared by two spans, and
//             the spill limit is counted over all of them; no pool-wide file exists then.
// A steady cycle allocates nothing: blocks are kept until release_unused() or destruction.
//
// Like the machine (host_topology.hpp): with `sys_root` set, the page-locked limit is the budget
// derived at every growth from pinned_limit, the cgroup's memory limit and RLIMIT_MEMLOCK (where
// registration is charged to it); a growth the budget cuts short logs once why and what happens
// instead. Registered blocks are bound to prefer `numa_node` (the device's) before first touch.
//
// Invariants: every span lies inside one block (so one registration covers a pinned copy);
// disk spans start at file offsets aligned to SpillStore::alignment and cover whole aligned
// extents; a block is unmapped (and unregistered when ready) only after its pinning settled.
// Not thread-safe: the pool locks (the pinner's threads only touch blocks they were given).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/range_allocator.hpp"
#include "pool/store/host_pinner.hpp"
#include "pool/store/host_topology.hpp"
#include "pool/store/spill_store.hpp"
#include "torpor/driver.hpp"

namespace torpor {

enum class HostTier : std::uint8_t { pinned, pageable, disk };
std::string_view to_string(HostTier t) noexcept;

struct HostSpan {
  std::byte* ptr = nullptr;
  std::size_t bytes = 0;  // reserved (what free() takes back)
  HostTier tier = HostTier::pinned;
};

struct HostStoreOptions {
  int device = 0;                                      // registration's context
  std::size_t pinned_limit = 0;                        // page-locked bytes at most; 0 = no limit
  std::size_t pin_block_bytes = std::size_t{1} << 30;  // pinned growth in blocks of at most this
  int pin_threads = 0;                                 // first-touch threads; 0 = min(16, cores)
  std::string spill_dir;                               // beyond the limit: files here (empty: pageable)
  std::size_t spill_limit = 0;                         // disk bytes at most; 0 = no limit
  bool spill_try_direct_io = true;                     // false: buffered I/O on the spill file
  bool spill_file_per_span = false;                    // true: each disk span in a file of its own
  std::string sys_root;                                // derive the budget from this /sys ("": pinned_limit only)
  bool memlock_charged = false;                        // registration counts against RLIMIT_MEMLOCK
  int numa_node = -1;                                  // node the pinned blocks prefer; -1: first touch
  std::string numa_reason;                             // why that node (stats)
};

struct HostStoreStats {
  std::size_t pinned_bytes = 0;    // page-locked and ready
  std::size_t pinning_bytes = 0;   // being page-locked in the background
  std::size_t pageable_bytes = 0;  // beyond the limit, or where registration was refused
  std::size_t used_bytes = 0;      // host memory holding copies
  std::size_t disk_bytes = 0;      // spill file extents held
  std::size_t disk_used_bytes = 0;
  bool registration_refused = false;
  std::size_t budget_bytes = 0;   // page-locked bytes at most, as last derived (0 = no limit)
  std::string budget_source;      // what set it ("none", "host_store_limit", "cgroup ...", "RLIMIT_MEMLOCK")
  std::size_t cgroup_limit = 0;   // the cgroup memory limit seen (0 = none)
  std::size_t memlock_limit = 0;  // RLIMIT_MEMLOCK (0 = unlimited)
  bool memlock_charged = false;
  bool capped = false;  // a growth was cut short by the budget
  int numa_node = -1;   // node the pinned blocks prefer (-1: none)
  std::string numa_reason;
};

class HostStore {
 public:
  static constexpr std::size_t alignment = 256;
  static constexpr std::size_t block_rounding = std::size_t{2} << 20;

  explicit HostStore(Driver& driver, HostStoreOptions options = {});
  ~HostStore();
  HostStore(const HostStore&) = delete;
  HostStore& operator=(const HostStore&) = delete;

  // What allocate(bytes) takes in host memory (a disk span takes it rounded to SpillStore::alignment).
  static constexpr std::size_t reserved_size(std::size_t bytes) noexcept { return align_up(bytes, alignment); }
  // Ensure `bytes` more (a sum of reserved_size values) fit: pinned blocks up to the limit, then
  // one pageable or disk block.
  void reserve(std::size_t bytes);
  // Grow the pinned tier, in the background, until it holds min(bytes, pinned_limit). Returns the
  // bytes added (0 when it already holds that much).
  std::size_t prepare(std::size_t bytes);
  // A span: pinned space first, then pageable or disk. When nothing fits, the store grows by a
  // block sized for what this sleep still needs (`remaining` bytes, a sum of reserved_size values,
  // in `remaining_spans` spans; this one included) within pin_block_bytes. Throws out_of_memory
  // (host memory, disk, spill limit).
  HostSpan allocate(std::size_t bytes, std::size_t remaining = 0, std::size_t remaining_spans = 1);
  // The span's tier once its bytes can be copied: for a span in a block still being pinned,
  // waits for the pinning (pageable when registration was refused).
  HostTier wait_ready(const HostSpan& span);
  // Whether the span's block is still being pinned (wait_ready would block).
  bool being_pinned(const HostSpan& span) const;
  // Blocks until no block is being pinned.
  void wait_pinning();
  // Any allocated sub-range, exactly.
  void free(std::byte* p, std::size_t bytes);
  // Gives unused blocks back (cancelling their pinning). Returns the bytes released (memory and disk).
  std::size_t release_unused();

  // The spill file offset of a disk span's address, in the file spill_of(p) gives.
  std::uint64_t file_offset(const std::byte* p) const;
  // The file a disk span's address lies in: its block's own (spill_file_per_span), else the
  // pool's spill store. Throws the internal error for an address that is not a disk span's.
  SpillStore& spill_of(const std::byte* p) const;
  // Whether backups beyond the limit go to disk (spill_dir set), whatever the file layout.
  bool has_disk_tier() const noexcept { return !options_.spill_dir.empty(); }
  // Whether `bytes` may be written into `span`: always for memory; for a disk span only when it
  // owns whole aligned extents of the file (a write rounds up to SpillStore::alignment, and a span
  // cut out of a larger copy may start or end inside an extent another copy still holds).
  bool writable(const HostSpan& span, std::size_t bytes) const;
  // The pool-wide spill store (none with spill_file_per_span).
  SpillStore* spill() noexcept { return spill_.get(); }
  const SpillStore* spill() const noexcept { return spill_.get(); }

  HostStoreStats stats() const;
  std::size_t capacity() const noexcept;         // host memory held (pinned, being pinned, pageable)
  std::size_t pinned_capacity() const noexcept;  // page-locked and ready
  std::size_t used() const noexcept;             // host memory holding copies
  std::size_t blocks() const noexcept { return blocks_.size(); }
  std::size_t growths() const noexcept { return growths_; }  // blocks ever added
  std::size_t pinned_limit() const noexcept { return options_.pinned_limit; }
  // The page-locked budget now (derives it again; see the note above).
  PinBudget budget();
  int pin_threads() const noexcept { return pinner_.threads(); }
  // Thread-safe: waiting for the pinning needs no pool lock.
  HostPinner& pinner() noexcept { return pinner_; }

 private:
  enum class Source : std::uint8_t { registered, allocated, pageable, disk };
  struct Block {
    std::byte* base = nullptr;
    std::size_t map_bytes = 0;  // the mapping (registered, pageable, disk) or allocation
    Source source = Source::pageable;
    RangeAllocator space;
    std::shared_ptr<PinJob> job;       // registered blocks
    std::uint64_t file_offset = 0;     // disk blocks
    std::unique_ptr<SpillStore> file;  // a disk block's own file (spill_file_per_span)
    HostTier tier() const noexcept;
    bool counts_as_pinned() const noexcept;  // toward pinned_limit
  };

  Block& add_block(std::size_t bytes, HostTier tier);
  Block& keep(std::unique_ptr<Block> block);
  // `bytes` of pinned blocks: the first of `first_block` bytes, the rest of pin_block_bytes at
  // most; registered blocks come from one mapping. Returns the first.
  Block& add_pinned_blocks(std::size_t bytes, std::size_t first_block);
  Block& add_registered_blocks(std::size_t bytes, std::size_t first_block);
  std::unique_ptr<Block> allocated_block(std::size_t bytes);
  std::unique_ptr<Block> add_beyond_limit_block(std::size_t bytes);
  void unregister_if_ready(Block& b);
  std::size_t pinned_room();
  std::size_t limit_now();  // the budget's bytes (0 = none), noting it for stats
  void note_capped(std::size_t wanted, std::size_t got);
  std::size_t pinned_held() const noexcept;  // toward the limit
  Block* block_of(const std::byte* p) const;
  Block* fitting(std::size_t bytes, bool (*want)(const Block&));
  void note_refusal(const Block& b);
  void free_block(Block& b) noexcept;

  Driver& driver_;
  HostStoreOptions options_;
  std::unique_ptr<SpillStore> spill_;
  HostPinner pinner_;
  std::vector<std::unique_ptr<Block>> blocks_;  // in the order they were added
  std::map<const std::byte*, Block*> by_base_;  // for lookups by address
  std::size_t growths_ = 0;
  bool registration_refused_ = false;
  PinBudget last_budget_;
  bool capped_ = false;
};

}  // namespace torpor
