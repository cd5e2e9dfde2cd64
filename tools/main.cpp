// torpor: the command-line tool. `torpor probe` reports what torpor sees on this machine;
// `torpor doctor` judges it (can torpor run at full speed here, and the fix for each finding);
// `torpor symmetric-check` runs symmetric memory through sleep across processes; `torpor stress`
// runs the sleep-mode test plan on a tiny MoE model; `torpor rl-loop` the RL weight-update loop.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>

#include "commands.hpp"
#include "torpor/log.hpp"

int main(int argc, char** argv) {
  torpor::log::current_level();  // reports an unknown TORPOR_LOG now, not at the first message
  // Everything inside the try, setup included: an exception leaving main would end the process
  // without a message.
  try {
    const int exit_code = torpor::cli::run_command_line(argc, argv);
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
