// Subcommands of the torpor CLI. Each registers itself on the app and returns the exit code
// through the callback it installs.
#pragma once

#include <CLI/CLI.hpp>

namespace torpor::cli {

void add_probe(CLI::App& app, int& exit_code);
void add_doctor(CLI::App& app, int& exit_code);
void add_symmetric_check(CLI::App& app, int& exit_code);
void add_stress(CLI::App& app, int& exit_code);
void add_rl_loop(CLI::App& app, int& exit_code);

}  // namespace torpor::cli
