// PoolOptions, checked and completed before a Pool takes anything from the driver: the device
// must support virtual memory management (and POSIX handles for an exportable pool); the
// handle-size policy's defaults are filled in and rounded to the granularity; the sleep engine's
// and the host store's knobs are range-checked; the peers must exist and reach the device. Every
// refusal names the option and its bounds, and nothing is reserved or created before it.
#pragma once

#include <vector>

#include "torpor/driver.hpp"
#include "torpor/pool.hpp"

namespace torpor {

// Checks `o` against the device `props` describes and fills in its defaults.
void validate_pool_options(PoolOptions& o, const DeviceProperties& props);

// The pool's device and every distinct peer of `o` (of `count` devices), each of which must be
// able to access it.
std::vector<int> access_devices(Driver& driver, const PoolOptions& o, int count);

}  // namespace torpor
