// The options table and its parsers. See options.hpp for the invariants.
#include "common/options.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <limits>
#include <utility>

#include "torpor/backend_table.hpp"
#include "torpor/error.hpp"

namespace torpor::options {
namespace {

constexpr std::array<std::string_view, 5> log_levels = {"off", "error", "warn", "info", "debug"};
constexpr auto backend_description = spoken_backends("backend: ", "; any case");
constexpr std::array<std::string_view, 2> host_modes = {"sync", "async"};
// torch_memory_saver's get_bool_env_var (csrc/utils.h at 4a43c97) takes these, in two cases each.
constexpr std::array<std::string_view, 6> tms_switch_values = {"1", "true", "yes", "0", "false", "no"};
constexpr std::array<std::string_view, 2> tms_backends = {"pinned", "mmap"};
constexpr std::array<std::string_view, 4> host_fabric_modes = {"on", "off", "no-channel", "import-refused"};
// Emulated nodes of one machine; far more than any test lays out.
constexpr std::int64_t max_host_node = 1023;

constexpr std::int64_t max_host_devices = 64;
// The host backend only accounts device memory; the bound keeps every sum of sizes far from
// overflowing 64 bits.
constexpr std::int64_t max_host_device_memory = std::int64_t{1} << 50;  // 1024T
// A day: long enough for any collective, short enough that no std::chrono arithmetic on it
// (deadlines as steady_clock time points in nanoseconds) can overflow.
constexpr std::int64_t max_group_timeout_ms = std::int64_t{24} * 60 * 60 * 1000;
// Unix socket groups are node-local: one process per rank on one machine.
constexpr std::int64_t max_world_size = 65536;

// clang-format off
constexpr std::array<Option, 34> rows = {{
  {id::log, "TORPOR_LOG", "warn", "log level: off, error, warn, info or debug (any case)",
   kind::choice, 0, 0, log_levels},
  {id::backend, "TORPOR_BACKEND", "auto", backend_description.view(), kind::choice, 0, 0, backend_names},
  {id::host_devices, "TORPOR_HOST_DEVICES", "8", "the host backend's number of emulated devices",
   kind::integer, 1, max_host_devices},
  {id::host_device_memory, "TORPOR_HOST_DEVICE_MEMORY", "16G",
   "the host backend's memory per emulated device (bytes; K, M, G, T suffixes)",
   kind::size, 1, max_host_device_memory},
  {id::host_mode, "TORPOR_HOST_MODE", "sync",
   "the host backend's device work: sync (done when a call returns) or async (queued on emulated streams with "
   "random delays, so a missing wait shows; any case)",
   kind::choice, 0, 0, host_modes},
  {id::group_timeout_ms, "TORPOR_GROUP_TIMEOUT_MS", "60000", "bound on every group wait, in milliseconds (at most 24 h)",
   kind::integer, 1, max_group_timeout_ms},
  {id::group_rendezvous, "TORPOR_GROUP_RENDEZVOUS", "",
   "unix_group_from_env(): the rendezvous (Rendezvous::to_string())", kind::text},
  {id::rank, "TORPOR_RANK", "", "unix_group_from_env(): this rank", kind::integer, 0, max_world_size - 1},
  {id::world_size, "TORPOR_WORLD_SIZE", "", "unix_group_from_env(): the number of ranks",
   kind::integer, 1, max_world_size},
  {id::tmpdir, "TMPDIR", "/tmp", "where Rendezvous::create() makes the group's private directory", kind::text},
  {id::nccl_library, "TORPOR_NCCL_LIBRARY", "libnccl.so.2",
   "the NCCL library that NcclGroup and the unfused tail open", kind::text},
  {id::disable_multicast, "TORPOR_DISABLE_MULTICAST", "",
   "kill switch: set (any value but 0, false, no, off), torpor creates no multicast object and NCCL gets "
   "NCCL_NVLS_ENABLE=0 even when the user set it", kind::disable},
  {id::torch_symm_mem_disable_multicast, "TORCH_SYMM_MEM_DISABLE_MULTICAST", "",
   "PyTorch's kill switch, honoured like TORPOR_DISABLE_MULTICAST; NCCL gets NCCL_NVLS_ENABLE=0 unless the user "
   "set it", kind::disable},
  {id::nvshmem_disable_nvls, "NVSHMEM_DISABLE_NVLS", "",
   "NVSHMEM's kill switch, honoured like TORCH_SYMM_MEM_DISABLE_MULTICAST", kind::disable},
  {id::nccl_nvls_enable, "NCCL_NVLS_ENABLE", "",
   "NCCL's switch: 0 (or false, no, off) is a kill switch for torpor too", kind::nvls_enable},
  {id::tms_init_enable, "TMS_INIT_ENABLE", "0",
   "the preload library: every cudaMalloc of a thread is in a torch_memory_saver region from the start (1, true, "
   "yes; 0, false, no)", kind::choice, 0, 0, tms_switch_values},
  {id::tms_init_enable_cpu_backup, "TMS_INIT_ENABLE_CPU_BACKUP", "0",
   "the preload library: a thread's regions keep a CPU backup until it says otherwise", kind::choice, 0, 0,
   tms_switch_values},
  {id::tms_init_cpu_backup_backend, "TMS_INIT_CPU_BACKUP_BACKEND", "pinned",
   "the preload library's cpu_backup_backend until a region says otherwise: pinned or mmap", kind::choice, 0, 0,
   tms_backends},
  {id::tms_init_enable_disk_backup, "TMS_INIT_ENABLE_DISK_BACKUP", "0",
   "the preload library: a thread's regions back up to disk until it says otherwise", kind::choice, 0, 0,
   tms_switch_values},
  {id::tms_retain_cpu_backup, "TMS_RETAIN_CPU_BACKUP", "0",
   "the preload library: host backups stay after resume (torch_memory_saver's retain_cpu_backup)", kind::choice,
   0, 0, tms_switch_values},
  {id::tms_disk_backup_dir, "TMS_DISK_BACKUP_DIR", "/tmp",
   "the preload library's disk backups: the pools' disk tier in this directory", kind::text},
  {id::sysfs_root, "TORPOR_SYSFS_ROOT", "/sys",
   "where the host store reads the machine: the GPU's NUMA node (bus/pci/devices/<bus id>/numa_node, "
   "devices/system/node/online) and the cgroup memory limit (fs/cgroup/memory.max or v1's "
   "memory/memory.limit_in_bytes); tests point it at a fake tree", kind::text},
  {id::host_pci_bus_ids, "TORPOR_HOST_PCI_BUS_IDS", "",
   "the host backend's PCI bus ids of its emulated devices, comma-separated (e.g. 0000:3b:00.0,0000:86:00.0): "
   "a fake topology for the host store's NUMA placement", kind::text},
  {id::nccl_graph_register, "NCCL_GRAPH_REGISTER", "",
   "NCCL's graph buffer registration (on when unset): it would pin torpor's graph memory through sleep; "
   "torpor.graph sets 0 when unset, torpor doctor reports it", kind::text},
  {id::pytorch_cuda_alloc_conf, "PYTORCH_CUDA_ALLOC_CONF", "",
   "PyTorch's allocator settings: expandable_segments:True is turned off inside torpor's pools (Python), "
   "torpor doctor reports it", kind::text},
  {id::pytorch_alloc_conf, "PYTORCH_ALLOC_CONF", "",
   "PyTorch's newer name for PYTORCH_CUDA_ALLOC_CONF, read the same way", kind::text},
  {id::host_node, "TORPOR_HOST_NODE", "0",
   "the host backend's emulated node: processes of different nodes cannot pass descriptors and share memory "
   "through fabric handles", kind::integer, 0, max_host_node},
  {id::host_fabric, "TORPOR_HOST_FABRIC", "on",
   "the host backend's emulated fabric (IMEX): on, off (no fabric support), no-channel (exports and imports fail "
   "as without an IMEX channel) or import-refused (imports fail; any case)",
   kind::choice, 0, 0, host_fabric_modes},
  {id::master_addr, "MASTER_ADDR", "", "tcp_group_from_env(): the host rank 0 listens on (torchrun's)", kind::text},
  {id::master_port, "MASTER_PORT", "", "tcp_group_from_env(): the port rank 0 listens on (torchrun's)",
   kind::integer, 1, 65535},
  {id::launcher_rank, "RANK", "", "tcp_group_from_env(): this rank (torchrun's)", kind::integer, 0,
   max_world_size - 1},
  {id::launcher_world_size, "WORLD_SIZE", "", "tcp_group_from_env(): the number of ranks (torchrun's)",
   kind::integer, 1, max_world_size},
  {id::local_rank, "LOCAL_RANK", "", "tcp_group_from_env(): this rank within its node (torchrun's)",
   kind::integer, 0, max_world_size - 1},
  {id::local_world_size, "LOCAL_WORLD_SIZE", "", "tcp_group_from_env(): the ranks on this node (torchrun's)",
   kind::integer, 1, max_world_size},
}};
// clang-format on

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

bool falsy(std::string_view v) {
  const std::string s = lower(v);
  return s.empty() || s == "0" || s == "false" || s == "no" || s == "off";
}

// "1024T" for 2^50: the largest suffix that divides the value.
std::string size_text(std::int64_t bytes) {
  constexpr std::array<std::pair<unsigned, char>, 4> suffixes = {{{40, 'T'}, {30, 'G'}, {20, 'M'}, {10, 'K'}}};
  for (auto [shift, suffix] : suffixes)
    if (bytes >= (std::int64_t{1} << shift) && bytes % (std::int64_t{1} << shift) == 0)
      return fmt::format("{}{}", bytes >> shift, suffix);
  return fmt::format("{}", bytes);
}

std::string accepted(const Option& o) {
  switch (o.parser) {
    case kind::choice: {
      std::string list;
      for (std::string_view c : o.choices) list += fmt::format("{}{}", list.empty() ? "" : ", ", c);
      return fmt::format("one of {} (any case)", list);
    }
    case kind::integer: return fmt::format("a whole number in [{}, {}]", o.min, o.max);
    case kind::size:
      return fmt::format("a size in [{}, {}] bytes (digits with an optional K, M, G or T suffix)", size_text(o.min),
                         size_text(o.max));
    case kind::text: return "any text";
    case kind::disable: return "any value; empty, 0, false, no and off leave it unset";
    case kind::nvls_enable: return "any value; 0, false, no and off disable multicast";
  }
  return "?";
}

[[noreturn]] void refuse(const Option& o, std::string_view text, std::string_view why) {
  throw invalid_argument(fmt::format("{}='{}' {}; use {}", o.name, text, why, accepted(o)));
}

std::int64_t parse_integer(const Option& o, std::string_view text) {
  std::int64_t v = 0;
  const char* first = text.data();
  const char* end = first + text.size();
  auto [at, ec] = std::from_chars(first, end, v);
  if (ec == std::errc::result_out_of_range) refuse(o, text, "is out of range");
  if (ec != std::errc() || at != end) refuse(o, text, "is not a whole number");
  if (v < o.min || v > o.max) refuse(o, text, "is out of range");
  return v;
}

std::int64_t parse_bounded_size(const Option& o, std::string_view text) {
  std::size_t v = 0;
  try {
    v = parse_size_text(text);
  } catch (const invalid_argument& e) {
    refuse(o, text, fmt::format("is not a size ({})", e.what()));
  }
  if (v < static_cast<std::size_t>(o.min) || v > static_cast<std::size_t>(o.max)) refuse(o, text, "is out of range");
  return static_cast<std::int64_t>(v);
}

// The row's value: the environment's when set, else the default; nothing when neither.
std::optional<std::string> value(id key) {
  const Option& o = option(key);
  if (auto text = raw(key)) return validate(o, *text);
  if (o.default_text.empty()) return std::nullopt;
  return validate(o, o.default_text);
}

// The value of a row that has a default: every accessor below that returns a plain value reads its
// row through this, so a row that loses its default is a typed error naming it, not an empty optional
// dereferenced.
std::string defaulted_value(id key) {
  auto v = value(key);
  if (!v) throw invalid_state(fmt::format("option {} has no default and is not set", option(key).name));
  return std::move(*v);
}

std::int64_t integer_value(id key) { return parse_integer(option(key), defaulted_value(key)); }

std::optional<std::int64_t> optional_integer(id key) {
  auto v = value(key);
  if (!v) return std::nullopt;
  return parse_integer(option(key), *v);
}

}  // namespace

std::size_t parse_size_text(std::string_view text) {
  if (text.empty()) throw invalid_argument("empty size");
  constexpr std::size_t max = std::numeric_limits<std::size_t>::max();
  std::size_t i = 0;
  std::size_t v = 0;
  while (i < text.size() && text[i] >= '0' && text[i] <= '9') {
    const auto digit = static_cast<std::size_t>(text[i] - '0');
    if (v > (max - digit) / 10) throw invalid_argument(fmt::format("size '{}' does not fit in 64 bits", text));
    v = v * 10 + digit;
    ++i;
  }
  if (i == 0) throw invalid_argument(fmt::format("size '{}' does not start with a number", text));
  const std::string_view suffix = text.substr(i);
  unsigned shift = 0;
  if (suffix.empty() || suffix == "B")
    shift = 0;
  else if (suffix == "K" || suffix == "KiB" || suffix == "k")
    shift = 10;
  else if (suffix == "M" || suffix == "MiB")
    shift = 20;
  else if (suffix == "G" || suffix == "GiB")
    shift = 30;
  else if (suffix == "T" || suffix == "TiB")
    shift = 40;
  else
    throw invalid_argument(fmt::format("size '{}': unknown suffix '{}' (use K, M, G or T)", text, suffix));
  if (v > (max >> shift)) throw invalid_argument(fmt::format("size '{}' does not fit in 64 bits", text));
  return v << shift;
}

std::span<const Option> table() { return rows; }

const Option& option(id key) {
  for (const Option& o : rows)
    if (o.key == key) return o;
  throw invalid_argument(fmt::format("no option with id {}", static_cast<int>(key)));
}

std::optional<std::string> raw(id key) {
  // The one getenv of the libraries and tools.
  const char* v = std::getenv(std::string(option(key).name).c_str());
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

std::string validate(const Option& o, std::string_view text) {
  switch (o.parser) {
    case kind::choice: {
      std::string v = lower(text);
      if (std::find(o.choices.begin(), o.choices.end(), v) == o.choices.end()) refuse(o, text, "is not accepted");
      return v;
    }
    case kind::integer: return fmt::format("{}", parse_integer(o, text));
    case kind::size: return size_text(parse_bounded_size(o, text));
    case kind::text:
    case kind::disable:
    case kind::nvls_enable: return std::string(text);
  }
  return std::string(text);
}

log::level log_level() {
  const std::string v = defaulted_value(id::log);
  if (v == "off") return log::level::off;
  if (v == "error") return log::level::error;
  if (v == "info") return log::level::info;
  if (v == "debug") return log::level::debug;
  return log::level::warn;
}

std::string backend() { return defaulted_value(id::backend); }

bool host_async() { return defaulted_value(id::host_mode) == "async"; }

int host_devices() { return static_cast<int>(integer_value(id::host_devices)); }

std::size_t host_device_memory() {
  return static_cast<std::size_t>(
      parse_bounded_size(option(id::host_device_memory), defaulted_value(id::host_device_memory)));
}

std::chrono::milliseconds group_timeout() { return std::chrono::milliseconds(integer_value(id::group_timeout_ms)); }

std::optional<std::string> group_rendezvous() { return value(id::group_rendezvous); }

std::optional<int> rank() {
  auto v = optional_integer(id::rank);
  return v ? std::optional<int>(static_cast<int>(*v)) : std::nullopt;
}

std::optional<int> world_size() {
  auto v = optional_integer(id::world_size);
  return v ? std::optional<int>(static_cast<int>(*v)) : std::nullopt;
}

std::string tmpdir() { return defaulted_value(id::tmpdir); }

std::string nccl_library() { return defaulted_value(id::nccl_library); }

bool tms_switch(id key) {
  const std::string v = defaulted_value(key);
  return v == "1" || v == "true" || v == "yes";
}

std::string tms_cpu_backup_backend() { return defaulted_value(id::tms_init_cpu_backup_backend); }

std::string tms_disk_backup_dir() { return defaulted_value(id::tms_disk_backup_dir); }

std::string sysfs_root() { return defaulted_value(id::sysfs_root); }

std::vector<std::string> host_pci_bus_ids() {
  std::vector<std::string> out;
  auto text = value(id::host_pci_bus_ids);
  if (!text) return out;
  std::string_view rest = *text;
  while (true) {
    std::size_t comma = rest.find(',');
    std::string_view item = rest.substr(0, comma);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    out.emplace_back(item);
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  return out;
}

int host_node() { return static_cast<int>(integer_value(id::host_node)); }

std::string host_fabric() { return defaulted_value(id::host_fabric); }

std::optional<std::string> master_addr() { return value(id::master_addr); }

namespace {
std::optional<int> optional_int(id key) {
  auto v = optional_integer(key);
  return v ? std::optional<int>(static_cast<int>(*v)) : std::nullopt;
}
}  // namespace

std::optional<int> master_port() { return optional_int(id::master_port); }
std::optional<int> launcher_rank() { return optional_int(id::launcher_rank); }
std::optional<int> launcher_world_size() { return optional_int(id::launcher_world_size); }
std::optional<int> local_rank() { return optional_int(id::local_rank); }
std::optional<int> local_world_size() { return optional_int(id::local_world_size); }

bool switch_set(const Option& o, const std::optional<std::string>& text) {
  if (!text) return false;
  if (o.parser == kind::disable) return !falsy(*text);
  if (o.parser == kind::nvls_enable) return !text->empty() && falsy(*text);
  return false;
}

std::optional<std::string> multicast_kill_switch() {
  for (const Option& o : rows) {
    if (o.parser != kind::disable && o.parser != kind::nvls_enable) continue;
    auto text = raw(o.key);
    if (text && switch_set(o, text)) return fmt::format("{}={}", o.name, *text);
  }
  return std::nullopt;
}

std::vector<Setting> effective() {
  std::vector<Setting> out;
  for (const Option& o : rows) {
    Setting s{o.name, std::string(o.default_text), false, {}, o.description};
    if (auto text = raw(o.key)) {
      s.from_environment = true;
      try {
        s.value = validate(o, *text);
      } catch (const invalid_argument& e) {
        s.value = *text;
        s.error = e.what();
      }
    }
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace torpor::options
