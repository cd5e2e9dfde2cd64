// torpor's error types. Every failure a caller can act on is one of these; the C API maps
// each to a status code. driver_error carries the driver's numeric result and the call that
// produced it, so "cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY" is always attributable.
#pragma once

#include <stdexcept>
#include <string>

namespace torpor {

// Numeric results shared by every backend. The values are the CUresult values of the CUDA
// driver API so a HostDriver failure reads the same as the GPU's; this header does not
// include cuda.h (only the driver layer does).
enum class driver_status : int {
  success = 0,
  invalid_value = 1,
  out_of_memory = 2,
  not_initialized = 3,
  no_device = 100,
  invalid_device = 101,
  not_supported = 801,
  not_permitted = 800,
  unknown = 999,
};

const char* to_string(driver_status s) noexcept;

class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A request that can never succeed as asked: bad size, unknown pointer, unknown tag, ...
class invalid_argument : public error {
 public:
  using error::error;
};

// A request that is valid but not in the current state (allocate into a sleeping tag).
class invalid_state : public error {
 public:
  using error::error;
};

// Device (or host backing store) memory exhausted.
class out_of_memory : public error {
 public:
  using error::error;
};

// A backend or feature this machine (or this build) cannot provide: the cuda backend without
// a usable GPU, multicast where it is disabled.
class unavailable : public error {
 public:
  using error::error;
};

// A bounded wait ran out (collective peer missing, device-side spin deadline).
class timeout_error : public error {
 public:
  using error::error;
};

// A driver call failed. code() is the CUresult value (or HostDriver's equivalent).
class driver_error : public error {
 public:
  driver_error(int code, std::string call, const std::string& detail);
  int code() const noexcept { return code_; }
  bool is_out_of_memory() const noexcept { return code_ == static_cast<int>(driver_status::out_of_memory); }
  const std::string& call() const noexcept { return call_; }

 private:
  int code_;
  std::string call_;
};

[[noreturn]] void throw_driver_error(int code, const char* call, const std::string& detail);

}  // namespace torpor
