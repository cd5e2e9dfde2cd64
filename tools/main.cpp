// torpor: the command-line tool. `torpor probe` reports what torpor sees on this machine;
// `torpor symmetric-check` runs symmetric memory through sleep across processes; `torpor stress`
// runs the sleep-mode test plan on a tiny MoE model; `torpor rl-loop` the RL weight-update loop.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <exception>

#include "commands.hpp"
#include "torpor/log.hpp"

int main(int argc, char** argv) {
  torpor::log::current_level();  // reports an unknown TORPOR_LOG now, not at the first message
  CLI::App app{"torpor: a sleep-mode-aware GPU memory pool allocator on CUDA virtual memory"};
  app.require_subcommand(1);
  int exit_code = 0;
  torpor::cli::add_probe(app, exit_code);
  torpor::cli::add_symmetric_check(app, exit_code);
  torpor::cli::add_stress(app, exit_code);
  torpor::cli::add_rl_loop(app, exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    fmt::print(stderr, "torpor: {}\n", e.what());
    return 1;
  }
  return exit_code;
}
