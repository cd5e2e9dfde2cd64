// make_compute: the Compute that runs where the driver's capabilities say the math runs.
#include <fmt/core.h>

#include "compute/compute_impl.hpp"
#include "torpor/error.hpp"

namespace torpor::fusion {

std::unique_ptr<Compute> make_compute(Driver& driver, int device) {
  if (driver.capabilities().compute == DriverCapabilities::Compute::cpu_reference)
    return make_host_compute(driver, device);
#ifdef TORPOR_KERNELS_CUDA
  return make_cuda_compute(driver, device);
#else
  throw unavailable(fmt::format("the {} driver runs device kernels, and this build has no CUDA kernels (configure with "
                                "TORPOR_CUDA=ON)",
                                driver.backend_name()));
#endif
}

}  // namespace torpor::fusion
