// make_compute: the Compute that matches the driver's backend.
#include <fmt/format.h>

#include "compute_impl.hpp"
#include "torpor/error.hpp"

namespace torpor::fusion {

std::unique_ptr<Compute> make_compute(Driver& driver, int device) {
  if (driver.backend_name() == "host") return make_host_compute(driver, device);
  if (driver.backend_name() == "cuda") {
#ifdef TORPOR_KERNELS_CUDA
    return make_cuda_compute(driver, device);
#else
    throw unavailable("the cuda backend needs the CUDA kernels, and this build has none (configure with TORPOR_CUDA=ON)");
#endif
  }
  throw invalid_argument(fmt::format("make_compute: unknown backend '{}' (expected host or cuda)", driver.backend_name()));
}

}  // namespace torpor::fusion
