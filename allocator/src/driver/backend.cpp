#include "torpor/backend.hpp"

#include <fmt/format.h>

#include <cstdlib>
#include <map>
#include <mutex>

#include "torpor/error.hpp"
#include "torpor/log.hpp"
#ifdef TORPOR_HAVE_CUDA
#include "driver/cuda_driver.hpp"
#endif

namespace torpor {

std::string_view to_string(Backend b) noexcept {
  switch (b) {
    case Backend::automatic: return "auto";
    case Backend::host: return "host";
    case Backend::cuda: return "cuda";
  }
  return "?";
}

Backend parse_backend(std::string_view name) {
  if (name == "auto" || name.empty()) return Backend::automatic;
  if (name == "host") return Backend::host;
  if (name == "cuda") return Backend::cuda;
  throw invalid_argument(fmt::format("unknown backend '{}' (expected auto, host or cuda)", name));
}

Backend backend_from_env() {
  const char* v = std::getenv("TORPOR_BACKEND");
  if (v == nullptr) return Backend::automatic;
  try {
    return parse_backend(v);
  } catch (const invalid_argument& e) {
    throw invalid_argument(fmt::format("TORPOR_BACKEND: {}", e.what()));
  }
}

bool cuda_backend_built() noexcept {
#ifdef TORPOR_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

std::size_t parse_size(std::string_view text) {
  if (text.empty()) throw invalid_argument("empty size");
  std::size_t i = 0;
  unsigned long long v = 0;
  while (i < text.size() && text[i] >= '0' && text[i] <= '9') {
    v = v * 10 + static_cast<unsigned>(text[i] - '0');
    ++i;
  }
  if (i == 0) throw invalid_argument(fmt::format("size '{}' does not start with a number", text));
  std::string_view suffix = text.substr(i);
  unsigned shift = 0;
  if (suffix.empty() || suffix == "B") shift = 0;
  else if (suffix == "K" || suffix == "KiB" || suffix == "k") shift = 10;
  else if (suffix == "M" || suffix == "MiB") shift = 20;
  else if (suffix == "G" || suffix == "GiB") shift = 30;
  else if (suffix == "T" || suffix == "TiB") shift = 40;
  else throw invalid_argument(fmt::format("size '{}': unknown suffix '{}' (use K, M, G or T)", text, suffix));
  return static_cast<std::size_t>(v) << shift;
}

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
  if (const char* v = std::getenv("TORPOR_HOST_DEVICES")) {
    int n = std::atoi(v);
    if (n < 1 || n > 64) throw invalid_argument(fmt::format("TORPOR_HOST_DEVICES={} must be 1..64", v));
    o.devices = n;
  }
  if (const char* v = std::getenv("TORPOR_HOST_DEVICE_MEMORY")) o.device_bytes = parse_size(v);
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
  if (requested == Backend::host)
    return host(from_env ? "requested by TORPOR_BACKEND=host" : "requested");

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
