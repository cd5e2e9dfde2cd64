// Host memory like the machine: which NUMA node the host store of a device's pool should live on,
// and how many bytes of it may be page-locked.
//
// NUMA: on a two-socket server a GPU hangs off one socket's PCIe root; its copies to memory of the
// other socket cross the inter-socket link. The node is the device's PCI function's
// (<sys>/bus/pci/devices/<bus id>/numa_node, the bus id from the driver); the store binds its
// blocks there with mbind(MPOL_PREFERRED) before their first touch (the kernel places pages at the
// first fault), so a full node still falls back to the others instead of failing. Nothing is done
// on a machine with one node online, or when the node is unknown (-1, no bus id, no file).
//
// Budget: page-locked memory cannot be reclaimed, so a store pinned past the container's memory
// limit gets the process killed, and one pinned past RLIMIT_MEMLOCK is refused (where the driver's
// registration is charged to it: DriverCapabilities says; the CUDA driver's is not). The budget is
// the least of: the user's host_store_limit, RLIMIT_MEMLOCK (when charged and finite), and the
// cgroup's room (memory.max of cgroup v2, else v1's memory.limit_in_bytes; less what the cgroup
// uses now but its inactive file cache, less an eighth of the limit kept for everything else). Beyond it the store
// gives pageable memory (copied through the staging ring) or, with a spill directory, the disk tier.
//
// Every reader takes the root of the system tree (/sys; TORPOR_SYSFS_ROOT for tests, pointing at a
// fake tree) and returns "unknown" rather than throwing on a missing or unreadable file.
// Thread-safe (no state).
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace torpor {

struct NumaPlacement {
  int node = -1;         // the node to prefer; -1: no placement
  int nodes_online = 1;  // nodes the machine has online
  std::string reason;    // why (for stats and the log)
};

// The NUMA node of PCI function `bus_id` ("0000:3b:00.0", any case), -1 when unknown.
int pci_numa_node(std::string_view sys_root, std::string_view bus_id);
// Nodes online (<sys>/devices/system/node/online, "0-1,3" counts 3); 1 when unknown.
int numa_nodes_online(std::string_view sys_root);
// The placement for the host store of the device with `bus_id` ("" when the driver gave none).
NumaPlacement numa_placement(std::string_view sys_root, std::string_view bus_id);

// Binds [p, p + bytes) (page-aligned, not yet touched) to prefer `node` (mbind, a raw syscall).
// Returns false (errno kept) when the kernel refuses; the memory stays usable either way.
bool prefer_numa_node(void* p, std::size_t bytes, int node) noexcept;
// The policy of the page at `p` (get_mempolicy with MPOL_F_ADDR): {mode, first node of the
// mask or -1}; nothing when the kernel refuses (seccomp, no NUMA support).
struct MemPolicy {
  int mode = 0;  // MPOL_DEFAULT 0, MPOL_PREFERRED 1, MPOL_BIND 2, ...
  int node = -1;
};
std::optional<MemPolicy> memory_policy_of(const void* p) noexcept;
inline constexpr int mpol_preferred = 1;

struct PinBudget {
  std::size_t bytes = 0;          // page-locked bytes at most; 0 = no limit
  std::string source;             // what set it: "none", "host_store_limit", "cgroup memory.max", ...
  std::size_t cgroup_limit = 0;   // the cgroup's memory limit (0 = none found)
  std::size_t cgroup_usage = 0;   // what the cgroup used when read, less its inactive file cache
  std::size_t memlock_limit = 0;  // RLIMIT_MEMLOCK soft limit (0 = unlimited)
  bool memlock_charged = false;   // whether registration is charged to it (and so it counts)
};

// The cgroup's memory limit and usage (v2 memory.max / memory.current, else v1
// memory/memory.limit_in_bytes / memory.usage_in_bytes); limit 0 when there is none ("max", or
// v1's "unlimited" value near 2^63).
struct CgroupMemory {
  std::size_t limit = 0;
  std::size_t usage = 0;
  std::size_t reclaimable = 0;  // inactive file cache (memory.stat), which usage counts
  std::string file;             // the limit's file, for messages
};
CgroupMemory cgroup_memory(std::string_view sys_root);
// RLIMIT_MEMLOCK's soft limit, 0 when unlimited.
std::size_t memlock_limit() noexcept;
// The budget from the pieces above; pure, for tests. `user_limit` 0 = none. `held`: bytes the
// store has page-locked already, which the cgroup's usage includes (so they count as room).
PinBudget pin_budget(std::size_t user_limit, const CgroupMemory& cgroup, std::size_t memlock, bool memlock_charged,
                     std::size_t held);
// The same, reading the machine under `sys_root`.
PinBudget read_pin_budget(std::string_view sys_root, std::size_t user_limit, bool memlock_charged, std::size_t held);

}  // namespace torpor
