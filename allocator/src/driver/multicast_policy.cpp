#include "driver/multicast_policy.hpp"

#include <fmt/format.h>

#include "common/options.hpp"

namespace torpor {

// Which values count as set lives with the table (common/options.hpp); read on every call.
std::optional<std::string> multicast_kill_switch() { return options::multicast_kill_switch(); }

MulticastProbe probe_multicast(Driver& driver, int device) {
  MulticastProbe p;
  p.kill_switch = multicast_kill_switch();
  p.entry_points = driver.multicast_entry_points();
  p.attribute = driver.device_properties(device).multicast_attribute;
  if (p.kill_switch) {
    p.reason = fmt::format("disabled by {}", *p.kill_switch);
  } else if (!p.attribute) {
    p.reason =
        fmt::format("device {} reports no multicast support (CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED = 0)", device);
  } else if (!p.entry_points) {
    p.reason = "the driver library lacks the multicast entry points (cuMulticastCreate etc.)";
  } else {
    p.usable = true;
  }
  return p;
}

}  // namespace torpor
