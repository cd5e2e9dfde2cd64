// Choosing a backend: cuda when a usable GPU is present, host otherwise, overridable with
// TORPOR_BACKEND=host|cuda or in the API. The reason for the choice is kept so `torpor probe`
// and error messages can say why ("host: libcuda.so.1 could not be loaded ...").
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "torpor/backend_table.hpp"
#include "torpor/driver.hpp"
#include "torpor/host_driver.hpp"

namespace torpor {

// The backends' names (backend_table.hpp); a value the table lacks prints as "?".
std::string_view to_string(Backend b) noexcept;
// A name of backend_table.hpp's table ("auto", "host", "cuda"); throws invalid_argument otherwise.
Backend parse_backend(std::string_view name);
// TORPOR_BACKEND (any case), or automatic when unset; an unknown value throws invalid_argument
// naming the accepted ones.
Backend backend_from_env();
// Whether this build contains the CUDA backend.
bool cuda_backend_built() noexcept;

struct DriverSelection {
  std::shared_ptr<Driver> driver;
  Backend backend = Backend::host;
  std::string reason;
};

// A new driver. automatic: TORPOR_BACKEND if set, else cuda when a GPU with VMM support is
// usable, else host. cuda requested but unusable: throws error with the reason.
// HostDriver options come from `host_options` (defaults: see host_driver_options_from_env).
DriverSelection open_driver(Backend requested = Backend::automatic);
DriverSelection open_driver(Backend requested, const HostDriverOptions& host_options);

// TORPOR_HOST_DEVICES (1..64, default 8) and TORPOR_HOST_DEVICE_MEMORY (bytes, K/M/G/T
// suffixes, 1 to 1024T, default 16G): the emulated machine. A value out of range or with
// trailing text throws invalid_argument naming the accepted range.
HostDriverOptions host_driver_options_from_env();

// One driver per backend shared by the whole process (the C API and the PyTorch allocator
// use it so that every pool of the process sees the same devices).
DriverSelection shared_driver(Backend requested = Backend::automatic);

// "16G" -> 17179869184; plain digits are bytes. Throws invalid_argument, also for a size
// that does not fit in 64 bits.
std::size_t parse_size(std::string_view text);
std::string format_bytes(std::size_t bytes);

}  // namespace torpor
