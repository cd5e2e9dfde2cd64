// `torpor rl-loop`'s options (rl_loop.cpp runs it; command_line.cpp sets them).
#pragma once

#include <cstdint>
#include <string>

#include "launch/launch.hpp"
#include "stress/model_flags.hpp"

namespace torpor::cli {

struct RlOptions {
  ModelFlags model;
  int ranks = 0;  // 0 = default: every GPU on cuda, 2 on host
  bool processes = false;
  std::string backend = "auto";
  int iterations = 3;
  std::uint64_t update_seed = 7;
  float update_scale = 0.05f;
  double train_fraction = 0.95;
  std::string train_cap = "1G";
  std::string json;
  GroupTimeout group_timeout;  // 60 s unless the flags or TORPOR_GROUP_TIMEOUT_MS say otherwise
  bool progress = true;
  bool worker = false;
};

}  // namespace torpor::cli
