// Whether multicast (NVLS) may be used on a device, decided before anything is created.
//
// Multicast is used only when the device reports CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, the
// driver library has every multicast entry point, and no kill switch is set:
//   TORPOR_DISABLE_MULTICAST=1, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1,
//   NCCL_NVLS_ENABLE=0.
// The kill switches are read on every call (tests set them) and are honoured by the driver
// seam itself too: CudaDriver refuses cuMulticastCreate while one is set.
// Across ranks the decision is a collective AND (symmetric layer); this is one device's part.
#pragma once

#include <optional>
#include <string>

#include "torpor/driver.hpp"

namespace torpor {

// "NAME=value" of the first kill switch that is set, or nothing.
std::optional<std::string> multicast_kill_switch();

struct MulticastProbe {
  bool usable = false;
  bool attribute = false;     // the device says it supports multicast
  bool entry_points = false;  // the driver library has the calls
  std::optional<std::string> kill_switch;
  std::string reason;  // why not usable ("" when usable)
};

// Reads the kill switches first, so a disabled machine never even queries multicast state.
MulticastProbe probe_multicast(Driver& driver, int device);

}  // namespace torpor
