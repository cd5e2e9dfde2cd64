// What a command leaves behind besides its exit code: a JSON results file, and a progress line
// while it runs.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace torpor::cli {

// Writes `j` (indented, one trailing newline) to `path`; on any failure (a missing directory, a
// full disk, a failed close) prints "torpor COMMAND: could not write PATH: why" on stderr and
// returns false, and the command must then exit non-zero: a run whose results were lost is not a
// success.
bool write_json_file(const std::string& path, const nlohmann::json& j, std::string_view command);

// A progress line on stderr, rewritten in place, when stderr is a terminal (nothing otherwise).
class Progress {
 public:
  explicit Progress(bool enabled);
  ~Progress();
  void update(const std::string& text);
  void done();

 private:
  bool enabled_;
  bool dirty_ = false;
};

}  // namespace torpor::cli
