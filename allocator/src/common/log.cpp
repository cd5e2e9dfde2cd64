#include "torpor/log.hpp"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace torpor::log {
namespace {

level level_from_env() noexcept {
  const char* v = std::getenv("TORPOR_LOG");
  if (v == nullptr) return level::warn;
  if (std::strcmp(v, "error") == 0) return level::error;
  if (std::strcmp(v, "info") == 0) return level::info;
  if (std::strcmp(v, "debug") == 0) return level::debug;
  return level::warn;
}

std::atomic<int>& level_storage() noexcept {
  static std::atomic<int> l{static_cast<int>(level_from_env())};
  return l;
}

const char* name(level l) noexcept {
  switch (l) {
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
