#include "torpor/error.hpp"

#include <fmt/core.h>

namespace torpor {

const char* to_string(driver_status s) noexcept {
  switch (s) {
    case driver_status::success: return "CUDA_SUCCESS";
    case driver_status::invalid_value: return "CUDA_ERROR_INVALID_VALUE";
    case driver_status::out_of_memory: return "CUDA_ERROR_OUT_OF_MEMORY";
    case driver_status::not_initialized: return "CUDA_ERROR_NOT_INITIALIZED";
    case driver_status::no_device: return "CUDA_ERROR_NO_DEVICE";
    case driver_status::invalid_device: return "CUDA_ERROR_INVALID_DEVICE";
    case driver_status::not_supported: return "CUDA_ERROR_NOT_SUPPORTED";
    case driver_status::not_permitted: return "CUDA_ERROR_NOT_PERMITTED";
    case driver_status::unknown: return "CUDA_ERROR_UNKNOWN";
  }
  return "CUDA_ERROR_UNKNOWN";
}

driver_error::driver_error(int code, std::string call, const std::string& detail)
    : error(fmt::format("{} failed: {}", call, detail)), code_(code), call_(std::move(call)) {}

void throw_driver_error(int code, const char* call, const std::string& detail) {
  throw driver_error(code, call, detail);
}

}  // namespace torpor
