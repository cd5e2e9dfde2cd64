#include "driver/multicast_policy.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstdlib>
#include <string_view>

namespace torpor {
namespace {

bool falsy(std::string_view v) {
  std::string s(v);
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s.empty() || s == "0" || s == "false" || s == "no" || s == "off";
}

}  // namespace

std::optional<std::string> multicast_kill_switch() {
  // Variables that disable multicast when set to a true value.
  constexpr std::array<const char*, 3> disable_vars = {"TORPOR_DISABLE_MULTICAST", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                       "NVSHMEM_DISABLE_NVLS"};
  for (const char* name : disable_vars) {
    const char* v = std::getenv(name);
    if (v != nullptr && !falsy(v)) return fmt::format("{}={}", name, v);
  }
  // NCCL's switch is an enable flag: 0 disables.
  if (const char* v = std::getenv("NCCL_NVLS_ENABLE"); v != nullptr && falsy(v) && *v != '\0')
    return fmt::format("NCCL_NVLS_ENABLE={}", v);
  return std::nullopt;
}

MulticastProbe probe_multicast(Driver& driver, int device) {
  MulticastProbe p;
  p.kill_switch = multicast_kill_switch();
  p.entry_points = driver.multicast_entry_points();
  p.attribute = driver.device_properties(device).multicast_attribute;
  if (p.kill_switch) {
    p.reason = fmt::format("disabled by {}", *p.kill_switch);
  } else if (!p.attribute) {
    p.reason = fmt::format("device {} reports no multicast support (CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 0)", device);
  } else if (!p.entry_points) {
    p.reason = "the driver library lacks the multicast entry points (cuMulticastCreate etc.)";
  } else {
    p.usable = true;
  }
  return p;
}

}  // namespace torpor
