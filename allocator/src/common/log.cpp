#include "torpor/log.hpp"

#include <atomic>
#include <cstdio>
#include <exception>
#include <string>

#include "common/options.hpp"

namespace torpor::log {
namespace {

// An unknown TORPOR_LOG is reported here (through write(), which does not consult the level
// being decided) and leaves the default.
level level_from_env() noexcept {
  try {
    try {
      return options::log_level();
    } catch (const std::exception& e) {
      write(level::warn, std::string(e.what()) + "; logging at warn");
    }
  } catch (...) {  // NOLINT(bugprone-empty-catch): warn is the level when even that fails
  }
  return level::warn;
}

std::atomic<int>& level_storage() noexcept {
  static std::atomic<int> l{static_cast<int>(level_from_env())};
  return l;
}

const char* name(level l) noexcept {
  switch (l) {
    case level::off: return "off";
    case level::error: return "error";
    case level::warn: return "warn";
    case level::info: return "info";
    case level::debug: return "debug";
  }
  return "?";
}

}  // namespace

level current_level() noexcept { return static_cast<level>(level_storage().load(std::memory_order_relaxed)); }
void set_level(level l) noexcept { level_storage().store(static_cast<int>(l), std::memory_order_relaxed); }

void write(level l, std::string_view message) noexcept {
  // One fprintf per line so lines from several threads do not interleave.
  std::fprintf(stderr, "torpor %s: %.*s\n", name(l), static_cast<int>(message.size()), message.data());
}

}  // namespace torpor::log
