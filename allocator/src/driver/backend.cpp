// Choosing a backend (torpor/backend.hpp): the backends' names come from backend_table.hpp;
// open_driver tries cuda (CudaDriver::open, then VMM support on device 0) unless host was asked
// for, and keeps the reason for its choice, so `torpor probe` and errors can say why. A cuda
// backend that was asked for and cannot be used is an error naming the cause, never a silent
// fall back to host. shared_driver keeps one driver per backend for the whole process, never
// destroyed (pools may still use it while static destructors run).
#include "torpor/backend.hpp"

#include <fmt/core.h>

#include <array>
#include <map>
#include <mutex>

#include "common/enum_names.hpp"
#include "common/options.hpp"
#include "torpor/error.hpp"
#include "torpor/log.hpp"
#ifdef TORPOR_HAVE_CUDA
#include "driver/cuda_driver.hpp"
#endif

namespace torpor {

namespace {

// backend_table's names as an enum name table, for to_string and parse_backend.
constexpr auto backend_enum_names = [] {
  EnumNames<Backend, backend_table.size()> names{};
  for (std::size_t i = 0; i < backend_table.size(); ++i) names[i] = {backend_table[i].value, backend_table[i].name};
  return names;
}();

}  // namespace

std::string_view to_string(Backend b) noexcept { return name_of(backend_enum_names, b); }

Backend parse_backend(std::string_view name) {
  if (name.empty()) return Backend::automatic;
  return parse_named(backend_enum_names, name, "backend");
}

Backend backend_from_env() { return parse_backend(options::backend()); }

bool cuda_backend_built() noexcept {
#ifdef TORPOR_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

std::size_t parse_size(std::string_view text) { return options::parse_size_text(text); }

std::string format_bytes(std::size_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{} B", bytes) : fmt::format("{:.2f} {}", v, units[u]);
}

HostDriverOptions host_driver_options_from_env() {
  HostDriverOptions o;
  o.devices = options::host_devices();
  o.device_bytes = options::host_device_memory();
  o.async = options::host_async();
  o.pci_bus_ids = options::host_pci_bus_ids();
  o.node = options::host_node();
  const std::string fabric = options::host_fabric();
  o.fabric = fabric == "off"              ? HostDriverOptions::Fabric::off
             : fabric == "no-channel"     ? HostDriverOptions::Fabric::no_channel
             : fabric == "import-refused" ? HostDriverOptions::Fabric::import_refused
                                          : HostDriverOptions::Fabric::on;
  return o;
}

DriverSelection open_driver(Backend requested) { return open_driver(requested, host_driver_options_from_env()); }

DriverSelection open_driver(Backend requested, const HostDriverOptions& host_options) {
  bool from_env = false;
  if (requested == Backend::automatic) {
    requested = backend_from_env();
    from_env = requested != Backend::automatic;
  }
  auto host = [&](std::string reason) {
    return DriverSelection{std::make_shared<HostDriver>(host_options), Backend::host, std::move(reason)};
  };
  if (requested == Backend::host) return host(from_env ? "requested by TORPOR_BACKEND=host" : "requested");

  std::string why;
#ifdef TORPOR_HAVE_CUDA
  if (auto cuda = CudaDriver::open(&why)) {
    DeviceProperties p = cuda->device_properties(0);
    if (p.vmm_supported) {
      std::string reason = fmt::format("{} CUDA device(s), driver {}.{}, VMM supported", cuda->device_count(),
                                       cuda->driver_version() / 1000, (cuda->driver_version() % 1000) / 10);
      return DriverSelection{std::shared_ptr<Driver>(std::move(cuda)), Backend::cuda, std::move(reason)};
    }
    why = fmt::format("device 0 ({}) does not support CUDA virtual memory management", p.name);
  }
#else
  why = "this build of torpor has no CUDA backend (configured with TORPOR_CUDA=OFF)";
#endif
  if (requested == Backend::cuda)
    throw unavailable(fmt::format("the cuda backend was requested{} but cannot be used: {}",
                                  from_env ? " (TORPOR_BACKEND=cuda)" : "", why));
  return host(fmt::format("no usable GPU: {}", why));
}

DriverSelection shared_driver(Backend requested) {
  // Never destroyed: pools may still use the driver while static destructors run at exit.
  static std::mutex& mu = *new std::mutex;
  static std::map<Backend, DriverSelection>& cache = *new std::map<Backend, DriverSelection>;
  std::lock_guard lock(mu);
  if (requested == Backend::automatic) requested = backend_from_env();
  auto it = cache.find(requested);
  if (it != cache.end()) return it->second;
  DriverSelection sel = open_driver(requested);
  cache[requested] = sel;
  if (requested == Backend::automatic) cache[sel.backend] = sel;
  return sel;
}

}  // namespace torpor
