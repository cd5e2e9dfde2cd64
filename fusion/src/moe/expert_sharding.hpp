// The experts' intermediate sizes are split evenly over the ranks (each holds inter / ranks of
// every routed expert and shared_inter / ranks of the shared one): the one rule LatentMoERunner
// and TinyMoeLM (which checks its config before building any runner) both enforce.
#pragma once

#include <fmt/core.h>

#include <string>

namespace torpor::fusion {

// Why `inter` and `shared_inter` cannot be split over `ranks`, or "" when they can.
inline std::string expert_sharding_problem(int inter, int shared_inter, int ranks) {
  if (inter <= 0 || inter % ranks != 0)
    return fmt::format("inter = {} must be a positive multiple of the rank count {} (it is sharded over the ranks)",
                       inter, ranks);
  if (shared_inter < 0 || shared_inter % ranks != 0)
    return fmt::format("shared_inter = {} must be 0 or a multiple of the rank count {}", shared_inter, ranks);
  return "";
}

}  // namespace torpor::fusion
