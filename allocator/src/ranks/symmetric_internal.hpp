// What the parts of SymmetricHeap (symmetric*.cpp) share besides the class itself.
#pragma once

#include <fmt/core.h>
#include <fmt/ranges.h>

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "torpor/symmetric.hpp"

namespace torpor::detail {

// "[1, 4]": the ids of `buffers`, for messages.
inline std::string ids_of(const std::vector<SymmetricBuffer*>& buffers) {
  std::vector<std::uint64_t> ids;
  ids.reserve(buffers.size());
  for (auto* b : buffers) ids.push_back(b->id());
  return fmt::format("[{}]", fmt::join(ids, ", "));
}

// Runs fn and keeps the first exception, so a cleanup can try every piece.
template <typename F>
void attempt(std::exception_ptr& first, F&& fn) {
  try {
    fn();
  } catch (...) {
    if (!first) first = std::current_exception();
  }
}

}  // namespace torpor::detail
