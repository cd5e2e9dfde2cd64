// A command's JSON results file and progress line (output.hpp).
#include "output.hpp"

#include <fmt/core.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace torpor::cli {

bool write_json_file(const std::string& path, const nlohmann::json& j, std::string_view command) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    fmt::print(stderr, "torpor {}: could not write {}: {}\n", command, path, std::strerror(errno));
    return false;
  }
  const std::string text = j.dump(2) + "\n";
  const bool written = std::fwrite(text.data(), 1, text.size(), f) == text.size() && std::fflush(f) == 0;
  const int write_errno = errno;
  const bool closed = std::fclose(f) == 0;
  if (!written || !closed) {
    fmt::print(stderr, "torpor {}: could not write {}: {}\n", command, path,
               std::strerror(!written ? write_errno : errno));
    return false;
  }
  return true;
}

Progress::Progress(bool enabled) : enabled_(enabled && ::isatty(STDERR_FILENO) == 1) {}
Progress::~Progress() { done(); }

void Progress::update(const std::string& text) {
  if (!enabled_) return;
  std::fprintf(stderr, "\r\033[K%s", text.c_str());
  std::fflush(stderr);
  dirty_ = true;
}

void Progress::done() {
  if (!enabled_ || !dirty_) return;
  std::fprintf(stderr, "\r\033[K");
  std::fflush(stderr);
  dirty_ = false;
}

}  // namespace torpor::cli
