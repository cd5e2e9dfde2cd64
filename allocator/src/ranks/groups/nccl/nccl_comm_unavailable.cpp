// NcclComm in a build without NCCL (TORPOR_NCCL off: no CUDA backend, or no nccl.h where CMake
// looked): available() says so, and constructing one throws unavailable.
#include "torpor/error.hpp"
#include "torpor/nccl_comm.hpp"

namespace torpor {

struct NcclComm::Impl {};

bool NcclComm::available(std::string* why_not) {
  if (why_not != nullptr) *why_not = "this build has no NCCL support (TORPOR_CUDA=OFF or nccl.h not found)";
  return false;
}
NcclComm::NcclComm(Group&, int) {
  throw unavailable("the unfused tail's all-reduce needs NCCL: this build has no NCCL support (TORPOR_CUDA=OFF or "
                    "nccl.h not found)");
}
NcclComm::~NcclComm() = default;
void NcclComm::all_reduce_sum_f32(void*, std::size_t, void*) {}
void NcclComm::all_reduce_sum_bf16(void*, std::size_t, void*) {}
void NcclComm::check() {}

}  // namespace torpor
