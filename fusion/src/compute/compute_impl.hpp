// The Compute implementations' factories (compute.cpp picks one by the driver's capabilities).
#pragma once

#include <memory>

#include "torpor/fusion/compute.hpp"

namespace torpor::fusion {

std::unique_ptr<Compute> make_host_compute(Driver& driver, int device);
#ifdef TORPOR_KERNELS_CUDA
std::unique_ptr<Compute> make_cuda_compute(Driver& driver, int device);
#endif

}  // namespace torpor::fusion
