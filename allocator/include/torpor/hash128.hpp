// Hash128: a 128-bit content hash as the driver seam returns it (Driver::hash). How it is
// computed (the definition, the CPU reference, the GPU kernel) is the library's own
// (content_hash.hpp, not installed); a caller only compares two.
//
// This header stays C++17: the hash kernel, compiled as C++17, uses the type.
#pragma once

#include <cstdint>

namespace torpor {

struct Hash128 {
  std::uint64_t lo = 0;
  std::uint64_t hi = 0;
  bool operator==(const Hash128& o) const { return lo == o.lo && hi == o.hi; }
  bool operator!=(const Hash128& o) const { return !(*this == o); }
};

}  // namespace torpor
