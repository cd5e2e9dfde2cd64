// nccl_info() in a build without NCCL support (TORPOR_NCCL off). See nccl_info.hpp.
#include "ranks/groups/nccl/nccl_info.hpp"

namespace torpor {

NcclInfo nccl_info() {
  NcclInfo info;
  info.why_not = "this build has no NCCL support (TORPOR_CUDA=OFF or nccl.h not found)";
  return info;
}

}  // namespace torpor
