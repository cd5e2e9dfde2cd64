// Every environment variable torpor reads, in one table (name, default, description, parser),
// after mimalloc's options table. Nothing else in the libraries or tools calls getenv.
//
// Invariants:
//   - a value is read from the environment on every query, never cached here: tests and
//     launchers set variables at run time (the log level is the one value its user caches);
//   - an empty value counts as unset;
//   - a value that does not parse is an invalid_argument naming the variable, the text and the
//     accepted values or range; it never silently becomes the default;
//   - choices (TORPOR_LOG, TORPOR_BACKEND, TORPOR_HOST_MODE) match in any case;
//   - the kill switches keep the multicast policy's meaning of "set": any value except empty,
//     0, false, no, off (any case) for the disable switches; NCCL_NVLS_ENABLE counts when it
//     is one of 0, false, no, off.
// README's Configuration table lists exactly the rows of the table (a test checks it).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "torpor/log.hpp"

namespace torpor::options {

enum class id {
  log,
  backend,
  host_devices,
  host_device_memory,
  host_mode,
  group_timeout_ms,
  group_rendezvous,
  rank,
  world_size,
  tmpdir,
  nccl_library,
  disable_multicast,
  torch_symm_mem_disable_multicast,
  nvshmem_disable_nvls,
  nccl_nvls_enable,
  tms_init_enable,
  tms_init_enable_cpu_backup,
  tms_init_cpu_backup_backend,
  tms_init_enable_disk_backup,
  tms_retain_cpu_backup,
  tms_disk_backup_dir,
  sysfs_root,
  host_pci_bus_ids,
  nccl_graph_register,
  pytorch_cuda_alloc_conf,
  pytorch_alloc_conf,
  host_node,
  host_fabric,
  master_addr,
  master_port,
  launcher_rank,
  launcher_world_size,
  local_rank,
  local_world_size,
};

// How a row's text is parsed and validated.
enum class kind {
  choice,       // one of `choices`, any case
  integer,      // whole decimal number in [min, max]
  size,         // parse_size() syntax (digits, optional K/M/G/T), in [min, max] bytes
  text,         // any non-empty string
  disable,      // a kill switch: set unless empty, 0, false, no or off
  nvls_enable,  // NCCL's enable flag: disables multicast when 0, false, no or off
};

struct Option {
  id key;
  std::string_view name;
  std::string_view default_text;  // "" when the variable has no default
  std::string_view description;
  kind parser;
  std::int64_t min = 0;
  std::int64_t max = 0;
  // The initializer keeps the table's rows that omit it free of -Wmissing-field-initializers.
  std::span<const std::string_view> choices = {};  // NOLINT(readability-redundant-member-init)
};

// The table, in README order.
std::span<const Option> table();
const Option& option(id key);

// The environment's text for the row, or nothing when unset or empty.
std::optional<std::string> raw(id key);

// parse_size()'s syntax: digits, then nothing, B, K/KiB/k, M/MiB, G/GiB or T/TiB. Throws
// invalid_argument on anything else and on a size that does not fit in 64 bits.
std::size_t parse_size_text(std::string_view text);

// Parses `text` as the row's value; returns it normalised (a choice in lower case, a number
// in decimal). Throws invalid_argument naming the variable, the text and what is accepted.
std::string validate(const Option& o, std::string_view text);

// Typed values: the environment's when set (validated), else the table's default.
log::level log_level();                         // TORPOR_LOG
std::string backend();                          // TORPOR_BACKEND: "auto", "host" or "cuda"
bool host_async();                              // TORPOR_HOST_MODE=async: the host backend queues device work
int host_devices();                             // TORPOR_HOST_DEVICES
std::size_t host_device_memory();               // TORPOR_HOST_DEVICE_MEMORY, bytes
std::chrono::milliseconds group_timeout();      // TORPOR_GROUP_TIMEOUT_MS
std::optional<std::string> group_rendezvous();  // TORPOR_GROUP_RENDEZVOUS (no default)
std::optional<int> rank();                      // TORPOR_RANK (no default)
std::optional<int> world_size();                // TORPOR_WORLD_SIZE (no default)
std::string tmpdir();                           // TMPDIR
std::string nccl_library();                     // TORPOR_NCCL_LIBRARY
// torch_memory_saver's variables, read by the preload library (preload/): a switch row
// (tms_init_enable, tms_init_enable_cpu_backup, tms_init_enable_disk_backup, tms_retain_cpu_backup)
// is on for 1, true, yes (any case), off for 0, false, no or unset; anything else is refused.
bool tms_switch(id key);
std::string tms_cpu_backup_backend();         // TMS_INIT_CPU_BACKUP_BACKEND: "pinned" or "mmap"
std::string tms_disk_backup_dir();            // TMS_DISK_BACKUP_DIR
std::string sysfs_root();                     // TORPOR_SYSFS_ROOT: where /sys is (a fake tree in tests)
std::vector<std::string> host_pci_bus_ids();  // TORPOR_HOST_PCI_BUS_IDS, comma-separated, per device
int host_node();                              // TORPOR_HOST_NODE: the host backend's emulated node
std::string host_fabric();                    // TORPOR_HOST_FABRIC: on, off, no-channel or import-refused
// The launcher's rendezvous (torchrun, Slurm via srun --export or a wrapper): tcp_group_from_env().
std::optional<std::string> master_addr();  // MASTER_ADDR (no default)
std::optional<int> master_port();          // MASTER_PORT (no default)
std::optional<int> launcher_rank();        // RANK
std::optional<int> launcher_world_size();  // WORLD_SIZE
std::optional<int> local_rank();           // LOCAL_RANK
std::optional<int> local_world_size();     // LOCAL_WORLD_SIZE
// NCCL_GRAPH_REGISTER, PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF are other programs'
// settings that `torpor doctor` reports through raw(); torpor's C++ code does not act on them.

// Whether a kill switch row counts as set for the text (nothing: unset). Pure.
bool switch_set(const Option& o, const std::optional<std::string>& text);
// "NAME=value" of the first multicast kill switch that is set, in table order, or nothing.
std::optional<std::string> multicast_kill_switch();

// The effective value of every row, for `torpor probe --config`.
struct Setting {
  std::string_view name;
  std::string value;  // normalised; the raw text when invalid; "" when unset with no default
  bool from_environment = false;
  std::string error;  // why the environment's text is refused ("" when valid)
  std::string_view description;
};
std::vector<Setting> effective();

}  // namespace torpor::options
