// `torpor symmetric-check`'s options (symmetric_check.cpp runs it; command_line.cpp sets them).
#pragma once

#include <string>

#include "launch/launch.hpp"

namespace torpor::cli {

struct SymmetricCheckOptions {
  int ranks = 2;
  int nodes = 1;
  std::string bytes = "1G";
  std::string backend = "auto";
  std::string group = "unix";
  std::string json;
  GroupTimeout timeout{120};  // 120 s unless the flags or TORPOR_GROUP_TIMEOUT_MS say otherwise
  bool timeout_check = false;
  bool worker = false;
};

}  // namespace torpor::cli
