// Logging through fmt to stderr. The level comes from TORPOR_LOG (off|error|warn|info|debug in
// any case, default warn; an unknown value is reported once and leaves warn), read once. Log calls below the level cost
// one comparison.
#pragma once

#include <fmt/core.h>

#include <string_view>

namespace torpor::log {

enum class level : int { off = -1, error = 0, warn = 1, info = 2, debug = 3 };

level current_level() noexcept;
void set_level(level l) noexcept;
void write(level l, std::string_view message) noexcept;

template <typename... Args>
void emit(level l, fmt::format_string<Args...> f, Args&&... args) noexcept {
  if (static_cast<int>(l) > static_cast<int>(current_level())) return;
  try {
    write(l, fmt::format(f, std::forward<Args>(args)...));
  } catch (...) {  // NOLINT(bugprone-empty-catch): a log line is never worth an exception
  }
}

template <typename... Args>
void error(fmt::format_string<Args...> f, Args&&... a) noexcept {
  emit(level::error, f, std::forward<Args>(a)...);
}
template <typename... Args>
void warn(fmt::format_string<Args...> f, Args&&... a) noexcept {
  emit(level::warn, f, std::forward<Args>(a)...);
}
template <typename... Args>
void info(fmt::format_string<Args...> f, Args&&... a) noexcept {
  emit(level::info, f, std::forward<Args>(a)...);
}
template <typename... Args>
void debug(fmt::format_string<Args...> f, Args&&... a) noexcept {
  emit(level::debug, f, std::forward<Args>(a)...);
}

}  // namespace torpor::log
