// torpor: the command-line tool. `torpor probe` reports what torpor sees on this machine;
// `torpor doctor` judges it (can torpor run at full speed here, and the fix for each finding);
// `torpor symmetric-check` runs symmetric memory through sleep across processes; `torpor stress`
// runs the sleep-mode test plan on a tiny MoE model; `torpor rl-loop` the RL weight-update loop.
#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include "commands.hpp"
#include "torpor/log.hpp"
#include "torpor/torpor.h"

int main(int argc, char** argv) {
  torpor::log::current_level();  // reports an unknown TORPOR_LOG now, not at the first message
  // Everything inside the try, setup included: an exception leaving main would end the process
  // without a message.
  try {
    CLI::App app{"torpor: a sleep-mode-aware GPU memory pool allocator on CUDA virtual memory"};
    app.require_subcommand(1);
    // The library's version (VERSION at the repository root, through torpor_version()): the CLI
    // reports what it runs on, so a stale libtorpor beside a new CLI shows here.
    app.set_version_flag("--version", std::string("torpor ") + torpor_version());
    int exit_code = 0;
    torpor::cli::add_probe(app, exit_code);
    torpor::cli::add_doctor(app, exit_code);
    torpor::cli::add_symmetric_check(app, exit_code);
    torpor::cli::add_stress(app, exit_code);
    torpor::cli::add_rl_loop(app, exit_code);
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      return app.exit(e);
    }
    // What was printed must have reached stdout: a full disk or a closed pipe behind it is a
    // failure of the command, not a success with the output lost (issue 33 N16).
    if (std::fflush(stdout) != 0 || std::ferror(stdout) != 0) {
      std::fprintf(stderr, "torpor: writing the output failed: %s\n", std::strerror(errno));
      return exit_code != 0 ? exit_code : 1;
    }
    return exit_code;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torpor: %s\n", e.what());
    return 1;
  }
}
