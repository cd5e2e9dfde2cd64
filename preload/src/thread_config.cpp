// The per-thread region settings (preload.hpp: ThreadConfig): each unset one read from its TMS_*
// variable on first use (torpor::options, the one environment table).
#include <fmt/core.h>

#include <exception>
#include <string>

#include "preload.hpp"

namespace torpor::preload {

bool env_switch(torpor::options::id key) {
  try {
    return torpor::options::tms_switch(key);
  } catch (const std::exception& e) {
    say(fmt::format("{}: taken as off", e.what()));  // torch_memory_saver exits here
    return false;
  }
}

namespace {

std::string env_backend() {
  try {
    return torpor::options::tms_cpu_backup_backend();
  } catch (const std::exception& e) {
    say(fmt::format("{}: taken as pinned", e.what()));
    return "pinned";
  }
}

}  // namespace

bool ThreadConfig::is_interesting() {
  if (!interesting) interesting = env_switch(torpor::options::id::tms_init_enable);
  return *interesting;
}
bool ThreadConfig::enable_cpu_backup() {
  if (!cpu_backup) cpu_backup = env_switch(torpor::options::id::tms_init_enable_cpu_backup);
  return *cpu_backup;
}
bool ThreadConfig::enable_disk_backup() {
  if (!disk_backup) disk_backup = env_switch(torpor::options::id::tms_init_enable_disk_backup);
  return *disk_backup;
}
const std::string& ThreadConfig::cpu_backup_backend() {
  if (!backend) backend = env_backend();
  return *backend;
}

ThreadConfig& thread_config() {
  thread_local ThreadConfig config;
  return config;
}

}  // namespace torpor::preload
