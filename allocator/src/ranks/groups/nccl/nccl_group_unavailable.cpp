// NcclGroup in a build without NCCL (TORPOR_NCCL off: no CUDA backend, or no nccl.h where CMake
// looked): available() says so, and constructing one throws the same sentence.
#include <fmt/core.h>

#include "torpor/error.hpp"
#include "torpor/nccl_group.hpp"

namespace torpor {

struct NcclGroup::Impl {};

namespace {
constexpr const char* not_built =
    "this torpor was built without NCCL support (it needs the CUDA backend, TORPOR_CUDA=ON, and nccl.h)";
}

bool NcclGroup::available(std::string* why_not) {
  if (why_not != nullptr) *why_not = not_built;
  return false;
}

NcclGroup::NcclGroup(Group&, Driver&, int, const GroupOptions& options) : Group(options) {
  throw error(fmt::format("NcclGroup: {}", not_built));
}

NcclGroup::~NcclGroup() = default;
int NcclGroup::rank() const noexcept { return 0; }
int NcclGroup::size() const noexcept { return 0; }
bool NcclGroup::carries_fds() const noexcept { return false; }
std::vector<std::vector<std::byte>> NcclGroup::all_gather(std::span<const std::byte>) { throw error(not_built); }
std::vector<std::vector<UniqueFd>> NcclGroup::all_gather_fds(std::span<const int>) { throw error(not_built); }
void NcclGroup::barrier() { throw error(not_built); }
void NcclGroup::recover() { throw error(not_built); }

}  // namespace torpor
